"""Mixed-precision training soak: 2,000 steps of a tiny causal LM per feature-map family.

    python -m tests.soak                         # bf16, elu / favor+ / oglu / hedgehog
    python -m tests.soak --policy mixed_float16 --steps 2000 --out soak.json

Each run trains a tiny `LinearCausalLM` with XLA (``jit_compile=True``) on a
synthetic task that needs attention: every sequence draws 4 of the V tokens
and then samples uniformly from them, so after a few tokens the best
next-token loss is ``log 4`` (from ``log V`` at the start). Recorded per map:
the held-out loss before and after, the mean training loss of each block of
100 steps, whether any loss or weight was NaN/Inf, the number of random
feature redraws (favor+, every 100 steps) and the wall time.
`tests/ops/test_numerics_stress.py` wraps this in a slow test.
"""

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_linattn.callbacks import RedrawRandomFeatures  # noqa: E402
from keras_linattn.models import LinearCausalLM  # noqa: E402

FAMILIES = {
    "elu": "fixed",
    "favor+": "random",
    "oglu": "trainable",
    "hedgehog": "trainable (Hedgehog)",
}
VOCAB, LENGTH, BATCH, SUBSET = 32, 64, 16, 4
BLOCK = 100


def make_data(num_sequences, seed):
    """``[N, LENGTH + 1]`` int32: each row samples uniformly from its own 4 tokens."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num_sequences):
        subset = rng.choice(VOCAB, SUBSET, replace=False)
        rows.append(rng.choice(subset, LENGTH + 1))
    return np.asarray(rows, dtype="int32")


class _Watch(keras.callbacks.Callback):
    """Per-block mean of the per-step loss, and whether any loss was not finite."""

    def __init__(self):
        super().__init__()
        self.block_means, self._sum, self._count, self.non_finite_steps = [], 0.0, 0, 0
        self._last_running, self._step_in_epoch = 0.0, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._last_running, self._step_in_epoch = 0.0, 0

    def on_train_batch_end(self, batch, logs=None):
        # Keras reports the running mean over the epoch: recover the step's loss.
        running = float(logs["loss"])
        n = self._step_in_epoch + 1
        loss = running * n - self._last_running * (n - 1)
        self._last_running, self._step_in_epoch = running, n
        if not math.isfinite(loss):
            self.non_finite_steps += 1
        self._sum += loss
        self._count += 1
        if self._count == BLOCK:
            self.block_means.append(self._sum / BLOCK)
            self._sum, self._count = 0.0, 0


def soak(feature_map, steps=2000, policy="mixed_bfloat16", seed=0):
    """Trains one tiny LM; returns a dict of what was measured."""
    keras.utils.clear_session()
    keras.utils.set_random_seed(seed)
    keras.config.set_dtype_policy(policy)
    try:
        kwargs = {"num_features": 32, "seed": seed} if feature_map == "favor+" else {}
        from keras_linattn import feature_maps

        model = LinearCausalLM(
            vocabulary_size=VOCAB,
            num_layers=2,
            hidden_dim=32,
            num_heads=2,
            intermediate_dim=64,
            feature_map=feature_maps.get(feature_map, **kwargs),
            chunk_size=16,
        )
        train = make_data(4096, seed)
        held_out = make_data(256, seed + 1)
        dataset = (
            tf.data.Dataset.from_tensor_slices((train[:, :-1], train[:, 1:]))
            .shuffle(4096, seed=seed)
            .repeat()
            .batch(BATCH, drop_remainder=True)
        )
        model.compile(
            optimizer=keras.optimizers.Adam(3e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=True,
        )
        loss_before = float(
            model.evaluate(held_out[:, :-1], held_out[:, 1:], batch_size=64, verbose=0, return_dict=True)["loss"]
        )
        watch = _Watch()
        callbacks = [watch]
        redraw = None
        if feature_map == "favor+":
            redraw = RedrawRandomFeatures(every_n_steps=100)
            callbacks.append(redraw)
        t0 = time.perf_counter()
        model.fit(dataset, epochs=steps // BLOCK, steps_per_epoch=BLOCK, callbacks=callbacks, verbose=0)
        seconds = time.perf_counter() - t0
        loss_after = float(
            model.evaluate(held_out[:, :-1], held_out[:, 1:], batch_size=64, verbose=0, return_dict=True)["loss"]
        )
        weights_finite = all(np.isfinite(np.asarray(w, dtype="float32")).all() for w in model.weights)
        return {
            "feature_map": feature_map,
            "family": FAMILIES.get(feature_map, ""),
            "policy": policy,
            "steps": steps,
            "loss_before": loss_before,
            "loss_after": loss_after,
            "first_block_loss": watch.block_means[0] if watch.block_means else None,
            "last_block_loss": watch.block_means[-1] if watch.block_means else None,
            "block_losses": watch.block_means,
            "non_finite_steps": watch.non_finite_steps,
            "weights_finite": bool(weights_finite),
            "redraws": redraw.redraw_count if redraw is not None else 0,
            "seconds": seconds,
            "optimal_loss": math.log(SUBSET),
        }
    finally:
        keras.config.set_dtype_policy("float32")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maps", default=",".join(FAMILIES), help="comma-separated feature maps")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--policy", default="mixed_bfloat16", choices=("mixed_bfloat16", "mixed_float16", "float32"))
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.steps <= 0 or args.steps % BLOCK:
        parser.error(f"--steps must be a positive multiple of {BLOCK}. Received: --steps={args.steps}")
    results = []
    print(
        "| map | family | policy | steps | held-out loss before | after | first/last 100-step loss "
        "| non-finite steps | weights finite | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in [m for m in args.maps.split(",") if m]:
        r = soak(name, steps=args.steps, policy=args.policy)
        results.append(r)
        print(
            f"| {name} | {r['family']} | {r['policy']} | {r['steps']} | {r['loss_before']:.3f} | "
            f"{r['loss_after']:.3f} | {r['first_block_loss']:.3f} / {r['last_block_loss']:.3f} | "
            f"{r['non_finite_steps']} | {r['weights_finite']} | {r['seconds']:.0f} |",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    ok = all(r["non_finite_steps"] == 0 and r["weights_finite"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
