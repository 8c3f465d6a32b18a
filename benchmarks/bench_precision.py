"""Weights' precision x {Keras, onnxruntime}: file size, decode ms/token at batch 1 beside the weights-read floor,
greedy tokens against float32.

    python -m benchmarks.bench_precision                       # width 768, 6 layers, vocabulary 16,384 (~55M)
    python -m benchmarks.bench_precision --layers 12 --vocabulary 50257 --out benchmarks/results/precision_gpt2.json
    python -m benchmarks.bench_precision --layers 2 --width 128 --vocabulary 512 --out /tmp/p.json   # a quick one
    python -m benchmarks.bench_precision --layers 16 --width 2048 --vocabulary 128256 --precisions float32 --out f.json
    python -m benchmarks.bench_precision --layers 16 --width 2048 --vocabulary 128256 --precisions int8 \
        --reference f.json --out i.json                                 # the 1B shape, one process a precision

One process (or one per precision with ``--reference``, where one process cannot hold them all). Each precision
(float32, bfloat16 by the `dtype=` policy, int8 by `Model.quantize`) is built from the same seed and exported to
ONNX; then the timings run interleaved, `--rounds` rounds of every precision in turn (Keras `generate`, then
`OnnxGenerator` on CPU; prompt of 8 tokens, 32 greedy tokens, prefill apart:
`benchmarks.device_check._decode_ms_per_token` with one run a length), and each figure is the median over the
rounds. The floor is the weights' bytes (what decode at batch 1 reads per token) over the memory bandwidth of a
large float32 matrix-vector product (`bench_linearized_decode.bandwidth_gib_s`, median of 3 before and 3 after
the timings). A bfloat16 model's ONNX graphs compute in float32 on its bfloat16 weights (`export._float_compute`):
onnxruntime folds the casts at session start, so its session holds and reads float32 weights (its floor is
float32's; its files are half). Random weights: greedy tokens are near ties, so the agreement with float32
measures the logits' perturbation, not a trained model's.
"""

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import numpy as np

from benchmarks.device_check import DECODE_PROMPT, _decode_ms_per_token

RUNTIMES = ("keras", "onnx")


def _lm(args, dtype):
    """The seeded model; a bfloat16 one holds the float32 model's weights rounded (initializers that draw in
    bfloat16 draw other values: the tokens' agreement would compare two different models)."""
    import keras

    if dtype is not None:
        lm = _lm(args, None)
        rounded = _lm_of(args, dtype)
        for target, source in zip(rounded.weights, lm.weights, strict=True):
            target.assign(keras.ops.cast(source, target.dtype))
        return rounded
    return _lm_of(args, None)


def _lm_of(args, dtype):
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


