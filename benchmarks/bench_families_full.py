"""Two keras-hub families at full size: linearize, export, verify, and decode beside keras-hub.

The Qwen2.5-0.5B and gemma-3-1b shapes, full depth and width, random
weights: the published ``config.json`` (tests/linearization/_hf_checkpoints.py)
goes through keras-hub's own Hugging Face config converter
(``convert_backbone_config``) and the backbone is built from those
arguments, so every key is what a user's checkpoint gives (nothing is
downloaded, no weight file is written). Each stage runs in a process of its
own under ``/usr/bin/time -v`` (its wall time and peak RSS are that
process's) and ``timeout``; a watchdog kills a stage whose process passes
``--max-rss-gib`` (default 16) and the row says so.

    timeout 3600 python -m benchmarks.bench_families_full --shape qwen2.5-0.5b

Stages (``--stages``, in this order by default):

- ``linearize``: the teacher built, `linearize` (hedgehog + window 64), the
  student saved as a preset (``student/`` in the work directory; the other
  stages load it);
- ``export_saved_model``, ``export_onnx``: the exports, into the work directory;
- ``verify_saved_model``, ``verify_onnx``: `keras_linattn.export.verify` with its defaults;
- ``decode``: batch 1, greedy. The student in Keras (`last_logits_with_state`
  over the prompt in pieces of ``--prefill-piece`` tokens, then `step`) and
  keras-hub's teacher (``call_with_cache`` over a KV cache of the whole
  length, the prompt in the same pieces), each as a plain `tf.function`
  traced at each context before the timing: prefill seconds apart, then the
  median ms of ``--decode-tokens`` steps;
- ``decode_onnx``: the student through `OnnxGenerator` (``prepacking=False``:
  one copy of the weights): ``generate`` to ``context + 1`` tokens (the
  prefill and one token) and to ``context + 1 + n``; ms per token is the
  difference over ``n``.

``--teacher-contexts`` limits keras-hub's decode to the contexts listed (its
prefill grows with the square of the length); ``--teacher-prefill-only``
lists contexts at which only its prefill is timed. Rows go to ``--out``
(default ``benchmarks/results/families_full.json``), each with the command
that produced it; a row replaces the earlier row of the same shape, size and
stage. ``--size tiny`` runs the same code on two-layer, small-width configs
(the test of this script).
"""

import argparse
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time

SHAPES = {
    # shape: (published config, keras-hub CausalLM, keras-hub converter module)
    "qwen2.5-0.5b": ("Qwen2.5-0.5B", "QwenCausalLM", "convert_qwen"),
    "gemma-3-1b": ("gemma-3-1b-pt", "Gemma3CausalLM", "convert_gemma3"),
}
STAGES = (
    "linearize",
    "export_saved_model",
    "export_onnx",
    "verify_saved_model",
    "verify_onnx",
    "decode",
    "decode_onnx",
)
WINDOW = 64
GIB = 2**30


def _published(shape, size):
    """The Hugging Face config: published values at ``full``; two layers and a small width at ``tiny``."""
    from tests.linearization import _hf_checkpoints as hf

    name = SHAPES[shape][0]
    if size == "full":
        return json.loads(json.dumps(hf.PUBLISHED[name]))
    extra = {"sliding_window": 8, "head_dim": 32, "query_pre_attn_scalar": 32, "num_key_value_heads": 1}
    extra = extra if shape == "gemma-3-1b" else {}
    return hf.small(name, **extra)


def build_teacher(shape, size, seed=0):
    """keras-hub's CausalLM of `shape`, random weights, built from keras-hub's own conversion of the config."""
    import keras
    import keras_hub

    _, causal_lm, converter = SHAPES[shape]
    module = importlib.import_module(f"keras_hub.src.utils.transformers.{converter}")
    keras.utils.set_random_seed(seed)
    backbone = module.backbone_cls(**module.convert_backbone_config(_published(shape, size)))
    return getattr(keras_hub.models, causal_lm)(backbone=backbone, preprocessor=None)


def _load_student(workdir):
    from keras_linattn.models import LinearCausalLM

    t = time.perf_counter()
    student = LinearCausalLM.from_preset(os.path.join(workdir, "student"))
    return student, time.perf_counter() - t


