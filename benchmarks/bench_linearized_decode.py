"""Linearized models at real size: time and peak memory of each step, decode beside keras-hub.

A keras-hub teacher is built from a config with random weights (nothing is
downloaded), linearized (hedgehog + window 64), and each step of the recipe
runs in a process of its own, so that its peak resident memory is its own:

    python -m benchmarks.bench_linearized_decode --family gpt2 --size base
    python -m benchmarks.bench_linearized_decode --family llama --size 1b --stages build,export_onnx,verify_onnx

Steps (``--stages``, in this order by default):

- ``build``: the teacher from its config, `linearize`, the student saved as
  ``student.keras`` in the work directory (every later step loads it).
- ``export_saved_model`` / ``export_onnx``: the exports, into the work directory.
- ``verify_saved_model`` / ``verify_onnx``: `keras_linattn.export.verify` with
  its defaults, on those exports.
- ``long_generate``: a real prefill of each ``--contexts`` prompt (in pieces
  of ``--prefill-piece`` tokens), then ``--decode-tokens`` greedy steps, at
  batch 1, timed apart: the student (`last_logits_with_state`, `step`) and
  keras-hub (``call_with_cache`` over a cache of the whole length), each in a
  process of its own (``--serve-model``).
- ``traffic``: the memory-traffic model alone (`graph_traffic_bytes` of each
  model's decode step at each context, no timing), e.g. after changing the
  model.
- ``decode``: time per new token at batch 1, prefill timed apart, for the
  student (`LinearCausalLM.generate`) and the teacher (keras-hub
  ``CausalLM.generate``, KV cache), interleaved, at each ``--contexts``;
  beside the weights-read floor (weight bytes / the memory bandwidth measured
  here with a large matrix-vector product).
- ``onnx_decode``: the same through onnxruntime, on the ``export_onnx``
  graphs: `OnnxGenerator.generate` (the loop inside onnxruntime) and
  `OnnxGenerator.step` (one call a token), with worker threads that sleep
  between ops (the package's default) and that spin (``--onnx-spinning``).

Each step reports wall time, the peak RSS of its process (``VmHWM``) and the
RSS after loading the model (so that the step's own share is the
difference). The table goes to stdout; ``--out`` writes the JSON (default
``benchmarks/results/linearized_<family>_<size>.json``).

Sizes: ``gpt2 base`` is GPT-2 base (124M); ``llama 1b`` is Llama 3.2 1B's
shape (vocabulary 128,256, 16 layers, hidden 2048, 32/8 heads, tied
embeddings, 1.24B parameters); ``llama 1b8`` the same with 8 layers and
untied embeddings (1.01B); ``medium`` (4 layers, width 256, vocabulary 5k)
and ``tiny`` for quick checks.
"""

import argparse
import json
import os
import subprocess
import sys
import time

FAMILIES = ("gpt2", "llama")
STAGES = (
    "build",
    "export_saved_model",
    "export_onnx",
    "verify_saved_model",
    "verify_onnx",
    "decode",
    "onnx_decode",
    "serve",
    "merge_lora",
    "long_generate",
    "traffic",
    "chain",
)

CONFIGS = {
    ("gpt2", "base"): dict(
        vocabulary_size=50257,
        num_layers=12,
        num_heads=12,
        hidden_dim=768,
        intermediate_dim=3072,
        max_sequence_length=1024,
    ),
    ("gpt2", "medium"): dict(
        vocabulary_size=5000, num_layers=4, num_heads=4, hidden_dim=256, intermediate_dim=1024, max_sequence_length=1024
    ),
    ("gpt2", "tiny"): dict(
        vocabulary_size=500, num_layers=2, num_heads=2, hidden_dim=64, intermediate_dim=128, max_sequence_length=256
    ),
    ("llama", "1b"): dict(
        vocabulary_size=128256,
        num_layers=16,
        num_query_heads=32,
        num_key_value_heads=8,
        hidden_dim=2048,
        intermediate_dim=8192,
        rope_max_wavelength=500000,
        tie_word_embeddings=True,
    ),
    ("llama", "1b8"): dict(
        vocabulary_size=128256,
        num_layers=8,
        num_query_heads=32,
        num_key_value_heads=8,
        hidden_dim=2048,
        intermediate_dim=8192,
        rope_max_wavelength=500000,
        tie_word_embeddings=False,
    ),
    ("llama", "medium"): dict(
        vocabulary_size=5000,
        num_layers=4,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=256,
        intermediate_dim=512,
    ),
    ("llama", "tiny"): dict(
        vocabulary_size=500, num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=64, intermediate_dim=128
    ),
}
DEFAULT_CONTEXTS = {"gpt2": (128, 512, 960), "llama": (128, 1024, 4096, 16384)}
WINDOW = 64


def _gib(n):
    return None if n is None else round(n / 2**30, 3)


def _rss():
    from benchmarks import _common

    return _common.proc_status_bytes("VmRSS"), _common.proc_status_bytes("VmHWM")