def _rss_bytes(field="VmRSS"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def setup_precision(args, precision, base, runtimes=RUNTIMES, fold_limit=None):
    """One precision's model, its export and its onnxruntime generator; the row's sizes.

    With ``runtimes`` ``("keras",)`` nothing is exported (generator None); with ``("onnx",)`` the Keras model is
    freed once exported (None), so that the process holds what onnxruntime serving holds. ``fold_limit``
    (bytes): onnxruntime folds no constant larger (a bfloat16 export's casts of its weights then run at each call,
    and its sessions hold the 2-byte weights only).
    """
    rss_before = _rss_bytes()
    lm = _lm(args, "bfloat16" if precision == "bfloat16" else None)
    if precision == "int8":
        lm.quantize("int8")
    weights = {id(w): w for w in lm.weights}.values()
    row = {
        "precision": precision,
        "parameters": int(sum(np.prod(w.shape) for w in weights)),
        "weight_bytes": int(sum(np.prod(w.shape) * np.dtype(str(w.dtype)).itemsize for w in weights)),
    }
    generator = None
    if "onnx" in runtimes:
        generator = _export(lm, precision, base, row, fold_limit)
    if "keras" not in runtimes:
        lm = None
        gc.collect()
    row["rss_after_setup_bytes"] = _rss_bytes()  # the process, with this and the earlier precisions loaded
    row["rss_added_bytes"] = row["rss_after_setup_bytes"] - rss_before  # this precision's model and session
    row["peak_rss_bytes"] = _rss_bytes("VmHWM")  # the process's peak so far (this and the earlier precisions)
    return row, lm, generator


def _export(lm, precision, base, row, fold_limit=None):
    """Exports `lm` to ONNX under `base` (its sizes into `row`); returns `OnnxGenerator` on the step graph."""
    from keras_linattn import export
    from keras_linattn.export import OnnxGenerator

    start = time.perf_counter()
    paths = export.export_onnx(lm, os.path.join(base, f"{precision}.onnx"))
    row["export_s"] = time.perf_counter() - start
    row["onnx_bytes"] = {k: os.path.getsize(p) for k, p in paths.items() if isinstance(p, str)}
    # Past 2 GB the weights go to one external data file beside the graphs, shared by the three.
    data = [n for n in os.listdir(base) if n.startswith(f"{precision}.onnx") and n.endswith(".data")]
    row["onnx_data_bytes"] = sum(os.path.getsize(os.path.join(base, n)) for n in data)
    if fold_limit is None:
        return OnnxGenerator(paths["step"], device="cpu")
    import onnxruntime as ort

    options = ort.SessionOptions()  # OnnxGenerator's float defaults, and the folding limit
    for key in ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning", "session.disable_prepacking"):
        options.add_session_config_entry(key, "1" if key.endswith("prepacking") else "0")
    options.add_session_config_entry("optimization.constant_folding_max_output_size_in_bytes", str(fold_limit))
    options.log_severity_level = 3  # one warning a constant left unfolded
    row["onnx_fold_limit_bytes"] = fold_limit
    return OnnxGenerator(paths["step"], device="cpu", session_options=options)


def time_round(lm, generator, prompt):
    """One round: ``{runtime: (ms/token, tokens)}`` for Keras (`lm`) and onnxruntime (`generator`), each if given."""
    out = {}
    for kind, model in (("keras", lm), ("onnx", generator)):
        if model is not None:
            ms, ids = _decode_ms_per_token(
                lambda p, n, m=model: np.asarray(m.generate(p, max_length=n, sampler="greedy")), prompt, repeats=1
            )
            out[kind] = (ms, ids[0, DECODE_PROMPT:].tolist())
    return out


def _reference_tokens(args):
    """The float32 Keras tokens of ``args.reference``, checked to be of this shape."""
    with open(args.reference) as f:
        previous = json.load(f)
    shape = {k: previous["shape"].get(k) for k in ("width", "layers", "vocabulary")}
    if shape != {"width": args.width, "layers": args.layers, "vocabulary": args.vocabulary}:
        raise ValueError(f"`--reference` is of another shape: {shape}. Received: reference={args.reference!r}")
    rows = [r for r in previous["rows"] if r["precision"] == "float32"]
    if not rows:
        raise ValueError(f"`--reference` has no float32 row. Received: reference={args.reference!r}")
    return rows[0]["keras_tokens"]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_precision", description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocabulary", type=int, default=16384)
    p.add_argument("--precisions", default="float32,bfloat16,int8", help="float32 first: the tokens' reference")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (the median is reported)")
    p.add_argument(
        "--reference",
        default=None,
        help="a float32 run's --out of the same shape: its Keras tokens are the reference (for precisions run in "
        "another process, where one process cannot hold them all)",
    )
    p.add_argument(
        "--runtimes",
        default=",".join(RUNTIMES),
        help="comma list of keras,onnx: with one, the process holds that runtime's model only (the 1B shape)",
    )
    p.add_argument(
        "--onnx-fold-limit",
        type=int,
        default=None,
        help="bytes: onnxruntime folds no larger constant (bfloat16 exports: sessions keep the 2-byte weights)",
    )
    p.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "precision.json")
    )
    args = p.parse_args(argv)
    runtimes = tuple(args.runtimes.split(","))
    if not runtimes or not set(runtimes) <= set(RUNTIMES):
        raise ValueError(f"`--runtimes` must be a comma list of {RUNTIMES}. Received: runtimes={args.runtimes!r}")
    given = None if args.reference is None else _reference_tokens(args)  # before any work: a wrong file fails fast
    if "keras" not in runtimes and given is None:
        raise ValueError("`--runtimes` without keras needs `--reference` (the float32 Keras tokens).")
    prompt = np.random.RandomState(1).randint(0, args.vocabulary, (1, DECODE_PROMPT)).astype("int32")
    from benchmarks.bench_linearized_decode import bandwidth_gib_s

    precisions = args.precisions.split(",")
    rows, models = [], []
    with tempfile.TemporaryDirectory() as base:
        for precision in precisions:
            row, lm, generator = setup_precision(args, precision, base, runtimes, args.onnx_fold_limit)
            rows.append(row)
            models.append((lm, generator))
            print(json.dumps(row), flush=True)
        bandwidths = [bandwidth_gib_s() for _ in range(3)]
        times = [{kind: [] for kind in runtimes} for _ in rows]
        for _ in range(args.rounds):
            for row, (lm, generator), timing in zip(rows, models, times, strict=True):
                for kind, (ms, tokens) in time_round(lm, generator, prompt).items():
                    timing[kind].append(ms)
                    row[f"{kind}_tokens"] = tokens
        bandwidths += [bandwidth_gib_s() for _ in range(3)]
    bandwidth = float(np.median(bandwidths))
    reference = rows[0].get("keras_tokens") if given is None else given
    for row, timing in zip(rows, times, strict=True):
        # onnxruntime folds a bfloat16 graph's casts at session start: its session reads float32 weights.
        # (With --onnx-fold-limit it reads the 2-byte weights and casts them at each call: their bytes are the floor.)
        folded = row["precision"] == "bfloat16" and args.onnx_fold_limit is None
        floor_bytes = row["parameters"] * 4 if folded else row["weight_bytes"]
        row["floor_ms_per_token"] = {
            "keras": 1000.0 * row["weight_bytes"] / (bandwidth * 2**30),
            "onnx": 1000.0 * floor_bytes / (bandwidth * 2**30),
        }
        for kind in runtimes:
            row[f"{kind}_ms_per_token"] = float(np.median(timing[kind]))
            row[f"{kind}_ms_per_token_all"] = [round(t, 2) for t in timing[kind]]
            row[f"{kind}_x_floor"] = row[f"{kind}_ms_per_token"] / row["floor_ms_per_token"][kind]
            row[f"{kind}_agreement_with_float32"] = float(np.mean(np.equal(row[f"{kind}_tokens"], reference)))
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("tokens")}), flush=True)
    args.bandwidth_gib_s = bandwidth
    args.bandwidth_gib_s_all = [round(b, 2) for b in bandwidths]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "shape": vars(args),
                "rows": rows,
                "command": " ".join(["python -m benchmarks.bench_precision", *sys.argv[1:]]),
            },
            f,
            indent=1,
        )
    print(f"[bench] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
