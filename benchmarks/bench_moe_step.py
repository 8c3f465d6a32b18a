"""One decode step of `MixtureOfExperts`: the gathered top-k experts (the step form) beside every expert computed.

At batch 1 a decode step is bound by the weights it reads. The step form
(``step=True``) gathers the `top_k` picked experts' kernels; the sequence
form computes every expert and zeroes the ones not picked. Both are
compiled with ``tf.function`` (no XLA) and timed interleaved, median of
`--repeats` calls after a warm-up.

    python -m benchmarks.bench_moe_step                         # Mixtral-8x7B's layer at width 1024
    python -m benchmarks.bench_moe_step --hidden 4096 --expert-dim 14336   # the published width (1.4 GB)
    python -m benchmarks.bench_moe_step --precision int8        # expert kernels int8 (`quantize("int8")`)
"""

import argparse
import time

import keras
import numpy as np
import tensorflow as tf

from keras_linattn.layers import MixtureOfExperts


def _time(fn, x, repeats):
    """Median seconds of ``fn(x)`` over `repeats` calls (after two warm-up calls)."""
    for _ in range(2):
        fn(x).numpy()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x).numpy()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv=None):
    """Prints ms per step of both forms and the weight bytes each reads."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expert-dim", type=int, default=3584)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--precision", choices=("float32", "int8"), default="float32", help="the expert kernels'")
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(0)
    moe = MixtureOfExperts(args.experts, args.top_k, args.expert_dim)
    moe.build((None, args.hidden))
    if args.precision == "int8":
        moe.quantize("int8")  # int8 expert kernels, int8 products in both forms; the router stays float
    x = tf.random.normal((args.batch, args.hidden))  # [B, dim]: one token per row
    picked = tf.function(lambda v: moe(v, step=True))
    every = tf.function(lambda v: moe(v, step=False))
    np.testing.assert_allclose(picked(x).numpy(), every(x).numpy(), rtol=1e-4, atol=1e-5)
    per_expert = 3 * args.hidden * args.expert_dim * (1 if args.precision == "int8" else 4)  # gate, up, down
    results = {}
    for _ in range(3):  # interleaved rounds: a noisy machine shifts both alike
        for name, fn in (("gathered top-k", picked), ("every expert", every)):
            results.setdefault(name, []).append(_time(fn, x, args.repeats))
    for name, reads in (("gathered top-k", args.batch * args.top_k), ("every expert", args.experts)):
        ms = 1e3 * min(results[name])
        mib = min(reads, args.experts) * per_expert / 2**20
        print(f"{name:>15}: {ms:8.3f} ms/step  (expert weights read: {mib:.1f} MiB)")


if __name__ == "__main__":
    main()
