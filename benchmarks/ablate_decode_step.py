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

Each variant's output is not the student's (they drop work); only the
``step`` variant computes the model.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

VARIANTS = ("step", "no_recurrence", "no_feature_maps", "fused_qkv", "matrices")
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
    parser.add_argument("--out")
    args = parser.parse_args(argv)

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
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
