"""The device check: the figures a lent GPU should produce, in one run and one results JSON.

    python -m benchmarks.device_check                  # on a GPU: the real shapes (about 8 minutes)
    python -m benchmarks.device_check --dry-run        # every stage at tiny shapes, on CPU (< 2 minutes)
    make device-check [DRY_RUN=1] [ARGS="--stages fit,onnx"]

Stages (each recorded in the JSON, an exception as its ``error``, the others still run):

    fit        `LinearCausalLM.fit` tokens/s, XLA (``jit_compile=True``), mixed precision
               (``mixed_float16`` on a GPU, ``mixed_bfloat16`` on a CPU), at GPT-2 base (width 768,
               12 layers, 1,024 tokens, batch 8)
    attention  `benchmarks.bench_attention` (XLA, time only) beside Model Garden's KernelAttention and softmax
               MultiHeadAttention at N = 8k-64k; Model Garden is skipped (and said so) where it is not installed
    onnx       GPT-2 base exported in float16 and int8 (`Model.quantize`): onnxruntime's CUDA provider
               (CPU on a dry run): logits against Keras within the error model's bound, and decode ms/token at
               batch 1 (prefill apart) in Keras and
               through `OnnxGenerator`, with the greedy tokens' agreement
    jax        the fit stage again under ``KERAS_BACKEND=jax`` (a child process: the backend is chosen at import)

The JSON names the device (GPU name from TensorFlow, else the CPU) and the shapes of each stage.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback

STAGES = ("fit", "attention", "onnx", "jax")
GPT2_BASE = dict(vocabulary_size=50257, num_layers=12, hidden_dim=768, num_heads=12, intermediate_dim=3072)
TINY = dict(vocabulary_size=256, num_layers=1, hidden_dim=64, num_heads=4, intermediate_dim=128)
REAL = dict(model=GPT2_BASE, fit_batch=8, fit_length=1024, fit_steps=5, attention_ns=(8192, 16384, 32768, 65536))
DRY = dict(model=TINY, fit_batch=2, fit_length=64, fit_steps=2, attention_ns=(256,))
DECODE_PROMPT, DECODE_TOKENS = 8, 32


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.device_check", description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU: every stage runs, in < 2 minutes")
    p.add_argument("--stages", default=",".join(STAGES), help="comma-separated among %(default)s")
    p.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/device_check[_dry].json)")
    p.add_argument("--child-fit", default=None, help=argparse.SUPPRESS)  # the JAX stage's child: its JSON out
    args = p.parse_args(argv)
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        p.error(f"unknown stage(s) {unknown}; choose among {list(STAGES)}")
    if args.out is None:
        name = "device_check_dry.json" if args.dry_run else "device_check.json"
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
    return args


def describe_device():
    """``{"name", "kind", ...}``: the first GPU TensorFlow sees, else the CPU."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        details = tf.config.experimental.get_device_details(gpus[0])
        return {"kind": "GPU", "name": details.get("device_name", gpus[0].name), "count": len(gpus), **details}
    return {"kind": "CPU", "name": platform.processor() or platform.machine(), "cores": os.cpu_count()}


def _lm(shape, dtype=None):
    import keras

    from keras_linattn.models import LinearBackbone, LinearCausalLM

    keras.utils.set_random_seed(0)
    # elu without a convolution: the figures on record are of this configuration, not of the package's default.
    backbone = LinearBackbone(**shape, activation="gelu_approximate", feature_map="elu", conv_size=None, dtype=dtype)
    return LinearCausalLM(backbone=backbone, preprocessor=None)