def build_teacher(family, size, seed=0):
    """The keras-hub causal LM of a configuration, random weights, no preprocessor."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    config = dict(CONFIGS[(family, size)])
    if family == "gpt2":
        return keras_hub.models.GPT2CausalLM(keras_hub.models.GPT2Backbone(**config), preprocessor=None)
    return keras_hub.models.LlamaCausalLM(keras_hub.models.LlamaBackbone(**config), preprocessor=None)


def weight_bytes(model):
    import numpy as np

    return int(sum(int(np.prod(v.shape)) * np.dtype(str(v.dtype)).itemsize for v in model.weights))


# ------------------------------------------------------------------ stages
def stage_build(args):
    import gc

    import keras_linattn

    t = time.perf_counter()
    teacher = build_teacher(args.family, args.size)
    build_s = time.perf_counter() - t
    rss_teacher, _ = _rss()
    t = time.perf_counter()
    student = keras_linattn.linearize(teacher, window_size=WINDOW)
    linearize_s = time.perf_counter() - t
    _, peak_linearize = _rss()
    del teacher
    gc.collect()
    t = time.perf_counter()
    student.save(os.path.join(args.workdir, "student.keras"))
    save_s = time.perf_counter() - t
    return {
        "teacher_build_s": build_s,
        "teacher_rss_gib": _gib(rss_teacher),
        "linearize_s": linearize_s,
        "linearize_peak_gib": _gib(peak_linearize),
        "save_s": save_s,
        "weights_gib": _gib(weight_bytes(student)),
        "parameters": int(student.count_params()),
    }


def _load_student(args):
    import keras

    import keras_linattn  # noqa: F401  (registers the classes)

    t = time.perf_counter()
    student = keras.saving.load_model(os.path.join(args.workdir, "student.keras"), compile=False)
    return student, time.perf_counter() - t


def _after_load(row, load_s):
    from benchmarks import _common

    rss, peak = _rss()
    row.update(load_s=load_s, rss_after_load_gib=_gib(rss), load_peak_gib=_gib(peak))
    _common.reset_peak_rss()


def _tree_bytes(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def stage_export_saved_model(args):
    import shutil

    from keras_linattn import export

    student, load_s = _load_student(args)
    row = {}
    _after_load(row, load_s)
    base = os.path.join(args.workdir, "saved_model")
    shutil.rmtree(base, ignore_errors=True)
    t = time.perf_counter()
    version_dir = export.export_saved_model(student, base, warmup=False)
    row.update(seconds=time.perf_counter() - t, files_gib=_gib(_tree_bytes(version_dir)))
    row["weights_gib"] = _gib(weight_bytes(student))
    return row


def stage_export_onnx(args):
    import shutil

    from keras_linattn import export

    student, load_s = _load_student(args)
    row = {}
    _after_load(row, load_s)
    directory = os.path.join(args.workdir, "onnx")
    shutil.rmtree(directory, ignore_errors=True)
    t = time.perf_counter()
    paths = export.export_onnx(student, os.path.join(directory, "lm.onnx"), progress=print)
    row.update(seconds=time.perf_counter() - t, files_gib=_gib(_tree_bytes(directory)))
    row["files"] = {k: (v if isinstance(v, str) else list(v)) for k, v in paths.items()}
    row["weights_gib"] = _gib(weight_bytes(student))
    return row


def _verify(args, **targets):
    from keras_linattn import export

    student, load_s = _load_student(args)
    row = {}
    _after_load(row, load_s)
    t = time.perf_counter()
    report = export.verify(student, raise_on_failure=False, progress=print, **targets)
    row.update(seconds=time.perf_counter() - t, status=report.status)
    row.update(failed=len(report.failed), checks=len(report.rows))
    return row


def stage_verify_saved_model(args):
    base = os.path.join(args.workdir, "saved_model")
    versions = sorted((d for d in os.listdir(base) if d.isdigit()), key=int)
    return _verify(args, saved_model_dir=os.path.join(base, versions[-1]))


def stage_verify_onnx(args):
    return _verify(args, onnx_path=os.path.join(args.workdir, "onnx", "lm.onnx"))


def bandwidth_gib_s(megabytes=512, repeats=7):
    """Memory bandwidth read by a float32 matrix-vector product over a matrix of `megabytes` (median)."""
    import numpy as np

    n = int((megabytes * 2**20 / 4) ** 0.5)
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    x = np.ones(n, np.float32)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ x
        times.append(time.perf_counter() - t)
    return a.nbytes / float(np.median(times)) / 2**30


def _median(values):
    values = sorted(values)
    return values[len(values) // 2]


def _student_modes(args):
    """The student's generate modes to time: XLA-compiled and plain `tf.function` (``--student-modes``)."""
    return (
        {"xla": True, "plain": False, "auto": "auto"}
        if args.student_modes == "all"
        else {m: {"xla": True, "plain": False, "auto": "auto"}[m] for m in args.student_modes.split(",")}
    )


def stage_decode(args):
    """ms per new token at batch 1 (decode only: the difference of two generate lengths), first-call time."""
    import numpy as np

    from keras_linattn.models import _generate_compile

    student, load_s = _load_student(args)
    teacher = build_teacher(args.family, args.size) if not args.no_teacher else None
    vocab = CONFIGS[(args.family, args.size)]["vocabulary_size"]
    limit = getattr(student, "max_sequence_length", None)
    rng = np.random.default_rng(0)
    rows = []
    short, long = args.new_tokens
    runners = [(f"student_{mode}", student, jit) for mode, jit in _student_modes(args).items()]
    if teacher is not None:
        runners.append(("teacher", teacher, None))
    for context in args.contexts:
        if limit is not None and context + long > limit:
            rows.append({"context": context, "skipped": f"context + {long} new tokens > max_sequence_length={limit}"})
            continue
        prompt = rng.integers(0, vocab, size=(1, context)).astype("int32")
        row = {"context": context}
        for name, model, jit in runners:
            if jit is not None:  # a fresh trace in this mode
                model.generate_jit_compile = jit
                model._generation.functions.clear()

            def run(n, model=model, prompt=prompt, context=context):
                t = time.perf_counter()
                if model is student:
                    model.generate(prompt, max_length=context + n, stop_token_ids=None)
                else:  # keras-hub without a preprocessor generates into the padded positions
                    ids = np.concatenate([prompt, np.zeros((1, n), "int32")], axis=1)
                    mask = np.concatenate([np.ones_like(prompt), np.zeros((1, n), "int32")], axis=1)
                    model.generate({"token_ids": ids, "padding_mask": mask}, stop_token_ids=None)
                return time.perf_counter() - t

            row[f"{name}_first_call_s"] = run(short)
            run(long)  # the long call's own first trace stays out of the timed pairs
            diffs, prefill = [], []
            for _ in range(args.repeats):
                a = run(short)
                b = run(long)
                prefill.append(a)
                diffs.append((b - a) / (long - short))
            row[f"{name}_ms_per_token"] = 1e3 * _median(diffs)
            row[f"{name}_ms_range"] = [1e3 * min(diffs), 1e3 * max(diffs)]
            row[f"{name}_short_call_s"] = _median(prefill)
        rows.append(row)
        print(json.dumps(row), flush=True)
    bw = bandwidth_gib_s()
    floor = weight_bytes(student) / (bw * 2**30) * 1e3
    student.generate_jit_compile = "auto"
    return {
        "load_s": load_s,
        "auto_uses_xla": bool(_generate_compile.generate_uses_xla(student)),
        "bandwidth_gib_s": bw,
        "weights_read_floor_ms": floor,
        "contexts": rows,
    }


