"""Atomic publication of files and directories, and cleanup after killed writers.

Every file this package writes for another process to read (SavedModel
versions, ONNX graphs, export manifests, training backups) is first written
in full inside a *staging directory* named ``.tmp-<random>`` next to its
destination, flushed to disk, and then moved into place with one
``rename``/``os.replace``: a reader sees the old file or the complete new
one, never a partial one, whatever moment the writer is killed at.

A killed writer leaves its staging directory behind. `clean_stale` removes
such leftovers: each live writer holds an exclusive `flock` on its staging
directory for as long as it works in it (the kernel drops the lock when the
process dies, SIGKILL included), so a staging directory whose lock can be
taken belongs to nobody. Creating a staging directory and cleaning happen
under a short lock on the parent directory, so a cleaner never sees a
staging directory that its creator has not locked yet. Where `fcntl` is
missing (Windows), leftovers older than `STALE_WITHOUT_LOCKS_S` are removed.

`fault_point(name)` marks the steps between writes. Tests kill the process at
one of them (``KERAS_LINATTN_KILL_AT=<name>`` sends SIGKILL to the process
itself there) or observe the files there (`set_fault_hook`); see
docs/faults.md.
"""

import contextlib
import hashlib
import os
import shutil
import signal
import tempfile
import time

try:  # POSIX only
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

TMP_PREFIX = ".tmp-"
KILL_ENV = "KERAS_LINATTN_KILL_AT"
# Without flock, a staging directory this old is considered abandoned.
STALE_WITHOUT_LOCKS_S = 3600.0

_fault_hook = None


# ------------------------------------------------------------------ faults
def set_fault_hook(hook):
    """Installs ``hook(name)``, called at every `fault_point` (None removes it). Returns the previous hook."""
    global _fault_hook
    previous, _fault_hook = _fault_hook, hook
    return previous


def fault_point(name):
    """A point between two writes where a test may observe the files or kill the process.

    ``KERAS_LINATTN_KILL_AT=<name>`` (a comma-separated list is accepted)
    makes the process send itself SIGKILL here: no ``finally`` block, no
    ``atexit`` handler and no buffered write runs, as on a real pre-emption.
    """
    if _fault_hook is not None:
        _fault_hook(name)
    wanted = os.environ.get(KILL_ENV)
    if wanted and name in wanted.split(","):
        os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------ fsync
def fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path):
    """Flushes a directory's entries (a rename is durable once its directory is synced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms that cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - e.g. some network file systems
        pass
    finally:
        os.close(fd)


def fsync_tree(root):
    """Flushes every file and directory under `root` (a directory or a single file)."""
    if os.path.isfile(root):
        fsync_file(root)
        return
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


# ------------------------------------------------------------------ locks
@contextlib.contextmanager
def locked_dir(path):
    """Holds an exclusive `flock` on the directory `path` (no-op without fcntl)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _try_lock(path):
    """An fd holding an exclusive lock on `path`, or None when another process holds it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


# ------------------------------------------------------------------ staging
def is_temporary(name):
    """Whether a directory entry is a staging directory or temporary file."""
    return name.startswith(TMP_PREFIX)


def clean_stale(parent):
    """Removes the staging directories and temporary files that killed writers left in `parent`.

    Returns the removed names. Staging directories of live writers (locked)
    are left alone. A ``.tmp-*`` plain file (written by versions of this
    package before staging directories) is removed when older than a minute.
    """
    if not os.path.isdir(parent):
        return []
    removed = []
    with locked_dir(parent):
        for name in sorted(os.listdir(parent)):
            if not is_temporary(name):
                continue
            path = os.path.join(parent, name)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    if fcntl is None:  # pragma: no cover
                        if time.time() - os.path.getmtime(path) < STALE_WITHOUT_LOCKS_S:
                            continue
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        fd = _try_lock(path)
                        if fd is None:
                            continue  # a live writer
                        try:
                            shutil.rmtree(path, ignore_errors=True)
                        finally:
                            os.close(fd)
                else:
                    if time.time() - os.path.getmtime(path) < 60.0:
                        continue
                    os.remove(path)
            except FileNotFoundError:
                continue
            removed.append(name)
    return removed


@contextlib.contextmanager
def staging_dir(parent):
    """A fresh locked ``parent/.tmp-<random>`` directory, removed on exit.

    Stale staging directories in `parent` are cleaned first. Move what was
    written into place with `publish` before leaving the block.
    """
    os.makedirs(parent, exist_ok=True)
    clean_stale(parent)
    with locked_dir(parent):
        path = tempfile.mkdtemp(prefix=TMP_PREFIX, dir=parent)
        fd = None if fcntl is None else _try_lock(path)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if fd is not None:
            os.close(fd)


def publish(src, dst):
    """Moves the complete file or directory `src` to `dst` in one rename, durably.

    `src` (and everything under it) is flushed first and `dst`'s directory
    after. A file replaces an existing `dst`; a directory must not exist
    there yet (``rename`` refuses a non-empty target).
    """
    fsync_tree(src)
    if os.path.isdir(src):
        os.rename(src, dst)
    else:
        os.replace(src, dst)
    fsync_dir(os.path.dirname(os.path.abspath(dst)))


def _exchange(a, b):
    """Swaps the paths `a` and `b` in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    import ctypes
    import errno

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28 / not Linux
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a file system without the flag
        return False
    raise OSError(error, os.strerror(error), b)


