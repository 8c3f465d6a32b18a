"""The short convolution's two methods, in graph mode and under XLA, forward + backward.

    python -m benchmarks.bench_short_conv                        # the two shapes below, median of 15
    python -m benchmarks.bench_short_conv --shapes 16x128x384 --repeats 5

`keras_linattn.ops.causal_conv` computes the causal depthwise convolution
either with one `ops.depthwise_conv` ("depthwise") or as K shifted
multiply-adds ("shifted"); ``method="auto"`` takes the shifted sum where XLA
compiles the graph and the depthwise kernel elsewhere. This script times
both methods, each in a plain `tf.function` and in one with
``jit_compile=True``: the input ``[B, T, X]`` (X = the channels of q, k and
v together), kernel size 4, the gradient of a weighted sum with respect to
the input and the kernel. Every variant is compiled once, then timed in
interleaved rounds; the median is reported, with each variant's time over
the auto choice's in its mode.

Shapes: ``16x128x384`` is the character LM of `bench_quality --task lm`
(batch 16, 128 tokens, 4 heads x 32 for q, k and v), ``1x8192x1536`` the
N=8192 layer of `bench_attention` (8 heads x 64, three times).
Outputs: ``<out-dir>/short_conv.{md,json}``.
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

METHODS = ("depthwise", "shifted")
MODES = ("graph", "xla")


def parse_shape(text):
    b, t, x = (int(v) for v in text.lower().split("x"))
    return b, t, x


def make_step(method, mode, kernel):
    import tensorflow as tf

    from keras_linattn.ops import causal_conv

    def step(x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = causal_conv(x, kernel, method=method)  # [B, T, X]
            loss = tf.reduce_sum(y * dy)
        return tape.gradient(loss, [x, kernel])

    return tf.function(step, jit_compile=mode == "xla")


def run(shapes, repeats, size=4, log=print):
    import tensorflow as tf

    rows = []
    for b, t, width in shapes:
        g = tf.random.Generator.from_seed(0)
        x = g.normal((b, t, width))  # [B, T, X]
        dy = g.normal((b, t, width))  # [B, T, X]
        kernel = tf.Variable(g.normal((size, width)))  # [K, X]
        steps = {(m, mode): make_step(m, mode, kernel) for m in METHODS for mode in MODES}
        for fn in steps.values():  # compile
            fn(x, dy)
        times = {key: [] for key in steps}
        for _ in range(repeats):
            for key, fn in steps.items():
                start = time.perf_counter()
                grads = fn(x, dy)
                grads[0].numpy()
                times[key].append(time.perf_counter() - start)
        medians = {key: statistics.median(v) for key, v in times.items()}
        for mode in MODES:
            auto = medians[("shifted" if mode == "xla" else "depthwise", mode)]
            for m in METHODS:
                row = {
                    "shape": [b, t, width],
                    "method": m,
                    "mode": mode,
                    "median_s": medians[(m, mode)],
                    "over_auto": medians[(m, mode)] / auto,
                    "repeats": repeats,
                }
                rows.append(row)
                log(
                    f"B={b} T={t} X={width} {mode:5s} {m:9s} {1000 * row['median_s']:8.2f} ms "
                    f"({row['over_auto']:.2f}x the auto choice)"
                )
    return rows


def render_markdown(rows, command):
    lines = [
        "# Short convolution: depthwise kernel vs shifted sum, graph vs XLA",
        "",
        f"Command: `{command}`",
        "",
        f"Environment: {platform.machine()}, {os.cpu_count()} CPUs; forward + backward, kernel size 4, "
        f"median of {rows[0]['repeats'] if rows else 0} interleaved rounds.",
        "",
        "| shape B x T x X | mode | method | median ms | over the auto choice |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        b, t, x = r["shape"]
        lines.append(
            f"| {b} x {t} x {x} | {r['mode']} | {r['method']} | {1000 * r['median_s']:.2f} | {r['over_auto']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="16x128x384,1x8192x1536", help="comma-separated BxTxX")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--prefix", default="short_conv")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    shapes = [parse_shape(s) for s in args.shapes.split(",") if s]
    command = "python -m benchmarks.bench_short_conv " + " ".join(sys.argv[1:] if argv is None else argv)
    rows = run(shapes, args.repeats)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, args.prefix + ".md"), "w") as f:
        f.write(render_markdown(rows, command.strip()))
    with open(os.path.join(args.out_dir, args.prefix + ".json"), "w") as f:
        json.dump({"command": command.strip(), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
