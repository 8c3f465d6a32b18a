"""Peak memory of each step of the linearize-to-serve flow at the Llama 3.2 1B shape, defaults only.

Each step runs in a process of its own under ``/usr/bin/time -v``; its peak
is the "Maximum resident set size" that ``time`` reports, or the largest
phase peak where that is larger (resetting ``VmHWM`` between phases also
resets what ``time`` reads). A watchdog ends a
step whose resident memory passes ``--kill-gib`` (the machine is shared) and
records it as killed. Steps (``--steps``, in this order by default):

- ``linearize_save``: the keras-hub Llama teacher from the 1B config with
  random weights (`benchmarks.bench_linearized_decode.build_teacher`),
  `keras_linattn.linearize` (hedgehog + window 64), ``del teacher``, then
  ``student.save("student.keras")``. The phases' own peaks (``VmHWM``,
  reset between phases) are reported beside the process peak.
- ``load``: ``keras.saving.load_model("student.keras")``.
- ``export_saved_model`` / ``export_onnx``: load, then the export with its
  defaults.
- ``verify_onnx``: load, then `keras_linattn.export.verify` of the ONNX
  export with its defaults.
- ``onnx_generate``: `keras_linattn.serving.OnnxGenerator` on the step
  graph with its defaults, ``generate`` of 4 new tokens (no TensorFlow in
  the process).

The limit of issue 58 is twice the weights' bytes plus 2 GiB. Needs a
checkout (``python -m benchmarks.memory_1b``); the table is written to
``--out`` (JSON, one row a step).
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

# A light stand-in of the 1B shape for machines without the memory for it (the same layer kinds, GQA and tied
# embeddings; 0.35 GiB of weights): ``--size scaled``.
SCALED = dict(
    vocabulary_size=32000,
    num_layers=4,
    num_query_heads=8,
    num_key_value_heads=2,
    hidden_dim=1024,
    intermediate_dim=4096,
    rope_max_wavelength=500000,
    tie_word_embeddings=True,
)
STEPS = ("linearize_save", "load", "export_saved_model", "export_onnx", "verify_onnx", "onnx_generate")
GIB = 2**30


def _phase_peak(phases, name, start):
    from benchmarks import _common

    phases[name] = {
        "peak_gib": round(_common.proc_status_bytes("VmHWM") / GIB, 3),
        "rss_after_gib": round(_common.proc_status_bytes("VmRSS") / GIB, 3),
        "seconds": round(time.perf_counter() - start, 1),
    }
    _common.reset_peak_rss()


def _load(workdir):
    import keras

    import keras_linattn.models  # noqa: F401  (registers the classes)

    return keras.saving.load_model(os.path.join(workdir, "student.keras"), compile=False)


def run_step(step, workdir, family, size, onnx_dir=None):
    """Runs one step in this process; returns its phases (peak and RSS after each)."""
    import gc

    phases = {}
    t = time.perf_counter()
    if step == "onnx_generate":
        import numpy as np

        from keras_linattn.serving import OnnxGenerator

        generator = OnnxGenerator(os.path.join(onnx_dir or os.path.join(workdir, "onnx"), "lm_step.onnx"))
        _phase_peak(phases, "open", t)
        t = time.perf_counter()
        tokens = generator.generate(np.array([[1, 2, 3, 4, 5, 6, 7, 8]], "int32"), max_length=12)
        _phase_peak(phases, "generate", t)
        phases["tensorflow_loaded"] = "tensorflow" in sys.modules
        phases["tokens"] = tokens.tolist()
        return phases
    if step == "linearize_save":
        import keras_linattn
        from benchmarks import bench_linearized_decode as bench

        bench.CONFIGS.setdefault(("llama", "scaled"), SCALED)
        teacher = bench.build_teacher(family, size)
        phases["weights_gib"] = round(bench.weight_bytes(teacher) / GIB, 3)
        _phase_peak(phases, "teacher", t)
        t = time.perf_counter()
        student = keras_linattn.linearize(teacher, window_size=bench.WINDOW)
        _phase_peak(phases, "linearize", t)
        t = time.perf_counter()
        del teacher
        gc.collect()
        _phase_peak(phases, "del_teacher", t)
        t = time.perf_counter()
        student.save(os.path.join(workdir, "student.keras"))
        _phase_peak(phases, "save", t)
        return phases
    student = _load(workdir)
    _phase_peak(phases, "load", t)
    t = time.perf_counter()
    from keras_linattn import export

    if step == "export_saved_model":
        export.export_saved_model(student, os.path.join(workdir, "saved_model"))
    elif step == "export_onnx":
        export.export_onnx(student, os.path.join(workdir, "onnx", "lm.onnx"))
    elif step == "verify_onnx":
        report = export.verify(student, onnx_path=os.path.join(workdir, "onnx", "lm.onnx"), raise_on_failure=False)
        phases["verify_status"] = report.status
    elif step != "load":
        raise ValueError(f"Unknown step. Received: step={step!r}")
    if step != "load":
        _phase_peak(phases, step, t)
    return phases


def _tree_rss(pid):
    """Resident bytes of a process and its descendants (0 once gone)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            pass
    return total