def stage_fit(plan, gpu):
    """Tokens/s of `fit` (XLA, mixed precision) after one warm-up epoch."""
    import keras
    import numpy as np

    policy = "mixed_float16" if gpu else "mixed_bfloat16"
    keras.config.set_dtype_policy(policy)
    try:
        lm = _lm(plan["model"])
        lm.compile(optimizer=keras.optimizers.AdamW(1e-4), jit_compile=True)
        b, t, steps = plan["fit_batch"], plan["fit_length"], plan["fit_steps"]
        ids = np.random.RandomState(0).randint(0, plan["model"]["vocabulary_size"], (b * steps, t + 1))
        x = {"token_ids": ids[:, :-1].astype("int32"), "padding_mask": np.ones((b * steps, t), "int32")}
        y = ids[:, 1:].astype("int32")
        lm.fit(x, y, batch_size=b, epochs=1, verbose=0)  # trace + compile
        start = time.perf_counter()
        history = lm.fit(x, y, batch_size=b, epochs=1, verbose=0)
        seconds = time.perf_counter() - start
    finally:
        keras.config.set_dtype_policy("float32")
    return {
        "backend": keras.backend.backend(),
        "policy": policy,
        "batch": b,
        "length": t,
        "steps": steps,
        "seconds": seconds,
        "tokens_per_s": b * t * steps / seconds,
        "loss": float(history.history["loss"][-1]),
    }


def stage_attention(plan, gpu):
    """`bench_attention` at the plan's lengths, XLA, time only: ours beside Model Garden and softmax."""
    from benchmarks import bench_attention

    impls = "linear,linear_causal,kernel_attention,mha"
    ns = ",".join(str(n) for n in plan["attention_ns"])
    argv = ["--jit", "--no-memory", "--no-download", "--no-plot", "--ns", ns, "--impls", impls, "--repeats", "2"]
    args = bench_attention.parse_args(argv)
    results = bench_attention.run_benchmark(args, log=lambda *a, **k: None)
    return {"ns": list(plan["attention_ns"]), "impls": impls.split(","), "results": results}


def _decode_ms_per_token(generate, prompt, repeats=3):
    """ms per generated token at batch 1, prefill apart: (time to P + N tokens - time to P + 1) / (N - 1).

    Each length is traced first (a new `max_length` may retrace), then timed `repeats` times; the fastest
    of each is taken (on a shared machine the others measure the neighbours).
    """

    def fastest(length):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            tokens = generate(prompt, length)
            times.append(time.perf_counter() - start)
        return min(times), tokens

    generate(prompt, DECODE_PROMPT + 1)
    generate(prompt, DECODE_PROMPT + DECODE_TOKENS)
    one, _ = fastest(DECODE_PROMPT + 1)
    many, tokens = fastest(DECODE_PROMPT + DECODE_TOKENS)
    return 1000.0 * (many - one) / (DECODE_TOKENS - 1), tokens


def _parity(lm, model_path, precision, device, vocabulary_size):
    """onnxruntime's logits against Keras' on one batch, with the error model's bound (None where vacuous)."""
    import numpy as np

    from keras_linattn import _tolerance
    from keras_linattn.export import _verify_bounds
    from keras_linattn.export.onnx_predictor import OnnxPredictor

    ids = np.random.RandomState(2).randint(0, vocabulary_size, (2, 16)).astype("int32")
    expected = np.asarray(lm(ids), np.float64)
    got = np.asarray(OnnxPredictor(model_path, device=device).predict({"token_ids": ids})["logits"], np.float64)
    rel = float(np.abs(got - expected).max() / np.abs(expected).max())
    n = _verify_bounds._reduction_length(lm, ids.shape[1])
    eps = _tolerance.eps("float16" if precision == "float16" else "float32")
    bound = 2 * _tolerance.C_ROUND * eps * n**0.5  # paths=2, conditioning 1 (elu features are positive)
    bound += _verify_bounds.quantized_term(bound, *_verify_bounds.quantized_reduction(lm))
    bound = None if bound >= _tolerance.VACUOUS else bound
    return {"max_rel": rel, "bound": bound, "ok": None if bound is None else rel <= bound}


