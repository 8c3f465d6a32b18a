"""Serving latency of the exports: onnxruntime vs SavedModel (TF Serving path).

    python -m benchmarks.bench_export              # full run, writes benchmarks/results/export.{json,md}
    python -m benchmarks.bench_export --quick      # tiny shapes, smoke test

Encoder: a functional model of 2 `LinearTransformerEncoder` blocks (width
256, 4 heads, feed-forward 512, elu features) on float32 inputs
``[B, N, 256]``; latency of one forward pass at (B=1, N=1024) and (B=8,
N=4096), median of `--repeats` timed runs after one warm-up run; the
backends' runs are interleaved so that they share the machine's load.

- SavedModel: `SavedModelRunner`, the TF1 loader + Session path that
  `tensorflow_model_server` executes (feed/fetch of the `serving_default`
  signature tensors), without the network.
- onnxruntime: `OnnxPredictor` on the CPU provider (CUDA when present),
  with its default of no spin-waiting worker threads; also reported with
  ``allow_spinning=True`` (onnxruntime's own default), which is much slower
  when the cores are shared with other processes.

Decoding: a 2-layer `LinearCausalLM` (width 256, 4 heads, vocabulary 1000),
batch 1: tokens/s of the SavedModel `step` signature vs the ONNX step graph,
each driven from Python with the state passed in and out (`--decode-steps`
tokens per timed run).
"""

import argparse
import json
import os
import platform
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_linattn as kla  # noqa: E402
from keras_linattn import export  # noqa: E402
from keras_linattn.export.verify import differences  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def build_encoder(width, heads, ffn, layers=2, feature_map="elu"):
    keras.utils.set_random_seed(0)
    inp = keras.Input((None, width), name="features")
    x = inp
    for i in range(layers):
        x = kla.layers.LinearTransformerEncoder(
            num_heads=heads, intermediate_dim=ffn, feature_map=feature_map, conv_size=None, name=f"block_{i}"
        )(x)
    return keras.Model(inp, x, name="encoder")


def build_lm(width, heads, vocab, layers=2):
    keras.utils.set_random_seed(0)
    return kla.models.LinearCausalLM(
        vocabulary_size=vocab,
        num_layers=layers,
        hidden_dim=width,
        num_heads=heads,
        intermediate_dim=2 * width,
        feature_map="elu",  # the figures on record are of this configuration, not of the package's default
        conv_size=None,
    )


def timed(fns, repeats):
    """Median seconds of each named callable, runs interleaved.

    One warm-up call each, then `repeats` rounds that call every function
    once in turn, so that all of them see the same (shared, noisy) machine.
    """
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: (float(np.median(t)), [round(v, 5) for v in t]) for name, t in times.items()}


def bench_encoder(workdir, shapes, repeats, width, heads, ffn):
    model = build_encoder(width, heads, ffn)
    t = time.perf_counter()
    version_dir = export.export_saved_model(model, os.path.join(workdir, "encoder"), warmup=False)
    sm_export_s = time.perf_counter() - t
    t = time.perf_counter()
    onnx_path = export.export_onnx(model, os.path.join(workdir, "encoder.onnx"))["model"]
    onnx_export_s = time.perf_counter() - t
    runner = export.SavedModelRunner(version_dir)
    predictor = export.OnnxPredictor(onnx_path)
    spinning = export.OnnxPredictor(onnx_path, allow_spinning=True)
    rows = []
    rng = np.random.default_rng(0)
    for batch, length in shapes:
        x = rng.standard_normal((batch, length, width)).astype("float32")
        ref = model(x).numpy()
        sm_out = runner.run("serving_default", {"features": x})
        onnx_out = predictor({"features": x})
        (sm_name,) = sm_out
        timings = timed(
            {
                "saved_model": lambda x=x: runner.run("serving_default", {"features": x}),
                "onnxruntime": lambda x=x: predictor({"features": x}),
                "spinning": lambda x=x: spinning({"features": x}),
            },
            repeats,
        )
        (sm_med, sm_all), (ort_med, ort_all), (spin_med, spin_all) = (
            timings["saved_model"],
            timings["onnxruntime"],
            timings["spinning"],
        )
        rows.append(
            {
                "batch": batch,
                "length": length,
                "saved_model_s": sm_med,
                "onnxruntime_s": ort_med,
                "speedup": sm_med / ort_med,
                "saved_model_runs": sm_all,
                "onnxruntime_runs": ort_all,
                "onnxruntime_spinning_s": spin_med,
                "onnxruntime_spinning_runs": spin_all,
                "saved_model_max_rel_err": differences(sm_out[sm_name], ref)[1],
                "onnx_max_rel_err": differences(onnx_out[sm_name], ref)[1],
            }
        )
        print(
            f"encoder B={batch} N={length}: SavedModel {sm_med * 1e3:.1f} ms, onnxruntime {ort_med * 1e3:.1f} ms, "
            f"onnxruntime with spinning threads {spin_med * 1e3:.1f} ms ({predictor.provider})",
            flush=True,
        )
    runner.close()
    return {
        "provider": predictor.provider,
        "saved_model_export_s": sm_export_s,
        "onnx_export_s": onnx_export_s,
        "rows": rows,
    }


