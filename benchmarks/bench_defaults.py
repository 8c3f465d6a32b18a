"""What the default attention costs: decode-state bytes and forward time of `LinearBackbone`, side by side.

    python -m benchmarks.bench_defaults                 # the shapes below, median of 10
    python -m benchmarks.bench_defaults --repeats 3 --out-dir /tmp/x

The default attention is taylor + a short convolution of size 4 (the
recommended one: docs/results.md, "Which attention to pick"). Taylor's
feature dim is ``C = 1 + D + D^2`` for key dim D, so its state ``S [H, C, M]``
grows with the square of the head. Each row is one backbone (2 blocks,
intermediate 2 x width, vocabulary 256) at batch 4 and 256 tokens, built in
this one process: the old default (elu, no convolution), the new default,
and at wide heads (D = 64) the new default with ``key_dim=16`` (Based's).
State: bytes of the whole decode state per sequence (`state_spec`). Forward:
median milliseconds of one call in a `tf.function` (graph mode), after a
warm-up call. Outputs: ``<out-dir>/defaults.{md,json}``.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# (label, hidden_dim, num_heads, backbone arguments)
ROWS = (
    ("elu, no conv (0.3.0 default)", 64, 4, dict(feature_map="elu", conv_size=None)),
    ("taylor + conv 4 (default)", 64, 4, dict()),
    ("elu, no conv (0.3.0 default)", 256, 4, dict(feature_map="elu", conv_size=None)),
    ("taylor + conv 4 (default)", 256, 4, dict()),
    ("taylor + conv 4, key_dim=16", 256, 4, dict(key_dim=16)),
)
BATCH, LENGTH = 4, 256


def state_bytes(backbone):
    """Bytes of one sequence's decode state (every `state_spec` entry, float32 or int32: 4 bytes)."""
    total = 0
    for entry in backbone.state_spec():
        count = 1
        for size in entry.shape:
            count *= int(size)
        total += 4 * count
    return total


def run(repeats, log=print):
    import numpy as np
    import tensorflow as tf

    from keras_linattn.models import LinearBackbone

    ids = np.random.default_rng(0).integers(1, 256, (BATCH, LENGTH)).astype("int32")
    inputs = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    rows = []
    for label, width, heads, arguments in ROWS:
        backbone = LinearBackbone(256, 2, width, heads, 2 * width, **arguments)
        forward = tf.function(lambda x, model=backbone: model(x))
        forward(inputs)  # trace and warm up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            np.asarray(forward(inputs))
            times.append(1000 * (time.perf_counter() - start))
        attention = backbone.decoder_blocks[0].attention
        row = {
            "attention": label,
            "hidden_dim": width,
            "num_heads": heads,
            "key_dim": attention.key_dim,
            "feature_dim": attention.feature_dim,
            "state_bytes": state_bytes(backbone),
            "forward_ms": statistics.median(times),
        }
        log(row)
        rows.append(row)
    return rows


def to_markdown(rows, repeats):
    lines = [
        f"Backbone forward, 2 blocks, batch {BATCH} x {LENGTH} tokens, graph mode, median of {repeats}.",
        "",
        "| attention | width / heads | key dim D | feature dim C | state per sequence | forward ms |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['attention']} | {r['hidden_dim']} / {r['num_heads']} | {r['key_dim']} | {r['feature_dim']} "
            f"| {r['state_bytes'] / 1024:.1f} KiB | {r['forward_ms']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args(argv)
    rows = run(args.repeats)
    os.makedirs(args.out_dir, exist_ok=True)
    meta = {"python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count()}
    with open(os.path.join(args.out_dir, "defaults.json"), "w") as f:
        json.dump({"rows": rows, "repeats": args.repeats, "meta": meta}, f, indent=1)
    with open(os.path.join(args.out_dir, "defaults.md"), "w") as f:
        f.write(to_markdown(rows, args.repeats))
    print(to_markdown(rows, args.repeats))


if __name__ == "__main__":
    main()