def _onnx_precision(plan, precision, device, base):
    import numpy as np

    from keras_linattn import export
    from keras_linattn.export import OnnxGenerator

    lm = _lm(plan["model"], dtype="float16" if precision == "float16" else None)
    if precision == "int8":
        lm.quantize("int8")
    start = time.perf_counter()
    paths = export.export_onnx(lm, os.path.join(base, f"{precision}.onnx"))
    export_s = time.perf_counter() - start
    vocabulary_size = plan["model"]["vocabulary_size"]
    parity = _parity(lm, paths["model"], precision, device, vocabulary_size)
    prompt = np.random.RandomState(1).randint(0, vocabulary_size, (1, DECODE_PROMPT)).astype("int32")
    keras_ms, keras_ids = _decode_ms_per_token(
        lambda p, n: np.asarray(lm.generate(p, max_length=n, sampler="greedy")), prompt
    )
    generator = OnnxGenerator(paths["step"], device=device)
    onnx_ms, onnx_ids = _decode_ms_per_token(
        lambda p, n: np.asarray(generator.generate(p, max_length=n, sampler="greedy")), prompt
    )
    files = [p for p in paths.values() if isinstance(p, str)]
    return {
        "export_s": export_s,
        "file_bytes": sum(os.path.getsize(p) for p in files),
        "parity": parity,
        "keras_ms_per_token": keras_ms,
        "onnx_ms_per_token": onnx_ms,
        "tokens_agree": float(np.mean(np.asarray(keras_ids) == np.asarray(onnx_ids))),
    }


def stage_onnx(plan, gpu):
    """float16 and int8 exports: onnxruntime (CUDA on a GPU) against Keras, and decode ms/token."""
    device = "cuda" if gpu else "cpu"
    out = {"device": device, "prompt": DECODE_PROMPT, "tokens": DECODE_TOKENS}
    with tempfile.TemporaryDirectory() as base:
        for precision in ("float16", "int8"):
            try:
                out[precision] = _onnx_precision(plan, precision, device, base)
            except Exception as e:  # one precision's failure must not hide the other's figures
                out[precision] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    return out


def start_jax(args, base):
    """Starts the fit stage in a child process under ``KERAS_BACKEND=jax`` (it runs beside the other stages)."""
    out = os.path.join(base, "jax_fit.json")
    argv = [sys.executable, "-m", "benchmarks.device_check", "--child-fit", out]
    if args.dry_run:
        argv.append("--dry-run")
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out


def finish_jax(child):
    """The JAX child's fit figures (waits for it)."""
    process, out = child
    _, stderr = process.communicate(timeout=1200)
    if process.returncode != 0:
        raise RuntimeError(f"the JAX child exited {process.returncode}: {stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)


def _errors(value):
    """The ``error`` entries of a stage's result and of its parts (the onnx stage's precisions)."""
    found = [value["error"]] if "error" in value else []
    return found + [part["error"] for part in value.values() if isinstance(part, dict) and "error" in part]


def run(args):
    """Runs the stages; returns the results dict (also written to ``args.out``)."""
    plan = DRY if args.dry_run else REAL
    device = describe_device()
    gpu = device["kind"] == "GPU" and not args.dry_run
    results = {"device": device, "dry_run": bool(args.dry_run), "plan": plan, "stages": {}}
    with tempfile.TemporaryDirectory() as base:
        # The JAX stage is a child process: on a dry run it overlaps the others (they wait on one core each).
        child = start_jax(args, base) if "jax" in args.stages else None
        for stage in args.stages:
            start = time.perf_counter()
            try:
                if stage == "jax":
                    value = finish_jax(child)
                else:
                    value = {"fit": stage_fit, "attention": stage_attention, "onnx": stage_onnx}[stage](plan, gpu)
                value = {"ok": not _errors(value), **value}
            except Exception as e:
                value = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            value["wall_s"] = time.perf_counter() - start
            results["stages"][stage] = value
            status = "ok" if value["ok"] else "FAILED: " + "; ".join(_errors(value))
            print(f"[device-check] {stage}: {status} ({value['wall_s']:.0f} s)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"[device-check] wrote {args.out} (device: {device['name']})")
    return results


def main(argv=None):
    args = parse_args(argv)
    if args.child_fit:
        value = stage_fit(DRY if args.dry_run else REAL, describe_device()["kind"] == "GPU" and not args.dry_run)
        with open(args.child_fit, "w") as f:
            json.dump(value, f)
        return 0
    results = run(args)
    return 0 if all(stage["ok"] for stage in results["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
