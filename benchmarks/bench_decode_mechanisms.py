"""Decoding cost per token vs context with the recall mechanisms on.

    python -m benchmarks.bench_decode_mechanisms                  # contexts 128 and 8192, every preset
    python -m benchmarks.bench_decode_mechanisms --contexts 128,1024,8192 --repeats 5

The model is `bench_decode`'s (2 layers, width 512, 8 heads of 64, batch 8,
float32, greedy), built with each preset of `PRESETS`. For each context the
prompt is prefilled with `call_with_state` in pieces (XLA), then `--tokens`
tokens are decoded with `LinearCausalLM.step` in one XLA-compiled
``while_loop`` (`bench_decode.ours_decoder`). Every preset's decoding is
compiled once, then timed in interleaved rounds (preset by preset, context
by context, `--repeats` rounds); the median is reported.

The target: per-token time at 8192 over 128 is at most 1.2 for every
preset (the decode state has a fixed size: `LinearAttention.state_spec`).
Outputs: ``<out-dir>/decode_mechanisms.{md,json}``.
"""

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from benchmarks.bench_decode import CONFIG, build_ours, ours_decoder, prefill_ours  # noqa: E402

PRESETS = {
    "plain": dict(),
    "scalar decay + conv4": dict(decay="scalar", conv_size=4),
    "channel decay + conv4": dict(decay="channel", conv_size=4),
    "conv4 + window64": dict(conv_size=4, window_size=64),
    "fixed decay without normalizer": dict(decay="fixed", normalize=False),
    "window64 + cache64 (LoLA)": dict(window_size=64, cache_size=64, linear_weight=0.001),
    "RoPE + window64": dict(window_size=64, rope_max_wavelength=10000),
    "RoPE + window64 + unrotated mean (length)": dict(
        window_size=64, rope_max_wavelength=10000, linear_rope=False, linear_mean=True, linear_weight=8.0
    ),
}
TARGET = 1.2


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="128,8192")
    p.add_argument("--presets", default=",".join(PRESETS), help="comma-separated among %s" % list(PRESETS))
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prefill-piece", type=int, default=1024)
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    presets = args.presets.split(",")
    unknown = [x for x in presets if x not in PRESETS]
    if unknown:
        p.error(f"unknown preset(s) {unknown}; choose among {list(PRESETS)}")

    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    setups = {}
    for name in presets:
        keras.utils.set_random_seed(0)
        model = build_ours(**PRESETS[name])
        decode = ours_decoder(model)
        states = {}
        for context in contexts:
            token, state, prefill_s = prefill_ours(model, args.batch, context, args.prefill_piece, rng)
            states[context] = (token, state, prefill_s)
        n = tf.constant(args.tokens)
        token, state, _ = states[contexts[0]]
        decode(token, state, n)[0].numpy()  # compile: one shape for every context
        setups[name] = (decode, states, n)
        print(f"[decode] {name}: prefilled {contexts}, compiled", flush=True)

    runs = {(name, c): [] for name in presets for c in contexts}
    for _ in range(args.repeats):
        for name in presets:
            decode, states, n = setups[name]
            for context in contexts:
                token, state, _ = states[context]
                start = time.perf_counter()
                decode(token, state, n)[0].numpy()
                runs[(name, context)].append(time.perf_counter() - start)

    rows = []
    for name in presets:
        row = {"preset": name, "mechanisms": PRESETS[name]}
        for context in contexts:
            row[f"ms_per_token_{context}"] = 1e3 * statistics.median(runs[(name, context)]) / args.tokens
            row[f"runs_s_{context}"] = runs[(name, context)]
            row[f"prefill_s_{context}"] = setups[name][1][context][2]
        row["ratio"] = row[f"ms_per_token_{max(contexts)}"] / row[f"ms_per_token_{min(contexts)}"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("runs")}), flush=True)

    meta = {
        "command": "python -m benchmarks.bench_decode_mechanisms " + " ".join(argv or []),
        "config": CONFIG,
        "batch": args.batch,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "tensorflow": tf.__version__,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "decode_mechanisms.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    lo, hi = min(contexts), max(contexts)
    lines = [
        "# Decoding per token with the recall mechanisms",
        "",
        f"`{meta['command'].strip()}` on {meta['machine']}; batch {args.batch}, {args.tokens} tokens per call, "
        f"median of {args.repeats} interleaved rounds. Model: {CONFIG}.",
        "",
        "| preset | " + " | ".join(f"ms/token at {c}" for c in contexts) + f" | {hi} / {lo} | target <= {TARGET} |",
        "|---|" + "---|" * (len(contexts) + 2),
    ]
    for row in rows:
        cells = " | ".join(f"{row[f'ms_per_token_{c}']:.2f}" for c in contexts)
        met = "met" if row["ratio"] <= TARGET else "MISSED"
        lines.append(f"| {row['preset']} | {cells} | {row['ratio']:.2f} | {met} |")
    with open(os.path.join(args.out_dir, "decode_mechanisms.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