def _median(values):
    values = sorted(values)
    return values[len(values) // 2]


# ---------------------------------------------------------------------------------------------- stages (children)
def stage_linearize(args):
    import gc
    import shutil

    import keras_linattn

    t = time.perf_counter()
    teacher = build_teacher(args.shape, args.size)
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    student = keras_linattn.linearize(teacher, window_size=WINDOW)
    linearize_s = time.perf_counter() - t
    parameters = int(student.count_params())
    del teacher
    gc.collect()
    directory = os.path.join(args.workdir, "student")
    shutil.rmtree(directory, ignore_errors=True)
    t = time.perf_counter()
    student.save_to_preset(directory)
    return {
        "teacher_build_s": build_s,
        "linearize_s": linearize_s,
        "save_preset_s": time.perf_counter() - t,
        "parameters": parameters,
    }


def _tree_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def stage_export_saved_model(args):
    import shutil

    from keras_linattn import export

    student, load_s = _load_student(args.workdir)
    base = os.path.join(args.workdir, "saved_model")
    shutil.rmtree(base, ignore_errors=True)
    t = time.perf_counter()
    version_dir = export.export_saved_model(student, base, warmup=False)
    return {"load_s": load_s, "export_s": time.perf_counter() - t, "files_gib": _tree_bytes(version_dir) / GIB}


def stage_export_onnx(args):
    import shutil

    from keras_linattn import export

    student, load_s = _load_student(args.workdir)
    directory = os.path.join(args.workdir, "onnx")
    shutil.rmtree(directory, ignore_errors=True)
    t = time.perf_counter()
    export.export_onnx(student, os.path.join(directory, "lm.onnx"))
    return {"load_s": load_s, "export_s": time.perf_counter() - t, "files_gib": _tree_bytes(directory) / GIB}


def _verify(args, **targets):
    from keras_linattn import export

    student, load_s = _load_student(args.workdir)
    t = time.perf_counter()
    report = export.verify(student, raise_on_failure=False, **targets)
    return {"load_s": load_s, "verify_s": time.perf_counter() - t, "status": report.status, "ok": bool(report.ok)}


def stage_verify_saved_model(args):
    base = os.path.join(args.workdir, "saved_model")
    version = sorted((d for d in os.listdir(base) if d.isdigit()), key=int)[-1]
    return _verify(args, saved_model_dir=os.path.join(base, version))


def stage_verify_onnx(args):
    return _verify(args, onnx_path=os.path.join(args.workdir, "onnx", "lm.onnx"))


def _prompt(vocab, context):
    import numpy as np

    return np.random.default_rng(context).integers(1, vocab, size=(1, context)).astype("int32")


def _timed_decode(prefill, step, state, prompt, piece, new, prefill_only=False):
    """Prefill in pieces (traced first on the first piece and one step), then `new` greedy steps, timed apart."""
    import numpy as np

    context = prompt.shape[1]
    logits, warm = prefill(prompt[:, :piece], state, 0)
    np.asarray(step(np.asarray(logits).argmax(-1).astype("int32"), warm, min(piece, context))[0])
    if context > piece and context % piece:  # the last, shorter piece: its own trace, before the timing
        prefill(prompt[:, : context % piece], state, 0)
    del warm
    t = time.perf_counter()
    for start in range(0, context, piece):
        logits, state = prefill(prompt[:, start : start + piece], state, start)
    token = np.asarray(logits).argmax(-1).astype("int32")
    row = {"context": context, "prefill_s": time.perf_counter() - t}
    if prefill_only:
        return row
    times = []
    for i in range(new):
        t = time.perf_counter()
        logits, state = step(token, state, context + i)
        token = np.asarray(logits).argmax(-1).astype("int32")
        times.append(time.perf_counter() - t)
    row.update(ms_per_token=1e3 * _median(times), ms_range=[1e3 * min(times), 1e3 * max(times)], tokens=new)
    return row


def _teacher_cache(teacher, length):
    """An empty KV cache of one sequence of `length` tokens, in the layout of the teacher's `_build_cache`."""
    import tensorflow as tf

    backbone = teacher.backbone
    if type(teacher).__name__ == "Gemma3CausalLM":  # one (key, value) pair per layer
        shape = (1, length, backbone.num_key_value_heads, backbone.head_dim)
        return tuple((tf.zeros(shape), tf.zeros(shape)) for _ in range(backbone.num_layers))
    head_dim = backbone.hidden_dim // backbone.num_query_heads  # Qwen: [B, layers, 2, length, kv_heads, head_dim]
    return tf.zeros((1, backbone.num_layers, 2, length, backbone.num_key_value_heads, head_dim))


def _student_decode(args):
    """The student's rows of `stage_decode` (Keras, plain `tf.function`s), and its load time."""
    import tensorflow as tf

    student, load_s = _load_student(args.workdir)
    vocab = student.backbone.vocabulary_size
    last = tf.function(lambda ids, state: student.last_logits_with_state(ids, state), autograph=False)
    step = tf.function(lambda token, state: student.step(token, state), autograph=False)
    rows = []
    for context in args.contexts:
        row = _timed_decode(
            lambda ids, state, start: last(tf.constant(ids), list(state)),
            lambda token, state, index: step(tf.constant(token), list(state)),
            list(student.get_initial_state(1)),
            _prompt(vocab, context),
            args.prefill_piece,
            args.decode_tokens,
        )
        rows.append(row)
        print(json.dumps({"student": row}), flush=True)
    return rows, load_s


def stage_decode(args):
    import gc

    import tensorflow as tf

    piece, new = args.prefill_piece, args.decode_tokens
    rows, load_s = _student_decode(args)
    gc.collect()
    teacher = build_teacher(args.shape, args.size)
    call = tf.function(lambda ids, cache, index: teacher.call_with_cache(ids, cache, index), autograph=False)

    def teacher_prefill(ids, cache, start):
        logits, _, cache = call(tf.constant(ids), cache, tf.constant(start, "int32"))
        return logits[:, -1], cache

    def teacher_step(token, cache, index):
        logits, _, cache = call(tf.constant(token)[:, None], cache, tf.constant(index, "int32"))
        return logits[:, -1], cache

    teacher_rows = []
    for context in sorted(set(args.teacher_contexts) | set(args.teacher_prefill_only)):
        cache = _teacher_cache(teacher, context + new)
        only = context in args.teacher_prefill_only and context not in args.teacher_contexts
        prompt = _prompt(teacher.backbone.vocabulary_size, context)
        row = _timed_decode(teacher_prefill, teacher_step, cache, prompt, piece, new, only)
        del cache
        gc.collect()
        teacher_rows.append(row)
        print(json.dumps({"teacher": row}), flush=True)
    return {"load_s": load_s, "prefill_piece": piece, "student": rows, "teacher": teacher_rows}


def stage_decode_onnx(args):
    """The student through `OnnxGenerator`: the prefill inside ``generate``, then the median of single steps.

    A token's cost is that of one ``step`` call: the state has one shape at every position (the window's
    buffer is full after ``window`` tokens), so the steps are timed individually from a state stepped past
    the window, rather than as the small difference of two long ``generate`` calls (which the noise of the
    prefill swamps).
    """
    import numpy as np

    from keras_linattn.export import OnnxGenerator

    new = args.decode_tokens
    t = time.perf_counter()
    generator = OnnxGenerator(os.path.join(args.workdir, "onnx", "lm_step.onnx"), device="cpu", prepacking=False)
    load_s = time.perf_counter() - t
    vocab = _published(args.shape, args.size)["vocab_size"]
    rows = []
    for context in args.onnx_contexts:
        prompt = _prompt(vocab, context)
        warm = min(context, 64)
        generator.generate(prompt[:, :warm], max_length=warm + 2)  # sessions and first-call allocations
        t = time.perf_counter()
        generator.generate(prompt, max_length=context + 1)
        prefill_s = time.perf_counter() - t
        state = generator.initial_state(1)
        token = prompt[:, 0]
        times = []
        for i in range(_ONNX_STEP_WARM + new):
            t = time.perf_counter()
            logits, state = generator.step(token, state)
            token = np.asarray(logits).argmax(-1).astype("int32")
            if i >= _ONNX_STEP_WARM:
                times.append(time.perf_counter() - t)
        row = {
            "context": context,
            "prefill_s": prefill_s,
            "ms_per_token": 1e3 * _median(times),
            "ms_range": [1e3 * min(times), 1e3 * max(times)],
            "tokens": new,
            "steps_before_timing": _ONNX_STEP_WARM,
        }
        rows.append(row)
        print(json.dumps({"onnx": row}), flush=True)
    return {"load_s": load_s, "prepacking": False, "student_onnx": rows}


# Steps before the timed ones: past the student's softmax window (64), so the state is at its steady shape.
_ONNX_STEP_WARM = 72


STAGE_FUNCTIONS = {name: globals()[f"stage_{name}"] for name in STAGES}


# ---------------------------------------------------------------------------------------------- the parent
def _watch(process, limit_bytes, report):
    """Kills `process` and its children when their RSS passes `limit_bytes`; records the RSS it saw."""
    import psutil

    try:
        root = psutil.Process(process.pid)
        while process.poll() is None:
            rss = 0
            for p in [root, *root.children(recursive=True)]:
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            if rss > limit_bytes:
                report["killed_at_rss_gib"] = rss / GIB
                for p in root.children(recursive=True):
                    p.kill()
                root.kill()
                return
            time.sleep(0.5)
    except psutil.Error:
        pass


def _time_v(stderr):
    """``(wall s, peak RSS GiB)`` from ``/usr/bin/time -v``'s report."""
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", stderr)
    seconds = None
    if wall:
        seconds = 0.0
        for part in wall.group(1).split(":"):
            seconds = seconds * 60 + float(part)
    return seconds, (int(peak.group(1)) * 1024 / GIB if peak else None)


def _child_args(args, stage):
    out = ["--child", stage, "--shape", args.shape, "--size", args.size, "--workdir", args.workdir]
    for name in ("contexts", "teacher_contexts", "teacher_prefill_only", "onnx_contexts"):
        out += [f"--{name.replace('_', '-')}", ",".join(map(str, getattr(args, name)))]
    return out + ["--prefill-piece", str(args.prefill_piece), "--decode-tokens", str(args.decode_tokens)]


def run_stage(args, stage):
    """One stage in its own process under ``timeout`` and ``/usr/bin/time -v``: its row."""
    inner = [sys.executable, "-m", "benchmarks.bench_families_full", *_child_args(args, stage)]
    command = ["timeout", str(args.stage_timeout), "/usr/bin/time", "-v", *inner]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    row = {"shape": args.shape, "size": args.size, "stage": stage, "command": shlex.join(command)}
    print(f"== {args.shape} {args.size} {stage}", flush=True)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    watchdog = threading.Thread(target=_watch, args=(process, args.max_rss_gib * GIB, row), daemon=True)
    watchdog.start()
    stdout, stderr = process.communicate()
    watchdog.join(timeout=5)
    row["wall_s"], row["peak_rss_gib"] = _time_v(stderr)
    row["exit"] = process.returncode
    partial = []
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            row.update(json.loads(line[len("RESULT ") :]))
        else:
            print("   " + line, flush=True)
            if line.startswith('{"'):  # a decode row, printed as soon as it is measured
                try:
                    partial.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    if "RESULT " not in stdout:
        row["failed"] = "timeout" if process.returncode == 124 else f"exit {process.returncode}"
        row["rows_before_failure"] = partial
        row["stderr_tail"] = [line for line in stderr.splitlines() if "Traceback" in line or "Error" in line][-5:]
    print("   " + json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
    return row


def _run_in_process(args, stage):
    t = time.perf_counter()
    row = {"shape": args.shape, "size": args.size, "stage": stage, "in_process": True}
    row.update(STAGE_FUNCTIONS[stage](args))
    row["wall_s"] = time.perf_counter() - t
    return row


def _save(path, rows, top_command):
    existing = []
    if os.path.isfile(path):
        with open(path) as f:
            existing = json.load(f)["rows"]
    keys = {(r["shape"], r["size"], r["stage"]) for r in rows}
    merged = [r for r in existing if (r["shape"], r["size"], r["stage"]) not in keys] + rows
    with open(path, "w") as f:
        json.dump({"host": os.uname().nodename, "cpus": os.cpu_count(), "rows": merged}, f, indent=1)
        f.write("\n")
    print(f"wrote {path} ({len(rows)} rows from: {top_command})", flush=True)


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--workdir", default=None, help="default: /tmp/bench_families_full/<shape>_<size>")
    parser.add_argument("--contexts", type=_ints, default=[1024, 4096, 16384])
    parser.add_argument("--teacher-contexts", type=_ints, default=[1024, 4096, 16384])
    parser.add_argument("--teacher-prefill-only", type=_ints, default=[])
    parser.add_argument("--onnx-contexts", type=_ints, default=[1024, 4096, 16384])
    parser.add_argument("--prefill-piece", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--stage-timeout", type=int, default=1800, help="seconds per stage (`timeout`)")
    parser.add_argument("--max-rss-gib", type=float, default=16.0)
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "families_full.json"))
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run the stages in this process (no time, RSS or timeout per stage): a quick check of the stages",
    )
    parser.add_argument("--child", choices=STAGES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.workdir = args.workdir or os.path.join("/tmp", "bench_families_full", f"{args.shape}_{args.size}")
    if args.child:
        t = time.perf_counter()
        result = STAGE_FUNCTIONS[args.child](args)
        result["stage_s"] = time.perf_counter() - t
        print("RESULT " + json.dumps(result), flush=True)
        return
    stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        parser.error(f"unknown stages {unknown}; choose from {list(STAGES)}")
    os.makedirs(args.workdir, exist_ok=True)
    top_command = shlex.join([sys.executable, "-m", "benchmarks.bench_families_full", *(argv or sys.argv[1:])])
    rows = []
    for stage in stages:
        row = _run_in_process(args, stage) if args.in_process else run_stage(args, stage)
        row["run"] = top_command
        rows.append(row)
        _save(args.out, rows, top_command)  # after every stage: a later stage's failure keeps the earlier rows


if __name__ == "__main__":
    main()