def onnx_weight_bytes(path):
    """Bytes of an ONNX graph's initializers (its weights), read from the graph without loading them."""
    import numpy as np
    import onnx

    model = onnx.load(path, load_external_data=False)
    return int(
        sum(
            int(np.prod(t.dims)) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
            for t in model.graph.initializer
        )
    )


def onnx_step_profile(step_path, calls, prepacking=True):
    """onnxruntime's own profile of the step graph: each op type's node count and time per step.

    A fresh CPU session with profiling on, ``calls`` steps from the initial
    state after 3 warm-up steps (their events dropped); the node count is
    that of the graph onnxruntime runs (after its fusions). The profiler
    adds a little to each node, so the times are a breakdown, not a timing.
    """
    import collections
    import tempfile

    import numpy as np
    import onnxruntime as ort

    from keras_linattn.export import OnnxGenerator

    generator = OnnxGenerator(step_path, device="cpu", prepacking=prepacking)  # its initial state and feeds
    with tempfile.TemporaryDirectory() as folder:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(folder, "step")
        options.optimized_model_filepath = os.path.join(folder, "optimized.onnx")
        if not prepacking:
            options.add_session_config_entry("session.disable_prepacking", "1")
        session = ort.InferenceSession(step_path, options, providers=["CPUExecutionProvider"])
        state = generator.initial_state(1)
        names = [i.name for i in session.get_inputs()]
        outputs = [o.name for o in session.get_outputs()]
        warm = 3
        for _ in range(warm + calls):
            feeds = {"token_t": np.zeros((1,), np.int32), **{f"state_{i}": s for i, s in enumerate(state)}}
            out = dict(zip(outputs, session.run(None, {n: feeds[n] for n in names}), strict=True))
            state = [out[f"new_state_{i}"] for i in range(len(state))]
        with open(session.end_profiling()) as f:
            events = json.load(f)
        import onnx

        nodes = len(onnx.load(options.optimized_model_filepath, load_external_data=False).graph.node)
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    start = runs[warm]["ts"] if len(runs) > warm else 0  # events of the timed calls only
    time_us, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= start:
            op = e.get("args", {}).get("op_name", "?")
            time_us[op] += e["dur"]
            count[op] += 1
    rows = sorted(time_us, key=time_us.get, reverse=True)
    return {
        "calls": calls,
        "nodes": nodes,
        "ms_per_step": sum(time_us.values()) / calls / 1e3,
        "op_types": {op: {"nodes": count[op] // calls, "ms": time_us[op] / calls / 1e3} for op in rows},
    }


def stage_onnx_decode(args):
    """ms per new token at batch 1 through onnxruntime, on the graphs of ``export_onnx``, beside the floor.

    For each ``--onnx-spinning`` setting (worker threads that sleep between
    ops, the package's default, or spin), one `OnnxGenerator` on the step
    graph (its `generate` runs the generate graph):

    - ``generate``: greedy `OnnxGenerator.generate`, the prefill and the
      decode loop inside onnxruntime; ms per token is the difference of two
      lengths (``--new-tokens``) over the tokens between, as in ``decode``;
    - ``step``: `OnnxGenerator.step` called once a token from Python (state
      passed back as returned), the median of 31 calls.

    ``--onnx-no-prepacking`` keeps one copy of the weights in onnxruntime
    (`OnnxPredictor`'s ``prepacking=False``), for models near the memory limit.
    ``--onnx-profile N`` adds `onnx_step_profile` (N profiled steps) as
    ``profile``.

    The settings take turns within each repeat. The floor is the graph's
    weight bytes over the bandwidth of a large matrix-vector product
    (`bandwidth_gib_s`): the median of 3 measurements before the timings
    and 3 after, in the same process (one measurement alone moved between
    24.6 and 36.1 GiB/s on the 2-core host, most of them 25-29).
    """
    import numpy as np

    from keras_linattn.export import OnnxGenerator

    step_path = os.path.join(args.workdir, "onnx", "lm_step.onnx")
    if not os.path.isfile(step_path):
        raise SystemExit(f"no {step_path}: run the export_onnx stage first")
    vocab = CONFIGS[(args.family, args.size)]["vocabulary_size"]
    limit = CONFIGS[(args.family, args.size)].get("max_sequence_length")
    settings = {"sleep": False, "spin": True}
    settings = {name: spin for name, spin in settings.items() if name in args.onnx_spinning.split(",")}
    bandwidths = [bandwidth_gib_s() for _ in range(3)]  # before the timings; 3 more after
    t = time.perf_counter()
    generators = {
        name: OnnxGenerator(step_path, device="cpu", allow_spinning=spin, prepacking=not args.onnx_no_prepacking)
        for name, spin in settings.items()
    }
    load_s = time.perf_counter() - t
    short, long = args.new_tokens
    rng = np.random.default_rng(0)
    rows = []
    for context in args.contexts:
        if limit is not None and context + long > limit:
            rows.append({"context": context, "skipped": f"context + {long} new tokens > max_sequence_length={limit}"})
            continue
        prompt = rng.integers(0, vocab, size=(1, context)).astype("int32")
        row = {"context": context}
        diffs = {name: [] for name in generators}

        def run(generator, n, prompt=prompt, context=context):
            t = time.perf_counter()
            generator.generate(prompt, max_length=context + n)
            return time.perf_counter() - t

        for name, generator in generators.items():
            row[f"{name}_first_call_s"] = run(generator, short)
            run(generator, long)
        for _ in range(args.repeats):
            for name, generator in generators.items():
                a = run(generator, short)
                b = run(generator, long)
                diffs[name].append((b - a) / (long - short))
        for name, values in diffs.items():
            row[f"generate_{name}_ms_per_token"] = 1e3 * _median(values)
            row[f"generate_{name}_ms_range"] = [1e3 * min(values), 1e3 * max(values)]
        rows.append(row)
        print(json.dumps(row), flush=True)
    steps = {}
    for _ in range(max(1, args.repeats // 2)):
        for name, generator in generators.items():
            state = generator.initial_state(1)
            token = np.zeros((1,), np.int32)
            for _ in range(3):
                _, state = generator.step(token, state)
            times = []
            for _ in range(31):
                t = time.perf_counter()
                _, state = generator.step(token, state)
                times.append(time.perf_counter() - t)
            steps.setdefault(name, []).append(1e3 * _median(times))
    bandwidths += [bandwidth_gib_s() for _ in range(3)]
    bw = _median(bandwidths)
    weights = onnx_weight_bytes(step_path)
    floor = weights / (bw * 2**30) * 1e3
    result = {
        "load_s": load_s,
        "weights_gib": _gib(weights),
        "bandwidth_gib_s": bw,
        "bandwidth_gib_s_all": [round(b, 2) for b in bandwidths],
        "weights_read_floor_ms": floor,
        "contexts": rows,
        "step_ms": {name: _median(values) for name, values in steps.items()},
        "step_ms_runs": steps,
    }
    for row in rows:
        for name in generators:
            if f"generate_{name}_ms_per_token" in row:
                row[f"generate_{name}_over_floor"] = row[f"generate_{name}_ms_per_token"] / floor
    result["step_over_floor"] = {name: ms / floor for name, ms in result["step_ms"].items()}
    if args.onnx_profile:
        del generators
        result["profile"] = onnx_step_profile(step_path, args.onnx_profile, prepacking=not args.onnx_no_prepacking)
    return result


def stage_merge_lora(args):
    """The documented LoRA recipe's memory: teacher and student in one process, adapters on, then `merge_lora`.

    The peak of each step is measured from the RSS before it (the kernel's
    peak mark is reset). ``--merge-in-place`` merges into the student
    (``merge_lora(..., in_place=True)``) instead of building a new one. The adapters are not trained: merging costs the
    same memory whatever their values.
    """
    import gc

    import keras_linattn
    from benchmarks import _common
    from keras_linattn.linearization import enable_lora, merge_lora

    row = {}

    def step(name, fn):
        rss_before, _ = _rss()
        _common.reset_peak_rss()
        t = time.perf_counter()
        out = fn()
        rss, peak = _rss()
        row[name] = {"s": time.perf_counter() - t, "rss_before_gib": _gib(rss_before), "peak_gib": _gib(peak)}
        row[name]["rss_after_gib"] = _gib(rss)
        print(json.dumps({name: row[name]}), flush=True)
        return out

    models = {}
    models["teacher"] = step("teacher", lambda: build_teacher(args.family, args.size))
    models["student"] = step("linearize", lambda: keras_linattn.linearize(models["teacher"], window_size=WINDOW))
    step("enable_lora", lambda: enable_lora(models["student"], rank=8, alpha=16))
    in_place = args.merge_in_place
    models["merged"] = step("merge_lora", lambda: merge_lora(models["student"], in_place=in_place))
    row["in_place"] = in_place
    row["weights_gib"] = _gib(weight_bytes(models["merged"]))
    models.clear()
    gc.collect()
    return row


def _state_bytes(state):
    import numpy as np

    return int(sum(np.asarray(x).nbytes for x in state))


def _time_steps(step, repeats):
    """Median seconds of one call of ``step()`` over `repeats` calls, after two warm-up calls (tracing)."""
    step()
    step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return _median(times)


def _serve_batches(per_sequence, budget, batches):
    """The batches of `batches` whose decode memory (`per_sequence` bytes each) fits `budget` bytes."""
    return [b for b in batches if b * per_sequence <= budget]


def _kv_cache_shape(teacher, length):
    """``(layers, 2, length, kv_heads, head_dim)``: one sequence of a keras-hub teacher's KV cache (K and V)."""
    backbone = teacher.backbone
    kv_heads = getattr(backbone, "num_key_value_heads", None) or backbone.num_heads
    head_dim = backbone.hidden_dim // (getattr(backbone, "num_query_heads", None) or backbone.num_heads)
    return backbone.num_layers, 2, length, kv_heads, head_dim


def stage_serve(args):
    """Decode throughput at a long context: one decode step at each batch that fits the memory budget.

    Decode only: the step after a prefill of `--serve-context` tokens, without
    running the prefill (a 16k prefill of a 1B model takes hours on this CPU).
    The student's step reads a state of fixed shape, so its cost does not
    depend on what the state holds: the state is the empty one, at the
    context's position. keras-hub's step is `LlamaCausalLM.call_with_cache`
    on a KV cache of the context's length, written at that index: the
    attention reads the whole cache whatever it holds. Each batch is
    timed while its memory (state or cache, plus the step's own buffers) stays
    under ``--serve-budget-gib`` beside the weights; the largest one that fits
    and its tokens/s are reported for each model.
    """
    import gc

    import keras
    import numpy as np
    import tensorflow as tf

    context = args.serve_context
    budget = args.serve_budget_gib * 2**30
    batches = [int(b) for b in args.serve_batches.split(",")]
    result = {"context": context, "budget_gib": args.serve_budget_gib}
    if args.serve_model in ("student", "both"):
        student, load_s = _load_student(args)
        rss_weights, _ = _rss()
        per_sequence = _state_bytes(student.get_initial_state(1))
        rows = []
        for batch in _serve_batches(2 * per_sequence, budget - rss_weights, batches):  # the state read and written
            state = list(student.get_initial_state(batch))
            for i, entry in enumerate(student.state_spec()):
                if entry.name.endswith("position"):
                    state[i] = tf.fill(tf.shape(state[i]), tf.cast(context, state[i].dtype))
            state = tuple(tf.convert_to_tensor(x) for x in state)
            token = tf.zeros((batch,), "int32")
            fn = tf.function(lambda token, state: student.step(token, state)[0])
            seconds = _time_steps(lambda fn=fn, token=token, state=state: np.asarray(fn(token, state)), args.repeats)
            rss, _ = _rss()
            rows.append({"batch": batch, "step_s": seconds, "tokens_per_s": batch / seconds, "rss_gib": _gib(rss)})
            print(json.dumps({"student": rows[-1]}), flush=True)
            del state, fn
            gc.collect()
        result["student"] = {"load_s": load_s, "state_bytes_per_sequence": per_sequence, "rows": rows}
        del student
        gc.collect()
    if args.serve_model in ("teacher", "both"):
        teacher = build_teacher(args.family, args.size)
        rss_weights, _ = _rss()
        layers, _, _, kv_heads, head_dim = _kv_cache_shape(teacher, 0)
        length = context + 1
        per_sequence = layers * 2 * length * kv_heads * head_dim * 4  # float32 K and V
        rows = []
        # The step holds the cache it reads and the one it writes (2x), plus the stacked copy.
        for batch in _serve_batches(3 * per_sequence, budget - rss_weights, batches):
            cache = tf.zeros((batch, layers, 2, length, kv_heads, head_dim), "float32")
            token = tf.zeros((batch, 1), "int32")

            def step(token, cache):
                logits, _, cache = teacher.call_with_cache(token, cache, context)
                return logits, cache  # a server keeps the written cache

            # keras-hub's generate compiles its loop with XLA where it can (the cache is then
            # updated in place); a plain function copies it. Both are timed; the faster counts.
            for mode, jit in (("plain", False), ("xla", True)):
                fn = tf.function(step, jit_compile=jit)
                seconds = _time_steps(
                    lambda fn=fn, token=token, cache=cache: np.asarray(fn(token, cache)[0]), args.repeats
                )
                rss, _ = _rss()
                row = {"batch": batch, "mode": mode, "step_s": seconds, "tokens_per_s": batch / seconds}
                rows.append({**row, "rss_gib": _gib(rss)})
                print(json.dumps({"teacher": rows[-1]}), flush=True)
                del fn
                gc.collect()
            del cache
            gc.collect()
        result["teacher"] = {"kv_bytes_per_sequence": per_sequence, "rows": rows}
    keras.backend.clear_session()
    return _serve_summary(result)


# Ops that move no data (views, metadata, handles) and ops that read only the part they output.
_NO_TRAFFIC_OPS = {
    "Const",
    "Placeholder",
    "Identity",
    "IdentityN",
    "Reshape",
    "ExpandDims",
    "Squeeze",
    "ReadVariableOp",
    "VarHandleOp",
    "Shape",
    "ShapeN",
    "Size",
    "Rank",
    "NoOp",
    "StopGradient",
    "BroadcastArgs",
}
_PARTIAL_READ_OPS = {"GatherV2", "ResourceGather", "GatherNd", "StridedSlice", "Slice"}
# Grappler folds a transpose read only by matmuls into their transpose flags (keras' tied
# `ReversibleEmbedding` head is `matmul(h, transpose(embeddings))`): timed equal to
# `matmul(..., transpose_b=True)` at GPT-2's 50257 x 768 on this CPU.
_MATMUL_OPS = {"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"}


def graph_traffic_bytes(graph):
    """The bytes a graph's ops read and write, each op once: the memory-traffic model of one call.

    Every op reads its inputs and writes its outputs, except ops that move no
    data (`_NO_TRAFFIC_OPS`: views, metadata), transposes that only feed
    matmuls (Grappler folds them) and gathers and slices, which read only
    what they output. A model of memory traffic, not of compute or of the
    cost of launching each op. Returns ``(bytes, unknown)``: ``unknown``
    counts tensors of unknown shape and nested function calls, whose bytes
    are missing (0 for the decode steps measured here).
    """
    total, unknown = 0, 0

    def size(t):
        nonlocal unknown
        n = t.shape.num_elements()
        if n is None:
            unknown += 1
            return 0
        try:
            return n * t.dtype.size
        except (TypeError, ValueError):  # resource / variant handles
            return 0

    def walk(g):
        nonlocal total, unknown
        for op in g.get_operations():
            if op.type in ("PartitionedCall", "StatefulPartitionedCall"):
                unknown += 1  # a nested function: its ops are not counted
                continue
            if op.type in _NO_TRAFFIC_OPS:
                continue
            consumers = [c for t in op.outputs for c in t.consumers()]
            if op.type == "Transpose" and consumers and all(c.type in _MATMUL_OPS for c in consumers):
                continue  # folded into the matmul
            written = sum(size(t) for t in op.outputs)
            read = written if op.type in _PARTIAL_READ_OPS else sum(size(t) for t in op.inputs)
            total += read + written

    walk(graph)
    return total, unknown


def long_generate_prompts(vocab, contexts):
    """``{context: [1, context] int32}``: the random prompts of `stage_long_generate`, the same in every process."""
    import numpy as np

    rng = np.random.default_rng(0)
    return {c: rng.integers(0, vocab, size=(1, c)).astype("int32") for c in contexts}


def stage_long_generate(args):
    """A real prefill of each context, then greedy decode steps: prefill seconds and ms per new token, batch 1.

    The prompt goes through in pieces of `--prefill-piece` tokens, the way
    a server bounds a long prompt's memory: the student's pieces continue
    its state (`last_logits_with_state`: no logits but the last position's);
    keras-hub's write a KV cache of the whole length (``call_with_cache`` at
    the piece's index, its causal mask over the cache; it returns every
    position's logits). Then `--decode-tokens` greedy steps, the first
    reported apart. Each context's shapes are traced before the timing.
    Both run as plain `tf.function`s, the faster mode on this CPU for both
    models (see ``decode`` and ``serve``). Each step graph's memory traffic
    (`graph_traffic_bytes`) over the bandwidth measured here is the
    prediction reported beside the measured time.
    """
    import gc

    import numpy as np
    import tensorflow as tf

    vocab = CONFIGS[(args.family, args.size)]["vocabulary_size"]
    piece = args.prefill_piece
    new = args.decode_tokens
    bw = bandwidth_gib_s()
    result = {"prefill_piece": piece, "decode_tokens": new, "bandwidth_gib_s": bw}

    def run(name, prefill_piece, step, state, context, prompt, traffic):
        # Warm-up at this context's shapes (traced once, then reused): a piece and a step.
        logits, warm = prefill_piece(prompt[:, :piece], state, 0)
        np.asarray(step(tf.constant(np.asarray(logits).argmax(-1).astype("int32")), warm, min(piece, context))[0])
        traffic_bytes, unknown = traffic(warm)
        del warm
        t = time.perf_counter()
        for start in range(0, context, piece):
            logits, state = prefill_piece(prompt[:, start : start + piece], state, start)
        logits = np.asarray(logits)
        prefill_s = time.perf_counter() - t
        rss, _ = _rss()
        token, times = logits.argmax(-1).astype("int32"), []
        tokens = [int(token[0])]  # the prefill's token, then one a step
        for i in range(new):
            t = time.perf_counter()
            logits, state = step(tf.constant(token), state, context + i)
            logits = np.asarray(logits)
            times.append(time.perf_counter() - t)
            token = logits.argmax(-1).astype("int32")
            tokens.append(int(token[0]))
        row = {
            "context": context,
            "prefill_s": prefill_s,
            "prefill_ms_per_token": 1e3 * prefill_s / context,
            "first_step_s": times[0],  # after the warm-up: no tracing
            "ms_per_token": 1e3 * _median(times[1:]) if new > 1 else None,
            "ms_range": [1e3 * min(times[1:]), 1e3 * max(times[1:])] if new > 1 else None,
            "rss_after_prefill_gib": _gib(rss),
            # The step graph's memory traffic (graph_traffic_bytes) over the bandwidth measured here.
            "step_traffic_bytes": traffic_bytes,
            "step_unknown_shapes": unknown,
            "predicted_ms_per_token": 1e3 * traffic_bytes / (bw * 2**30),
            "tokens": tokens,
        }
        print(json.dumps({name: row}), flush=True)
        return row

    prompts = long_generate_prompts(vocab, args.contexts)
    if args.serve_model in ("student", "both"):
        student, load_s = _load_student(args)

        def last_fn(ids, state):
            logits, state = student.last_logits_with_state(ids, state)
            return logits, tuple(state)

        def step_fn(token, state):
            logits, state = student.step(token, state)
            return logits, tuple(state)

        last, step_fn = tf.function(last_fn, autograph=False), tf.function(step_fn, autograph=False)
        rows = []
        for context in args.contexts:
            rows.append(
                run(
                    "student",
                    lambda ids, state, start: last(tf.constant(ids), state),
                    lambda token, state, index: step_fn(token, state),
                    tuple(student.get_initial_state(1)),
                    context,
                    prompts[context],
                    lambda state: graph_traffic_bytes(
                        step_fn.get_concrete_function(tf.zeros((1,), "int32"), state).graph
                    ),
                )
            )
        result["student"] = {"load_s": load_s, "rows": rows}
        del student
        gc.collect()
    if args.serve_model in ("teacher", "both"):
        teacher = build_teacher(args.family, args.size)
        call = tf.function(lambda ids, cache, index: teacher.call_with_cache(ids, cache, index), autograph=False)

        def teacher_piece(ids, cache, start):
            logits, _, cache = call(tf.constant(ids), cache, tf.constant(start, "int32"))
            return logits[:, -1], cache

        def teacher_step(token, cache, index):
            logits, _, cache = call(token[:, None], cache, tf.constant(index, "int32"))
            return logits[:, -1], cache

        rows = []
        for context in args.contexts:
            cache = tf.zeros((1, *_kv_cache_shape(teacher, context + new)), "float32")
            rows.append(
                run(
                    "teacher",
                    teacher_piece,
                    teacher_step,
                    cache,
                    context,
                    prompts[context],
                    lambda cache: graph_traffic_bytes(
                        call.get_concrete_function(tf.zeros((1, 1), "int32"), cache, tf.constant(0, "int32")).graph
                    ),
                )
            )
            del cache
            gc.collect()
        result["teacher"] = {"rows": rows}
    return result


def _serve_summary(result):
    """Adds each model's largest batch and best row, and the student/teacher throughput ratio."""
    for name in ("student", "teacher"):
        if result.get(name, {}).get("rows"):
            best = max(result[name]["rows"], key=lambda r: r["tokens_per_s"])
            result[name]["largest_batch"] = max(r["batch"] for r in result[name]["rows"])
            result[name]["best"] = best
    if result.get("student", {}).get("best") and result.get("teacher", {}).get("best"):
        result["throughput_ratio"] = (
            result["student"]["best"]["tokens_per_s"] / result["teacher"]["best"]["tokens_per_s"]
        )
    return result


def stage_traffic(args):
    """`graph_traffic_bytes` of one decode step at batch 1, per model and context (traced, not run)."""
    import tensorflow as tf

    result = {"weights_gib": None, "student": [], "teacher": []}
    if args.serve_model in ("student", "both"):
        student, _ = _load_student(args)
        result["weights_gib"] = _gib(weight_bytes(student))
        fn = tf.function(lambda token, state: student.step(token, state), autograph=False)
        state = tuple(student.get_initial_state(1))
        graph = fn.get_concrete_function(tf.zeros((1,), "int32"), state).graph
        traffic, unknown = graph_traffic_bytes(graph)  # the same graph at every context
        result["student"] = [{"context": c, "step_traffic_bytes": traffic, "unknown": unknown} for c in args.contexts]
        del student, fn, graph
    if args.serve_model in ("teacher", "both"):
        teacher = build_teacher(args.family, args.size)
        call = tf.function(lambda ids, cache, index: teacher.call_with_cache(ids, cache, index), autograph=False)
        for context in args.contexts:
            spec = tf.TensorSpec((1, *_kv_cache_shape(teacher, context + args.decode_tokens)))
            graph = call.get_concrete_function(tf.TensorSpec((1, 1), "int32"), spec, tf.TensorSpec((), "int32")).graph
            traffic, unknown = graph_traffic_bytes(graph)
            result["teacher"].append({"context": context, "step_traffic_bytes": traffic, "unknown": unknown})
    print(json.dumps(result), flush=True)
    return result


def weight_matrices(family, size, config=None):
    """``[(rows, cols), ...]``: the matrices a decode step multiplies a vector by, from the config alone.

    The config is ``CONFIGS[(family, size)]``, or `config` when given (a
    smaller variant of one, e.g. fewer layers).

    Per layer the attention's query, key, value and output projections and
    the feed-forward's (GPT-2: in and out; Llama: gate, up and down), then
    the vocabulary head (the token embedding, tied or not). Embedding and
    position lookups read one row and are left out, as are biases, norms
    and the feature maps (a few MB at these sizes).
    """
    cfg = CONFIGS[(family, size)] if config is None else config
    h, inner, vocab = cfg["hidden_dim"], cfg["intermediate_dim"], cfg["vocabulary_size"]
    if family == "gpt2":
        kv = h
        ffn = [(h, inner), (inner, h)]
    else:
        kv = h // cfg["num_query_heads"] * cfg["num_key_value_heads"]
        ffn = [(h, inner), (h, inner), (inner, h)]
    layer = [(h, h), (h, kv), (h, kv), (h, h)] + ffn
    return layer * cfg["num_layers"] + [(h, vocab)]


def matrix_chain(matrices):
    """A `tf.function` ``x [1, n] -> scalar`` multiplying a vector by each matrix in turn, each after the one before."""
    import tensorflow as tf

    @tf.function(autograph=False)
    def chain(x):
        acc = tf.zeros((), tf.float32)
        for w in matrices:
            rows = w.shape[0]
            vec = tf.tile(x, [1, -(-rows // x.shape[1])])[:, :rows] + acc * 0.0  # waits for the product before
            acc = tf.reduce_sum(tf.matmul(vec, w)[:, :1])
        return acc

    return chain


def stage_chain(args):
    """The weights-read floor as TensorFlow reaches it: the model's own matrices, one matvec each, nothing else.

    One float32 variable per matrix of `weight_matrices` (random), and a
    `tf.function` that multiplies a [1, rows] vector by each in turn (each
    product waits for the one before, as in a step), the way a decode step
    at batch 1 reads its weights. Its median time beside the single large
    matrix-vector product's bandwidth (`bandwidth_gib_s`) says how far from
    that floor the weight reads alone already are on this CPU.

    The same products through numpy (its BLAS), one after the other, give
    ``numpy_chain_ms``: what a matrix-vector kernel other than TensorFlow's
    reaches on the same shapes. numpy's chain runs first; then the arrays
    become TensorFlow's variables one at a time (so the weights are held
    once), and a pause separates the timings, since BLAS threads that wait
    spinning after a call slow the next library's threads. The floor's
    single product is not a strict lower bound: a chain of the model's
    matrices can read faster than it (numpy's at 0.91x at 1B).
    """
    import numpy as np
    import tensorflow as tf

    shapes = weight_matrices(args.family, args.size)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
    total = sum(int(np.prod(shape)) * 4 for shape in shapes)

    def median_ms(fn, x, calls):
        np.asarray(fn(x))
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            np.asarray(fn(x))
            times.append(time.perf_counter() - t)
        return 1000 * _median(times), [round(1000 * t, 2) for t in times]

    def numpy_chain(_):
        acc = np.float32(0.0)
        for a in arrays:
            acc = (np.full(a.shape[0], 1.0 + 0.0 * acc, np.float32) @ a)[0]  # waits for the product before
        return np.asarray(acc)

    x = tf.ones((1, shapes[0][0]), tf.float32)
    bw_before = bandwidth_gib_s()
    numpy_ms, _ = median_ms(numpy_chain, None, args.repeats * 4 + 1)
    weights = []
    while arrays:  # to TensorFlow one matrix at a time: the weights are never held twice
        weights.append(tf.Variable(arrays.pop(0)))
    time.sleep(0.5)
    chain_ms, chain_all = median_ms(matrix_chain(weights), x, args.repeats * 4 + 1)
    time.sleep(0.5)
    # TensorFlow's own kernel on the floor's single 512 MB matrix.
    n = int((512 * 2**20 / 4) ** 0.5)
    big = tf.Variable(rng.standard_normal((n, n), dtype=np.float32))
    one_ms, _ = median_ms(matrix_chain([big]), tf.ones((1, n), tf.float32), 7)
    del big
    bw_after = bandwidth_gib_s()
    bw = _median([bw_before, bw_after])
    floor_ms = 1000 * total / 2**30 / bw
    result = {
        "matrices": len(shapes),
        "weight_gib": _gib(total),
        "bandwidth_gib_s": [bw_before, bw_after],
        "tf_single_matvec_bandwidth_gib_s": n * n * 4 / 2**30 / (one_ms / 1000),
        "floor_ms": floor_ms,
        "chain_ms": chain_ms,
        "chain_ms_all": chain_all,
        "chain_over_floor": chain_ms / floor_ms,
        "chain_bandwidth_gib_s": total / 2**30 / (chain_ms / 1000),
        "numpy_chain_ms": numpy_ms,
        "numpy_chain_over_floor": numpy_ms / floor_ms,
    }
    print(json.dumps(result), flush=True)
    return result


def _generate_summary(result):
    """Adds, per context, keras-hub's ms per token over the student's (decode and prefill)."""
    teacher = {r["context"]: r for r in result.get("teacher", {}).get("rows", [])}
    ratios = []
    for row in result.get("student", {}).get("rows", []):
        other = teacher.get(row["context"])
        if other and row["ms_per_token"] and other["ms_per_token"]:
            ratios.append(
                {
                    "context": row["context"],
                    "decode_teacher_over_student": other["ms_per_token"] / row["ms_per_token"],
                    "prefill_teacher_over_student": other["prefill_s"] / row["prefill_s"],
                    "predicted_decode_teacher_over_student": other["step_traffic_bytes"] / row["step_traffic_bytes"],
                }
            )
    result["ratios"] = ratios
    return result


STAGE_FUNCTIONS = {name: globals()[f"stage_{name}"] for name in STAGES}


# ------------------------------------------------------------------ driver
def _child(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    t = time.perf_counter()
    result = STAGE_FUNCTIONS[args.stage](args)
    _, peak = _rss()
    result.update(stage=args.stage, wall_s=time.perf_counter() - t, peak_gib=_gib(peak))
    print("RESULT " + json.dumps(result), flush=True)


def _run_stage(args, stage):
    if stage in ("serve", "long_generate") and args.serve_model == "both":
        # One process per model: memory a process has freed stays its own, so the second model's
        # batches would be measured against the first one's peak.
        parts = {}
        for model in ("student", "teacher"):
            parts[model] = _run_stage(argparse.Namespace(**{**vars(args), "serve_model": model}), stage)
        if any("failed" in part for part in parts.values()):
            return {"stage": stage, **{f"{m}_process": part for m, part in parts.items()}}
        merged = {**parts["student"], "teacher": parts["teacher"]["teacher"]}
        merged["process_s"] = sum(part["process_s"] for part in parts.values())
        merged["peak_gib"] = {m: part["peak_gib"] for m, part in parts.items()}
        return _serve_summary(merged) if stage == "serve" else _generate_summary(merged)
    command = [sys.executable, "-m", "benchmarks.bench_linearized_decode", "--stage", stage]
    command += ["--family", args.family, "--size", args.size, "--workdir", args.workdir]
    command += ["--contexts", ",".join(map(str, args.contexts)), "--repeats", str(args.repeats)]
    command += ["--new-tokens", ",".join(map(str, args.new_tokens))]
    if args.no_teacher:
        command.append("--no-teacher")
    if args.merge_in_place:
        command.append("--merge-in-place")
    command += ["--student-modes", args.student_modes, "--onnx-spinning", args.onnx_spinning]
    if args.onnx_no_prepacking:
        command.append("--onnx-no-prepacking")
    command += ["--onnx-profile", str(args.onnx_profile)]
    command += ["--serve-context", str(args.serve_context), "--serve-batches", args.serve_batches]
    command += ["--serve-budget-gib", str(args.serve_budget_gib), "--serve-model", args.serve_model]
    command += ["--prefill-piece", str(args.prefill_piece), "--decode-tokens", str(args.decode_tokens)]
    print(f"== {stage}", flush=True)
    t = time.perf_counter()
    process = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    result = None
    for line in process.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
        else:
            print("   " + line, flush=True)
    if result is None:
        tail = "\n".join(process.stderr.strip().splitlines()[-5:])
        result = {"stage": stage, "failed": f"exit {process.returncode}", "stderr_tail": tail}
    result["process_s"] = time.perf_counter() - t
    print("   " + json.dumps(result), flush=True)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default="gpt2")
    parser.add_argument("--size", default="base")
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--contexts", default=None, help="comma-separated prompt lengths for decode")
    parser.add_argument("--new-tokens", default="8,40", help="short,long generate lengths; decode = their difference")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-teacher", action="store_true", help="decode: time the student only")
    parser.add_argument(
        "--student-modes", default="xla,plain", help="decode: the student's generate modes (xla, plain, auto, all)"
    )
    parser.add_argument(
        "--onnx-spinning",
        default="sleep,spin",
        help="onnx_decode: onnxruntime's worker threads between ops: sleep (the package's default), spin, or both",
    )
    parser.add_argument(
        "--onnx-no-prepacking",
        action="store_true",
        help="onnx_decode: one copy of the weights in onnxruntime (no repacked copy; for models near the memory limit)",
    )
    parser.add_argument(
        "--onnx-profile", type=int, default=0, help="onnx_decode: also profile this many steps (onnxruntime's profiler)"
    )
    parser.add_argument("--merge-in-place", action="store_true", help="merge_lora: merge into the student")
    parser.add_argument("--serve-context", type=int, default=16384, help="serve: the context of the timed step")
    parser.add_argument("--serve-batches", default="1,2,4,8,16,32,64,128,256", help="serve: batch sizes to try")
    parser.add_argument(
        "--serve-budget-gib", type=float, default=20.0, help="serve: process memory the weights and batch may use"
    )
    parser.add_argument(
        "--serve-model",
        choices=("student", "teacher", "both"),
        default="both",
        help="serve, long_generate: the model(s) to run, each in its own process",
    )
    parser.add_argument("--prefill-piece", type=int, default=1024, help="long_generate: prompt tokens a piece")
    parser.add_argument("--decode-tokens", type=int, default=8, help="long_generate: greedy steps after the prefill")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if (args.family, args.size) not in CONFIGS:
        parser.error(f"no configuration {args.family} {args.size}; known: {sorted(CONFIGS)}")
    args.contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else list(DEFAULT_CONTEXTS[args.family])
    args.new_tokens = [int(n) for n in args.new_tokens.split(",")]
    spinning = args.onnx_spinning.split(",")
    if not spinning or set(spinning) - {"sleep", "spin"}:
        parser.error(f"--onnx-spinning takes sleep, spin or both. Received: {args.onnx_spinning!r}")
    args.workdir = args.workdir or os.path.join("build", f"linearized_{args.family}_{args.size}")
    os.makedirs(args.workdir, exist_ok=True)
    if args.stage:
        return _child(args)
    results = {"family": args.family, "size": args.size, "config": CONFIGS[(args.family, args.size)], "stages": {}}
    for stage in args.stages.split(","):
        results["stages"][stage] = _run_stage(args, stage)
    out = args.out or os.path.join("benchmarks", "results", f"linearized_{args.family}_{args.size}.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
