"""Where a linearized student's decode step spends its time: the step timed beside variants that drop one part.

A student of keras-hub's GPT-2 widths (or Llama 3.2 1B's: ``--family
llama``), linearized like `bench_linearized_decode`'s (hedgehog + window
64), with a small vocabulary so that the layers dominate, random weights.
One `tf.function` per variant, each traced once, timed in turns in the same
process (``--rounds`` rounds of ``--calls`` calls; the median of each
round's median), batch 1:

- ``step``: the student's `step`, as `generate` runs it;
- ``no_recurrence``: the attention's recurrence left out (projections and
  output projection kept, the state passed through): what the rest of the
  step costs;
- ``no_feature_maps``: the feature maps replaced by a copy of their input
  to the same width;
- ``fused_qkv``: the query, key and value projections as one matrix
  product against their kernels concatenated beforehand (what a fused
  layout would save; the student's own layout keeps keras-hub's three
  kernels);
- ``matrices``: the layers' own matrices multiplied one after the other
  (`bench_linearized_decode.weight_matrices`'s shapes), nothing else.

    python -m benchmarks.ablate_decode_step --layers 12

With ``--profile N`` (at most 50) the ``step`` variant is also traced
afresh and run N times under TensorFlow's profiler, and the result gains ``profile``: the time of each
op type and of each kind of layer per step (`profile_ops`). The ops of a step
run partly at once on the CPU's inter-op threads, so their summed time can
exceed the step's; the profiler also slows a step, by the figure it reports
beside the unprofiled one.

Each variant's output is not the student's (they drop work); only the
``step`` variant computes the model.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

VARIANTS = ("step", "no_recurrence", "no_feature_maps", "fused_qkv", "matrices")
# Op types that multiply by a matrix (TensorFlow's own and oneDNN's rewrites of them).
MATRIX_OPS = frozenset(
    prefix + name
    for prefix in ("", "_Mkl", "_MklNative")
    for name in ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "FusedMatMul", "_FusedMatMul")
)
# Profiler events that contain ops (the function call, the executor, thread-pool bookkeeping): not ops themselves.
_NOT_OPS = ("KernelAndDeviceFunc", "EagerLocalExecute", "ExecutorState", "ThreadpoolListener")
_ACTIVE = {"variant": "step"}  # read while a variant's function is traced


def _patch():
    """Routes `project`, the feature maps and the attention step through `_ACTIVE` at trace time; returns the undo."""
    from keras import ops

    from keras_linattn.layers import _attention_base
    from keras_linattn.layers import linear_attention as la
    from keras_linattn.recurrences import window

    project, features, step = (
        _attention_base.ProjectedAttention.project,
        window.WindowRecurrence.features,
        la.LinearAttention.step,
    )

    def patched_project(self, query, value, key=None):
        fused = getattr(self, "_ablation_fused", None)
        if _ACTIVE["variant"] != "fused_qkv" or fused is None:
            return project(self, query, value, key)
        kernel, bias, sizes = fused
        y = ops.matmul(query[:, 0], kernel) + bias  # [B, (H + 2 G) D]
        q, k, v = ops.split(y, [sizes[0], sizes[0] + sizes[1]], axis=-1)
        heads = lambda x, n: ops.reshape(x, (-1, 1, n, self.key_dim))  # noqa: E731
        q, k, v = heads(q, self.num_heads), heads(k, self.key_value_heads), heads(v, self.key_value_heads)
        groups = self.num_heads // self.key_value_heads
        if groups > 1:
            k, v = ops.repeat(k, groups, axis=2), ops.repeat(v, groups, axis=2)
        return q, k, v

    def patched_features(self, x, is_query, causal=True, training=None, key_mask=None):
        if _ACTIVE["variant"] != "no_feature_maps":
            return features(self, x, is_query, causal, training, key_mask)
        repeats = self.feature_dim // x.shape[-1]
        return ops.concatenate([x] * repeats, axis=-1) if repeats > 1 else x

    def patched_step(self, query_t, value_t, state, key_t=None, training=None):
        if _ACTIVE["variant"] != "no_recurrence":
            return step(self, query_t, value_t, state, key_t=key_t, training=training)
        q, k, v = self.project(query_t[:, None], value_t[:, None], value_t[:, None])
        out = self.project_output((q + k + v)[:, :, :, : self.value_dim], training)
        return out[:, 0], tuple(state)

    _attention_base.ProjectedAttention.project = patched_project
    window.WindowRecurrence.features = patched_features
    la.LinearAttention.step = patched_step

    def undo():
        _attention_base.ProjectedAttention.project = project
        window.WindowRecurrence.features = features
        la.LinearAttention.step = step

    return undo


def _op_events(xspace):
    """``[(op name, op type, duration ms)]`` of the op executions in a profiler `XSpace`."""
    events = []
    for plane in xspace.planes:
        names = {key: meta.name for key, meta in plane.event_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                name = names.get(event.metadata_id, "")
                op, sep, op_type = name.rpartition(":")
                if not sep or not op or " " in name or "::" in name or op.startswith(_NOT_OPS):
                    continue
                events.append((op, op_type, event.duration_ps / 1e9))
    return events


def _scope(op_name):
    """The kind of layer an op belongs to: its name's first part without Keras' ``_<n>`` index.

    The layers of one kind (the 12 ``query`` layers) share a row, and ops
    outside any layer (the window's, or oneDNN's fused products named after
    the add fused into them) are ``(unscoped)``. TensorFlow's own name
    scopes (``einsum``, ``clip_by_value``) show as rows of their own.
    """
    import re

    head, sep, _ = op_name.partition("/")
    return re.sub(r"_\d+$", "", head) if sep else "(unscoped)"


MAX_PROFILED_CALLS = 50


def profile_ops(function, args, calls, logdir):
    """Runs ``function(*args)`` `calls` times under TensorFlow's profiler: what each op type and layer kind costs.

    `function` is a `tf.function` (or a Python function); it is traced
    afresh here, since TensorFlow's executor stops recording the ops of a
    function it has run often (about 100 calls: it then runs the ops it
    found cheap inline, untraced), hence also at most `MAX_PROFILED_CALLS`.

    Returns ``{"calls", "ms_per_call", "op_ms_per_call", "matrix_op_ms_per_call",
    "by_type": {type: {"count", "ms"}}, "by_scope": {scope: {"count", "ms"}}}``,
    per call, largest first, read from the trace's op events (the
    profiler's own op statistics, `profile_attention.read_op_stats`, count
    about a third of the step's cheap ops: 57-70 of its 183 `Mul` a step at
    GPT-2 base). ``ms_per_call`` is the wall time under the profiler;
    ``op_ms_per_call`` the ops' summed time (ops that ran at once on
    different threads both count). Matrix products are the types in
    `MATRIX_OPS`; oneDNN's fused products carry the name of the op fused
    into them (a bias, GELU or residual add).
    """
    import glob

    import numpy as np
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # the profiler's own trace format

    if not 1 <= calls <= MAX_PROFILED_CALLS:
        raise ValueError(f"`calls` must be in [1, {MAX_PROFILED_CALLS}]. Received: calls={calls}")
    fresh = tf.function(getattr(function, "python_function", function), autograph=False)

    def call():
        return np.asarray(tf.nest.flatten(fresh(*args))[0])  # the first output (logits), as the timed calls read

    call()  # traced before the profile starts
    # Level 3 records every op: at the default level the executor leaves out the ops it runs inline as cheap.
    tf.profiler.experimental.start(logdir, options=tf.profiler.experimental.ProfilerOptions(host_tracer_level=3))
    start = time.perf_counter()
    try:
        for _ in range(calls):
            call()
    finally:
        wall = time.perf_counter() - start
        tf.profiler.experimental.stop()
    paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError(f"TensorFlow's profiler wrote no trace under {logdir}")
    xspace = xplane_pb2.XSpace()
    with open(max(paths, key=os.path.getmtime), "rb") as f:
        xspace.ParseFromString(f.read())
    events = _op_events(xspace)
    if not events:
        raise RuntimeError("The profile holds no op executions: was `call` a TensorFlow function?")

    def table(key):
        rows = {}
        for op, op_type, ms in events:
            row = rows.setdefault(key(op, op_type), {"count": 0.0, "ms": 0.0})
            row["count"] += 1 / calls
            row["ms"] += ms / calls
        ordered = sorted(rows.items(), key=lambda item: -item[1]["ms"])
        return {name: {"count": round(r["count"], 2), "ms": round(r["ms"], 4)} for name, r in ordered}

    return {
        "calls": calls,
        "ms_per_call": 1e3 * wall / calls,
        "op_ms_per_call": sum(ms for _, _, ms in events) / calls,
        "matrix_op_ms_per_call": sum(ms for _, t, ms in events if t in MATRIX_OPS) / calls,
        "by_type": table(lambda op, op_type: op_type),
        "by_scope": table(lambda op, op_type: _scope(op)),
    }


def _fuse(student):
    """Concatenated q/k/v kernels and biases (eager copies) on each attention layer, for ``fused_qkv``."""
    import numpy as np
    from keras import ops

    from keras_linattn import _compat
    from keras_linattn.layers._attention_base import ProjectedAttention

    for layer in _compat.flatten_layers(student):
        if not isinstance(layer, ProjectedAttention):
            continue
        denses = (layer.query_dense, layer.key_dense, layer.value_dense)
        kernels = [np.reshape(ops.convert_to_numpy(d.kernel), (d.kernel.shape[0], -1)) for d in denses]
        biases = [
            np.zeros(k.shape[1], "float32") if d.bias is None else np.ravel(ops.convert_to_numpy(d.bias))
            for d, k in zip(denses, kernels, strict=True)
        ]
        layer._ablation_fused = (np.concatenate(kernels, 1), np.concatenate(biases), [k.shape[1] for k in kernels])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocabulary", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=21)
    parser.add_argument(
        "--profile", type=int, default=0, help=f"profile this many calls of `step`, 0 (none) to {MAX_PROFILED_CALLS}"
    )
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not 0 <= args.profile <= MAX_PROFILED_CALLS:
        parser.error(f"--profile must be in [0, {MAX_PROFILED_CALLS}]")

    import keras
    import keras_hub

    import keras_linattn
    from benchmarks import bench_linearized_decode as bench

    size = "base" if args.family == "gpt2" else "1b"
    config = dict(bench.CONFIGS[(args.family, size)], num_layers=args.layers, vocabulary_size=args.vocabulary)
    keras.utils.set_random_seed(0)
    if args.family == "gpt2":
        teacher = keras_hub.models.GPT2CausalLM(keras_hub.models.GPT2Backbone(**config), preprocessor=None)
    else:
        teacher = keras_hub.models.LlamaCausalLM(keras_hub.models.LlamaBackbone(**config), preprocessor=None)
    student = keras_linattn.linearize(teacher, window_size=bench.WINDOW)
    del teacher
    undo = _patch()
    try:
        return _run(args, config, student)
    finally:
        undo()
        _ACTIVE["variant"] = "step"


def _run(args, config, student):
    import numpy as np
    import tensorflow as tf

    from benchmarks import bench_linearized_decode as bench

    _fuse(student)

    token = tf.zeros((1,), "int32")
    state = tuple(student.get_initial_state(1))
    functions = {}
    for variant in VARIANTS[:-1]:
        _ACTIVE["variant"] = variant

        @tf.function(autograph=False)
        def run(token, state):
            logits, new_state = student.step(token, state)
            return logits, tuple(new_state)

        run.get_concrete_function(token, state)  # traced now, with this variant active
        functions[variant] = run
    _ACTIVE["variant"] = "step"
    rng = np.random.default_rng(0)
    shapes = bench.weight_matrices(args.family, None, config)
    chain = bench.matrix_chain([tf.Variable(rng.standard_normal(shape, dtype=np.float32)) for shape in shapes])

    x = tf.ones((1, config["hidden_dim"]), tf.float32)
    calls = {name: (lambda fn=fn: fn(token, state)[0].numpy()) for name, fn in functions.items()}
    calls["matrices"] = lambda: chain(x).numpy()
    for call in calls.values():
        call()
    rounds = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            times = []
            for _ in range(args.calls):
                t = time.perf_counter()
                call()
                times.append(time.perf_counter() - t)
            rounds[name].append(1e3 * float(np.median(times)))
    result = {
        "family": args.family,
        "layers": args.layers,
        "vocabulary_size": args.vocabulary,
        "ms": {name: float(np.median(values)) for name, values in rounds.items()},
        "rounds_ms": {name: [round(v, 2) for v in values] for name, values in rounds.items()},
    }
    base = result["ms"]["step"]
    result["saved_ms"] = {name: base - ms for name, ms in result["ms"].items() if name != "step"}
    if args.profile:
        import tempfile

        with tempfile.TemporaryDirectory() as logdir:
            result["profile"] = profile_ops(functions["step"], (token, state), args.profile, logdir)
        result["profile"]["step_ms_unprofiled"] = base
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