def bench_decode(workdir, steps, repeats, width, heads, vocab):
    model = build_lm(width, heads, vocab)
    version_dir = export.export_saved_model(model, os.path.join(workdir, "lm"), warmup=False, include_generate=False)
    paths = export.export_onnx(model, os.path.join(workdir, "lm.onnx"))
    runner = export.SavedModelRunner(version_dir)
    generator = export.OnnxGenerator(paths["step"])
    tokens = np.random.default_rng(0).integers(0, vocab, size=(1, steps)).astype("int32")
    num_states = generator.num_states

    def saved_model_decode():
        state = [np.asarray(s) for s in model.get_initial_state(1)]
        for t in range(steps):
            feeds = {"token_t": tokens[:, t]}
            feeds.update({f"state_{i}": s for i, s in enumerate(state)})
            out = runner.run("step", feeds)
            state = [out[f"new_state_{i}"] for i in range(num_states)]
        return out["logits"]

    def onnx_decode():
        state = generator.initial_state(1)
        for t in range(steps):
            logits, state = generator.step(tokens[:, t], state)
        return logits

    diff = differences(onnx_decode(), saved_model_decode())[1]
    timings = timed({"saved_model": saved_model_decode, "onnxruntime": onnx_decode}, repeats)
    (sm_med, sm_all), (ort_med, ort_all) = timings["saved_model"], timings["onnxruntime"]
    runner.close()
    result = {
        "provider": generator.provider,
        "steps": steps,
        "saved_model_tokens_per_s": steps / sm_med,
        "onnxruntime_tokens_per_s": steps / ort_med,
        "saved_model_runs": sm_all,
        "onnxruntime_runs": ort_all,
        "last_logits_max_rel_diff": diff,
    }
    print(
        f"decode step (B=1): SavedModel {steps / sm_med:.0f} tok/s, onnxruntime {steps / ort_med:.0f} tok/s",
        flush=True,
    )
    return result


def to_markdown(result):
    enc = result["encoder"]
    lines = [
        f"Encoder: 2 x LinearTransformerEncoder (width {result['config']['width']}, {result['config']['heads']} heads, "
        f"ffn {result['config']['ffn']}, elu), float32; median of {result['config']['repeats']} interleaved runs; "
        f"onnxruntime provider: {enc['provider']}.",
        "",
        "| batch | N | SavedModel (Session) | onnxruntime | SavedModel / onnxruntime | onnxruntime, spinning threads |",
        "|---|---|---|---|---|---|",
    ]
    for r in enc["rows"]:
        lines.append(
            f"| {r['batch']} | {r['length']} | {r['saved_model_s'] * 1e3:.1f} ms | {r['onnxruntime_s'] * 1e3:.1f} ms "
            f"| {r['speedup']:.2f}x | {r['onnxruntime_spinning_s'] * 1e3:.1f} ms |"
        )
    dec = result["decode"]
    lines += [
        "",
        f"Decode step: 2-layer LinearCausalLM (width {result['config']['width']}, vocabulary "
        f"{result['config']['vocab']}), batch 1, {dec['steps']} steps per run, state passed in and out.",
        "",
        "| SavedModel `step` | onnxruntime step graph |",
        "|---|---|",
        f"| {dec['saved_model_tokens_per_s']:.0f} tokens/s | {dec['onnxruntime_tokens_per_s']:.0f} tokens/s |",
        "",
        f"Machine: {result['machine']}. Command: `{result['command']}`.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test); results not written")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--out", default=RESULTS, help="directory of export.json / export.md")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.quick:
        config = {"width": 32, "heads": 2, "ffn": 64, "vocab": 50, "shapes": [(1, 64), (2, 96)]}
        steps = 8
    else:
        config = {"width": 256, "heads": 4, "ffn": 512, "vocab": 1000, "shapes": [(1, 1024), (8, 4096)]}
        steps = args.decode_steps
    config["repeats"] = args.repeats
    with tempfile.TemporaryDirectory() as workdir:
        encoder = bench_encoder(
            workdir, config["shapes"], args.repeats, config["width"], config["heads"], config["ffn"]
        )
        decode = bench_decode(workdir, steps, args.repeats, config["width"], config["heads"], config["vocab"])
    result = {
        "config": config,
        "encoder": encoder,
        "decode": decode,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
        "command": " ".join(["python -m benchmarks.bench_export"] + list(sys.argv[1:] if argv is None else argv)),
        "time_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    markdown = to_markdown(result)
    print()
    print(markdown)
    if not args.quick:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "export.json"), "w") as f:
            json.dump(result, f, indent=2)
        with open(os.path.join(args.out, "export.md"), "w") as f:
            f.write(markdown)
    return result


if __name__ == "__main__":
    main()
