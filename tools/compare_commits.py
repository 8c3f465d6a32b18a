"""Times the same small workloads on two checkouts of the package, side by side, in fresh processes.

    python tools/compare_commits.py OLD_TREE NEW_TREE [--rounds 3] [--json out.json]

Each round runs one process per tree (alternating, so drift on a shared
machine hits both): a `LinearAttention` causal forward (B=1, T=2048,
hedgehog, window 32) and `LinearCausalLM.generate` (2 layers, width 64,
window 16, 64 new tokens, plain `tf.function`) and that LM's eager forward
on ``[2, 512]`` token ids, each the median of 5 timed
calls after a warm-up. Reports per-tree medians over rounds and their ratio.
For checking that a refactoring left speed unchanged; not a benchmark of
record.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKLOAD = r"""
import json, time, statistics
import numpy as np
import keras
from keras_linattn.layers import LinearAttention
from keras_linattn.models import LinearCausalLM

def median_ms(fn, n=5):
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter(); fn(); times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)

x = np.random.default_rng(0).normal(size=(1, 2048, 128)).astype("float32")
layer = LinearAttention(4, 32, feature_map="hedgehog", window_size=32, chunk_size=64, conv_size=None)
fwd = median_ms(lambda: np.asarray(layer(x, x, use_causal_mask=True)))
lm = LinearCausalLM(vocabulary_size=256, num_layers=2, hidden_dim=64, num_heads=4, intermediate_dim=128,
                    feature_map="hedgehog", window_size=16, conv_size=None)
lm.generate_jit_compile = False
prompt = np.ones((1, 8), "int32")
gen = median_ms(lambda: lm.generate(prompt, max_length=72))
ids = np.random.default_rng(1).integers(0, 256, size=(2, 512)).astype("int32")
lm_fwd = median_ms(lambda: np.asarray(lm(ids)))
print(json.dumps({"forward_ms": fwd, "generate_ms": gen, "lm_forward_ms": lm_fwd}))
"""


def run(tree):
    env = dict(os.environ, PYTHONPATH=tree, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    out = subprocess.run([sys.executable, "-c", WORKLOAD], env=env, cwd=tree, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    runs = {"old": [], "new": []}
    for r in range(args.rounds):
        for name in ("old", "new"):
            runs[name].append(run(getattr(args, name)))
            print(f"round {r + 1} {name}: {runs[name][-1]}", flush=True)
    summary = {}
    for key in ("forward_ms", "generate_ms", "lm_forward_ms"):
        old = statistics.median(row[key] for row in runs["old"])
        new = statistics.median(row[key] for row in runs["new"])
        summary[key] = {"old": round(old, 2), "new": round(new, 2), "new/old": round(new / old, 3)}
        print(f"{key}: old {old:.2f} ms, new {new:.2f} ms, new/old {new / old:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"old": args.old, "new": args.new, "rounds": runs, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
