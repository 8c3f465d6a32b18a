"""onnxruntime(-gpu) inference on models exported with `keras-linattn export`.

Uses the CUDA provider when a GPU and its CUDA libraries are present (with
I/O binding: decoding state stays on the GPU between steps) and the CPU
provider otherwise; prints which one runs.

    # encoder: time the exported call on random inputs
    python onnxruntime_gpu_example.py exported/onnx/encoder.onnx --batch 8 --length 4096
    # causal LM: greedy generation with the step graph
    python onnxruntime_gpu_example.py exported/onnx/lm_step.onnx --prompt 1,2,3 --max-length 64

Install: ``pip install onnxruntime-gpu`` (never together with ``onnxruntime``);
on GPU machines ``pip install "onnxruntime-gpu[cuda,cudnn]"`` brings the CUDA
libraries it was built for.
"""

import argparse
import sys
import time

import numpy as np

from keras_linattn.export import OnnxGenerator, OnnxPredictor


def run_encoder(path, batch, length, device, repeats):
    predictor = OnnxPredictor(path, device=device)
    print(f"provider: {predictor.provider} (io binding: {predictor.use_io_binding})")
    meta = predictor.metadata
    rng = np.random.default_rng(0)
    feeds = {}
    for name, (dtype, shape) in predictor.inputs.items():
        dims = [d if isinstance(d, int) else (batch if axis == 0 else length) for axis, d in enumerate(shape)]
        if np.issubdtype(dtype, np.integer):
            feeds[name] = rng.integers(0, meta.get("vocabulary_size") or 2, size=dims).astype(dtype)
        else:
            feeds[name] = rng.standard_normal(dims).astype(dtype)
    predictor(feeds)  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = predictor(feeds)
        times.append(time.perf_counter() - start)
    for name, value in outputs.items():
        print(f"{name}: shape={value.shape}")
    print(f"median latency over {repeats} runs: {1e3 * float(np.median(times)):.2f} ms")


def run_lm(step_path, prompt, max_length, device, temperature, seed):
    generator = OnnxGenerator(step_path, device=device)
    print(f"provider: {generator.provider} (io binding: {generator.predictor.use_io_binding})")
    prompt_ids = np.array([[int(t) for t in prompt.split(",")]], np.int32)
    start = time.perf_counter()
    tokens = generator.generate(prompt_ids, max_length, temperature=temperature, seed=seed)
    seconds = time.perf_counter() - start
    print(tokens)
    print(f"{max_length} tokens in {seconds:.3f} s ({max_length / seconds:.1f} tokens/s incl. prompt)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("onnx", help="model.onnx, or <name>_step.onnx with --prompt")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt", default=None, help="comma-separated token ids (step graph)")
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.prompt is not None:
        run_lm(args.onnx, args.prompt, args.max_length, args.device, args.temperature, args.seed)
    else:
        run_encoder(args.onnx, args.batch, args.length, args.device, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