def replace_dir(src, dst):
    """Puts the complete directory `src` at `dst`, replacing the directory there in one step.

    `src` is flushed first. Where ``dst`` exists, the two are exchanged in
    one ``renameat2(RENAME_EXCHANGE)`` (Linux): a reader sees the old or the
    new directory, whatever moment the writer is killed at, and the old one
    is left at `src` (inside a staging directory: removed with it). Where
    the exchange is not supported, ``dst`` is moved to ``<src>.old`` and
    `src` renamed to ``dst``: a kill between the two renames leaves no
    ``dst`` (both copies stay in the staging directory until it is cleaned).
    """
    fsync_tree(src)
    if not os.path.lexists(dst):
        os.rename(src, dst)
    elif not _exchange(src, dst):
        aside = src + ".old"
        os.rename(dst, aside)
        os.rename(src, dst)
        os.rename(aside, src)
    fsync_dir(os.path.dirname(os.path.abspath(dst)))


def write_bytes_atomic(path, data):
    """Writes `data` (bytes or str) to `path` through a staging directory and one rename."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    if isinstance(data, str):
        data = data.encode("utf-8")
    with staging_dir(parent) as tmp:
        staged = os.path.join(tmp, os.path.basename(path))
        with open(staged, "wb") as f:
            f.write(data)
        publish(staged, path)


def copy_atomic(src, dst):
    """Copies the file `src` to `dst` so that `dst` is never partial."""
    parent = os.path.dirname(os.path.abspath(os.fspath(dst)))
    with staging_dir(parent) as tmp:
        staged = os.path.join(tmp, os.path.basename(os.fspath(dst)))
        shutil.copyfile(src, staged)
        publish(staged, dst)


# ------------------------------------------------------------------ integrity
def file_digest(path, chunk=1 << 20):
    """``{"size": bytes, "sha256": hex}`` of a file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            size += len(block)
            h.update(block)
    return {"size": size, "sha256": h.hexdigest()}


def tree_digests(root, exclude=()):
    """`file_digest` of every file under `root`, keyed by its ``/``-separated relative path."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if rel in exclude:
                continue
            out[rel] = file_digest(full)
    return out


def check_digest(path, expected, what=None):
    """Raises ValueError naming `path` when it is missing, truncated or altered."""
    what = what or path
    if not os.path.isfile(path):
        raise ValueError(f"{what} is missing. Received: path={path!r}")
    got = file_digest(path)
    if got["size"] != expected["size"]:
        kind = "truncated" if got["size"] < expected["size"] else "longer than written"
        raise ValueError(f"{what} is {kind} ({got['size']} of {expected['size']} bytes). Received: path={path!r}")
    if got["sha256"] != expected["sha256"]:
        raise ValueError(
            f"{what} is corrupted (its sha256 differs from the one recorded when it was written). "
            f"Received: path={path!r}"
        )


def file_sha256(path, chunk=1 << 20):
    """The sha256 hex digest of the file at `path`, read `chunk` bytes at a time (memory: one chunk)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
