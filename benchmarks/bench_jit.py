"""Training step time with and without XLA (``model.compile(jit_compile=True/False)``).

A 2-layer model at N=1024: the causal `LinearCausalLM` (chunked causal path)
and a non-causal 2-layer `LinearTransformerEncoder` regressor, for each
feature map asked for. Each configuration is compiled, warmed up (the first
steps include tracing and XLA compilation, reported separately), then timed
step by step with `train_on_batch`; the table reports the median.

    python -m benchmarks.bench_jit                       # writes benchmarks/results/jit.{json,md}
    python -m benchmarks.bench_jit --feature-maps elu,oglu,favor+ --length 2048

Note: Keras' default ``jit_compile="auto"`` does not enable XLA on CPU-only
TensorFlow; the "XLA" rows pass ``jit_compile=True``.
"""

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_linattn import feature_maps  # noqa: E402
from keras_linattn.layers import LinearTransformerEncoder  # noqa: E402
from keras_linattn.models import LinearCausalLM  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def build_causal_lm(args, feature_map):
    model = LinearCausalLM(
        vocabulary_size=args.vocabulary_size,
        num_layers=2,
        hidden_dim=args.hidden_dim,
        num_heads=args.num_heads,
        intermediate_dim=2 * args.hidden_dim,
        feature_map=feature_maps.get(feature_map),
        conv_size=None,  # the figures on record are of this configuration, not of the package's default
        chunk_size=args.chunk_size,
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocabulary_size, size=(args.batch_size, args.length + 1)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, loss, tokens[:, :-1], tokens[:, 1:]


def build_encoder(args, feature_map):
    inp = keras.Input((args.length, args.hidden_dim))
    h = inp
    for _ in range(2):
        h = LinearTransformerEncoder(
            args.num_heads,
            2 * args.hidden_dim,
            feature_map=feature_maps.get(feature_map),
            conv_size=None,  # the figures on record are of this configuration, not of the package's default
            chunk_size=args.chunk_size,
        )(h)
    model = keras.Model(inp, keras.layers.Dense(1)(h))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch_size, args.length, args.hidden_dim)).astype("float32")
    y = rng.normal(size=(args.batch_size, args.length, 1)).astype("float32")
    return model, "mse", x, y


MODELS = {"causal_lm": build_causal_lm, "encoder": build_encoder}


def _compiled(build, args, feature_map, jit_compile):
    keras.utils.set_random_seed(0)
    model, loss, x, y = build(args, feature_map)
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss=loss, jit_compile=jit_compile)
    return model, x, y


def time_training(build, args, feature_map):
    """Times jit_compile=False and True on the same model, steps interleaved.

    Both variants are compiled and warmed up first (that time is reported
    separately); then the timed steps alternate False, True, False, True, ...
    so that both see the same background load on a shared machine.

    Returns:
        ``{jit_compile: (warm-up seconds, [step seconds])}``.
    """
    keras.utils.clear_session()
    models, warm = {}, {}
    for jit in (False, True):
        model, x, y = _compiled(build, args, feature_map, jit)
        start = time.perf_counter()
        for _ in range(args.warmup):
            model.train_on_batch(x, y)
        warm[jit] = time.perf_counter() - start
        models[jit] = (model, x, y)
    times = {False: [], True: []}
    for _ in range(args.steps):
        for jit in (False, True):
            model, x, y = models[jit]
            start = time.perf_counter()
            out = model.train_on_batch(x, y)
            float(np.asarray(out))  # the step has finished
            times[jit].append(time.perf_counter() - start)
    return {jit: (warm[jit], times[jit]) for jit in (False, True)}


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_jit",
        description="Per-step training time, jit_compile=True vs False, 2-layer models.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--models", default="causal_lm,encoder", help=f"comma-separated of {sorted(MODELS)}")
    parser.add_argument("--feature-maps", default="elu,oglu")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--hidden-dim", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--vocabulary-size", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps (tracing, compilation)")
    parser.add_argument("--steps", type=int, default=9, help="timed steps (median reported; >= 3)")
    parser.add_argument("--output-dir", default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps must be >= 3 for a median. Received: --steps={args.steps}")

    rows, records = [], []
    for model_name in args.models.split(","):
        build = MODELS[model_name]
        for fm in args.feature_maps.split(","):
            result = time_training(build, args, fm)
            for jit in (False, True):
                warm, times = result[jit]
                records.append(
                    {
                        "model": model_name,
                        "feature_map": fm,
                        "jit_compile": jit,
                        "warmup_seconds": warm,
                        "step_seconds": times,
                        "median_step_seconds": statistics.median(times),
                    }
                )
                print(
                    f"{model_name:9s} {fm:6s} jit_compile={jit!s:5s} first {args.warmup} steps {warm:6.2f} s, "
                    f"median step {statistics.median(times) * 1000:8.1f} ms  (all: "
                    f"{', '.join(f'{t * 1000:.0f}' for t in times)} ms)",
                    flush=True,
                )
            eager_med = statistics.median(result[False][1])
            xla_med = statistics.median(result[True][1])
            rows.append(
                [
                    model_name,
                    fm,
                    f"{eager_med * 1000:.1f}",
                    f"{xla_med * 1000:.1f}",
                    f"{eager_med / xla_med:.2f}x",
                    f"{result[False][0]:.1f}",
                    f"{result[True][0]:.1f}",
                ]
            )

    header = [
        "model",
        "feature map",
        "step, jit_compile=False (ms)",
        "step, jit_compile=True (ms)",
        "speed-up (False/True)",
        f"first {args.warmup} steps, no XLA (s)",
        f"first {args.warmup} steps, XLA (s)",
    ]
    table = "\n".join(
        ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]
    )
    setup = (
        f"2 layers, N={args.length}, batch {args.batch_size}, width {args.hidden_dim}, {args.num_heads} heads, "
        f"chunk {args.chunk_size}; median of {args.steps} timed steps after {args.warmup} untimed, "
        "jit/no-jit steps interleaved; "
        f"TF {tf.__version__}, Keras {keras.__version__}, {platform.machine()}, {os.cpu_count()} CPUs"
    )
    print("\n" + setup + "\n" + table)
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "jit.json"), "w") as f:
        json.dump({"setup": setup, "args": vars(args), "results": records}, f, indent=1)
    with open(os.path.join(args.output_dir, "jit.md"), "w") as f:
        f.write(f"# Training step time: jit_compile=True vs False\n\n{setup}\n\n{table}\n")
    return records


if __name__ == "__main__":
    main()