def measure(step, args):
    """One step under ``/usr/bin/time -v`` with an RSS watchdog; returns its row."""
    command = [sys.executable, "-m", "benchmarks.memory_1b", "--child", step, "--workdir", args.workdir]
    command += ["--family", args.family, "--size", args.size]
    if args.onnx_dir:
        command += ["--onnx-dir", args.onnx_dir]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    t = time.perf_counter()
    process = subprocess.Popen(
        ["/usr/bin/time", "-v", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    killed = {}

    def watch():
        while process.poll() is None:
            rss = _tree_rss(process.pid)
            if rss > args.kill_gib * GIB:
                killed["at_gib"] = round(rss / GIB, 2)
                os.killpg(process.pid, signal.SIGKILL)
                return
            if time.perf_counter() - t > args.timeout:
                killed["timeout_s"] = args.timeout
                os.killpg(process.pid, signal.SIGKILL)
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, err = process.communicate()
    watcher.join()
    row = {"step": step, "wall_s": round(time.perf_counter() - t, 1), "command": " ".join(command[1:])}
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", err)
    row["peak_gib"] = round(int(found.group(1)) * 1024 / GIB, 3) if found else None
    if killed:
        row["killed"] = killed
        row["peak_gib"] = max(row["peak_gib"] or 0, killed.get("at_gib", 0))
    result = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if result:
        row["phases"] = json.loads(result[-1][len("RESULT ") :])
        # The phases reset the kernel's peak mark (VmHWM), which is also what `time` reads at exit: the step's
        # peak is the largest of the phases' peaks and what `time` saw after the last reset.
        peaks = [p["peak_gib"] for p in row["phases"].values() if isinstance(p, dict) and "peak_gib" in p]
        row["time_v_peak_gib"] = row["peak_gib"]
        row["peak_gib"] = max([row["peak_gib"] or 0, *peaks])
    elif not killed:
        row["failed"] = "\n".join(err.strip().splitlines()[-8:])
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default=",".join(STEPS))
    parser.add_argument("--family", default="llama")
    parser.add_argument("--size", default="1b")
    parser.add_argument("--workdir", default=os.path.join("build", "memory_1b"))
    parser.add_argument("--kill-gib", type=float, default=16.0, help="end a step whose RSS passes this")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument(
        "--label", default="after", help="the key of this run under --out's <family>_<size> entry (e.g. before, after)"
    )
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "memory_1b.json"))
    parser.add_argument("--onnx-dir", default=None, help="onnx_generate: the export to serve (default: the workdir's)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.makedirs(os.path.join(args.workdir, "onnx"), exist_ok=True)
    if args.child:
        print(
            "RESULT " + json.dumps(run_step(args.child, args.workdir, args.family, args.size, args.onnx_dir)),
            flush=True,
        )
        return 0
    results = {}
    if os.path.isfile(args.out):
        with open(args.out) as f:
            results = json.load(f)
    rows = []
    for step in args.steps.split(","):
        row = measure(step, args)
        print(json.dumps(row), flush=True)
        rows.append(row)
        shape = results.setdefault(f"{args.family}_{args.size}", {})  # e.g. llama_1b, llama_scaled
        shape[args.label] = rows + [r for r in shape.get(args.label, []) if r["step"] not in {x["step"] for x in rows}]
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
