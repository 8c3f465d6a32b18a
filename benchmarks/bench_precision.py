"""Weights' precision x {Keras, onnxruntime}: file size, decode ms/token at batch 1, greedy tokens against float32.

    python -m benchmarks.bench_precision                       # width 768, 6 layers, vocabulary 16,384 (~55M)
    python -m benchmarks.bench_precision --layers 2 --width 128 --vocabulary 512 --out /tmp/p.json   # a quick one

One process, the precisions in turn (float32, bfloat16, int8 by `Model.quantize`), each from the same seed:
Keras `generate` and `OnnxGenerator` (CPU), prompt of 8 tokens, 32 greedy tokens, the fastest of 3 runs per
length (`benchmarks.device_check._decode_ms_per_token`). bfloat16 is not exported to ONNX: tf2onnx's Gemm
rewriter binds float16 and bfloat16 in one node, which onnxruntime refuses to load. Random weights: greedy
tokens are near ties, so the agreement with float32 measures the logits' perturbation, not a trained model's.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from benchmarks.device_check import DECODE_PROMPT, _decode_ms_per_token


def _lm(args, dtype):
    import keras

    from keras_linattn.models import LinearBackbone, LinearCausalLM

    keras.utils.set_random_seed(0)
    backbone = LinearBackbone(
        vocabulary_size=args.vocabulary,
        num_layers=args.layers,
        hidden_dim=args.width,
        num_heads=args.width // 64,
        intermediate_dim=4 * args.width,
        activation="gelu_approximate",
        feature_map="elu",  # the figures on record are of this configuration, not of the package's default
        conv_size=None,
        dtype=dtype,
    )
    return LinearCausalLM(backbone=backbone, preprocessor=None)


def run_precision(args, precision, prompt, base):
    """One precision's row: parameters, file bytes, ms/token and tokens (Keras and onnxruntime)."""
    from keras_linattn import export
    from keras_linattn.export import OnnxGenerator

    lm = _lm(args, "bfloat16" if precision == "bfloat16" else None)
    if precision == "int8":
        lm.quantize("int8")
    row = {"precision": precision, "parameters": int(sum(np.prod(w.shape) for w in lm.weights))}
    row["keras_ms_per_token"], ids = _decode_ms_per_token(
        lambda p, n: np.asarray(lm.generate(p, max_length=n, sampler="greedy")), prompt
    )
    row["keras_tokens"] = ids[0, DECODE_PROMPT:].tolist()
    if precision == "bfloat16":
        return row
    start = time.perf_counter()
    paths = export.export_onnx(lm, os.path.join(base, f"{precision}.onnx"))
    row["export_s"] = time.perf_counter() - start
    row["onnx_bytes"] = {k: os.path.getsize(p) for k, p in paths.items() if isinstance(p, str)}
    generator = OnnxGenerator(paths["step"], device="cpu")
    row["onnx_ms_per_token"], ids = _decode_ms_per_token(
        lambda p, n: np.asarray(generator.generate(p, max_length=n, sampler="greedy")), prompt
    )
    row["onnx_tokens"] = ids[0, DECODE_PROMPT:].tolist()
    return row


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_precision", description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocabulary", type=int, default=16384)
    p.add_argument("--precisions", default="float32,bfloat16,int8")
    p.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "precision.json")
    )
    args = p.parse_args(argv)
    prompt = np.random.RandomState(1).randint(0, args.vocabulary, (1, DECODE_PROMPT)).astype("int32")
    rows = []
    with tempfile.TemporaryDirectory() as base:
        for precision in args.precisions.split(","):
            rows.append(run_precision(args, precision, prompt, base))
            print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("tokens")}), flush=True)
    reference = rows[0]["keras_tokens"]
    for row in rows:
        for kind in ("keras", "onnx"):
            if f"{kind}_tokens" in row:
                row[f"{kind}_agreement_with_float32"] = float(np.mean(np.equal(row[f"{kind}_tokens"], reference)))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"shape": vars(args), "rows": rows}, f, indent=1)
    print(f"[bench] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
