"""Where a decode step's time goes: a per-op profile of an exported ``step`` signature.

Runs the SavedModel's ``step`` signature (the graph a non-XLA `tf.function`
decode step runs; `SavedModelRunner`'s TF1 Session) at batch 1 with
``RunOptions(trace_level=FULL_TRACE)`` and sums each op's time over
`--repeats` traced runs, grouped by op type and by the layer that owns it
(the first two levels of the op's name scope):

    python -m benchmarks.profile_decode_step build/linearized_gpt2_base/saved_model/1

The weights-read floor (the step's weight bytes divided by the bandwidth of
a large float32 matrix-vector product here) is printed beside the measured
step time. Op times overlap when TensorFlow runs ops in parallel, so their
sum can exceed the wall time.
"""

import argparse
import collections
import os
import re
import sys
import time

import numpy as np


def _layer_of(node_name, depth):
    parts = [p for p in node_name.split("/") if p and not p.startswith("StatefulPartitionedCall")]
    parts = [re.sub(r"_\d+$", "", p) for p in parts]
    return "/".join(parts[:depth]) or node_name


def profile(version_dir, repeats=20, depth=2):
    import tensorflow as tf

    from keras_linattn.export.saved_model_runner import SavedModelRunner

    runner = SavedModelRunner(version_dir)
    sig = runner._signature("step")
    feeds = {}
    for info in sig.inputs.values():
        shape = [1 if d.size < 0 else d.size for d in info.tensor_shape.dim]
        dtype = tf.as_dtype(info.dtype).as_numpy_dtype
        feeds[runner._graph.get_tensor_by_name(info.name)] = np.zeros(shape, dtype)
    fetches = {name: runner._graph.get_tensor_by_name(info.name) for name, info in sig.outputs.items()}
    session = runner._session
    for _ in range(3):
        session.run(fetches, feeds)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        session.run(fetches, feeds)
        times.append(time.perf_counter() - t)
    by_type, by_layer, count = collections.Counter(), collections.Counter(), 0
    for _ in range(repeats):
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        metadata = tf.compat.v1.RunMetadata()
        session.run(fetches, feeds, options=options, run_metadata=metadata)
        for device in metadata.step_stats.dev_stats:
            for node in device.node_stats:
                micros = node.all_end_rel_micros
                op = node.timeline_label.split("=")[-1].split("(")[0].strip() if node.timeline_label else node.node_name
                by_type[op.split(":")[0]] += micros
                by_layer[_layer_of(node.node_name, depth)] += micros
                count += 1
    runner.close()
    return {
        "step_ms": 1e3 * float(np.median(times)),
        "ops_per_step": count // repeats,
        "by_type_ms": {k: v / repeats / 1e3 for k, v in by_type.most_common()},
        "by_layer_ms": {k: v / repeats / 1e3 for k, v in by_layer.most_common()},
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version_dir")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    result = profile(args.version_dir, args.repeats, args.depth)
    print(f"step: {result['step_ms']:.2f} ms (median of {args.repeats}), {result['ops_per_step']} ops traced")
    for title, table in (("op type", result["by_type_ms"]), ("layer", result["by_layer_ms"])):
        print(f"\n{'ms':>8}  {title}")
        for name, ms in list(table.items())[: args.top]:
            print(f"{ms:8.2f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
