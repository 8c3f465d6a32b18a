"""Helpers shared by the benchmark scripts: memory readings of the current process (Linux).

Peak memory is read from ``VmHWM`` in ``/proc/self/status`` rather than from
``getrusage``'s ``ru_maxrss``: on Linux ``ru_maxrss`` survives ``exec``, so a
child started by a large parent would report the parent's peak.
"""


def proc_status_bytes(field):
    """A ``kB`` field of /proc/self/status (VmRSS: current, VmHWM: peak) in bytes, or None.

    None where the file cannot be read (not Linux) or has no such field.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss():
    """Resets the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0).

    Returns:
        True where the mark was reset, False where the kernel does not allow it.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
