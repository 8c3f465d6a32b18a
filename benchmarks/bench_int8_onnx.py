"""int8 decode in onnxruntime, with and without a fused rescale and repacked weights, beside its floor.

    python -m benchmarks.bench_int8_onnx --layers 2 --width 768 --vocabulary 8192 --rounds 7 \
        --out benchmarks/results/int8_onnx_w768_l2.json

One process, one int8 model (`benchmarks.bench_precision`'s, `Model.quantize("int8")`), exported twice: its
integer products rescaled by ``Div`` as tf2onnx writes them (``unfused``: `export_onnx` as it is), and rewritten
to the pattern onnxruntime fuses into ``MatMulIntegerToFloat`` (``fused``: `benchmarks._int8_fusion`). Each
export is decoded by `OnnxGenerator` (greedy, batch 1, prompt of 8, 32 tokens, prefill apart:
`benchmarks.device_check._decode_ms_per_token`) with onnxruntime's weight prepacking off
(``session.disable_prepacking``: the generator's default for every export until int8 ones turned it on) and on.
The four variants run interleaved, `--rounds` rounds; each figure is the median over the rounds. The floor is
the int8 model's weight bytes over the memory bandwidth of a large float32 matrix-vector product
(`bench_linearized_decode.bandwidth_gib_s`, median of 3 before and 3 after the timings), as in
`bench_precision`. Tokens are compared with Keras' `generate` of the same model.
"""

import argparse
import json
import os
import sys
import tempfile

import numpy as np

from benchmarks import _int8_fusion
from benchmarks.bench_precision import _lm, _rss_bytes
from benchmarks.device_check import DECODE_PROMPT, _decode_ms_per_token

VARIANTS = (("unfused", False), ("unfused", True), ("fused", False), ("fused", True))


def _export(lm, path, fused):
    """The int8 export, its products' rescale rewritten to onnxruntime's fusion pattern where ``fused``."""
    from keras_linattn import export
    from keras_linattn.export import _onnx_graph

    unsigned = _onnx_graph._unsigned_int8_products

    def unsigned_and_fused(graph):
        changed = unsigned(graph)
        _int8_fusion.integer_to_float_products(graph)
        return changed

    if fused:  # the conversion's last rewrite, then the fusion pattern (it needs the uint8 activations)
        _onnx_graph._unsigned_int8_products = unsigned_and_fused
    try:
        return export.export_onnx(lm, path)
    finally:
        _onnx_graph._unsigned_int8_products = unsigned


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_int8_onnx", description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocabulary", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (the median is reported)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "int8.json"))
    args = p.parse_args(argv)
    from benchmarks.bench_linearized_decode import bandwidth_gib_s
    from keras_linattn.export import OnnxGenerator

    prompt = np.random.RandomState(1).randint(0, args.vocabulary, (1, DECODE_PROMPT)).astype("int32")
    lm = _lm(args, None)
    lm.quantize("int8")
    weights = {id(w): w for w in lm.weights}.values()
    weight_bytes = int(sum(np.prod(w.shape) * np.dtype(str(w.dtype)).itemsize for w in weights))
    keras_tokens = np.asarray(lm.generate(prompt, max_length=DECODE_PROMPT + 32, sampler="greedy"))[0]
    rows = []
    with tempfile.TemporaryDirectory() as base:
        paths = {
            kind: _export(lm, os.path.join(base, kind, "int8.onnx"), kind == "fused") for kind in ("unfused", "fused")
        }
        generators = [OnnxGenerator(paths[kind]["step"], device="cpu", prepacking=pack) for kind, pack in VARIANTS]
        rows = [{"graph": kind, "prepacking": pack, "ms_per_token_all": []} for kind, pack in VARIANTS]
        bandwidths = [bandwidth_gib_s() for _ in range(3)]
        for _ in range(args.rounds):
            for row, generator in zip(rows, generators, strict=True):
                ms, ids = _decode_ms_per_token(
                    lambda q, n, g=generator: np.asarray(g.generate(q, max_length=n, sampler="greedy")), prompt, 1
                )
                row["ms_per_token_all"].append(round(ms, 3))
                row["tokens_equal_keras"] = int(np.sum(ids[0, DECODE_PROMPT:] == keras_tokens[DECODE_PROMPT:]))
        bandwidths += [bandwidth_gib_s() for _ in range(3)]
        rss = _rss_bytes()
    bandwidth = float(np.median(bandwidths))
    floor_ms = 1000.0 * weight_bytes / (bandwidth * 2**30)
    for row in rows:
        row["ms_per_token"] = float(np.median(row["ms_per_token_all"]))
        row["x_floor"] = row["ms_per_token"] / floor_ms
        print(json.dumps(row), flush=True)
    result = {
        "shape": vars(args),
        "weight_bytes": weight_bytes,
        "bandwidth_gib_s": bandwidth,
        "bandwidth_gib_s_all": [round(b, 2) for b in bandwidths],
        "floor_ms_per_token": floor_ms,
        "rss_bytes": rss,
        "rows": rows,
        "command": " ".join(["python -m benchmarks.bench_int8_onnx"] + sys.argv[1:]),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"[bench] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
