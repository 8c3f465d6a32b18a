"""The three runtimes called from 8 threads at once give what sequential calls give.

One `OnnxPredictor`, one `SavedModelRunner` and one `OnnxGenerator` (of the
shared tiny-LM export) are each shared by 8 threads that start together
(a barrier) and call them with their own inputs; every answer is compared
with the answer of the same call made sequentially before. Logits are two
runs of one float32 graph on the same input (``paths=2``); generated tokens
must be identical.

``python -m tests.export.test_concurrency [ROUNDS]`` runs the same workload for
longer and prints the calls, errors, mismatches and RSS growth (the figures
in docs/faults.md).
"""

import os
import sys
import threading

import numpy as np

from keras_linattn import export
from keras_linattn.export import _specs
from tests import _fault_exports
from tests._fault_exports import NAME
from tests.tolerance import assert_close

THREADS = 8
VOCAB, LAYERS, HIDDEN, HEADS, INTERMEDIATE = 40, 2, 16, 2, 32  # tests.export.test_export.tiny_lm
LENGTH = 6
# Reductions on the way to a logit: per layer the q/k/v projections (HIDDEN), attention over
# LENGTH keys and HIDDEN // HEADS features, the output projection (HIDDEN), the feedforward
# (HIDDEN, INTERMEDIATE); then the head (HIDDEN).
N_LOGITS = LAYERS * (HIDDEN + LENGTH + HIDDEN // HEADS + HIDDEN + HIDDEN + INTERMEDIATE) + HIDDEN


def _runtimes(out):
    onnx_dir = os.path.join(out, "onnx")
    return (
        export.OnnxPredictor(os.path.join(onnx_dir, f"{NAME}.onnx"), device="cpu"),
        export.SavedModelRunner(os.path.join(out, NAME, "1")),
        export.OnnxGenerator(os.path.join(onnx_dir, f"{NAME}_step.onnx"), device="cpu"),
    )


def _calls(thread, rounds):
    """The calls thread `thread` makes: (kind, input) pairs, each input seeded by (thread, round)."""
    calls = []
    for r in range(rounds):
        rng = np.random.default_rng([thread, r])
        ids = rng.integers(1, VOCAB, size=(2, LENGTH)).astype(np.int32)
        calls += [("onnx", ids), ("saved_model", ids), ("generate", ids[:, :3])]
    return calls


def _run(runtimes, kind, ids):
    predictor, runner, generator = runtimes
    if kind == "onnx":
        return predictor({_specs.TOKEN_IDS: ids})[_specs.LOGITS]
    if kind == "saved_model":
        return runner.run(_specs.SERVING_DEFAULT, {_specs.TOKEN_IDS: ids})[_specs.LOGITS]
    return generator.generate(ids, max_length=ids.shape[1] + 4)


def run_concurrently(runtimes, rounds):
    """Runs every thread's calls sequentially, then from THREADS threads at once.

    Returns ``(pairs, errors)``: (kind, sequential answer, concurrent answer) for every call,
    and the exceptions raised in threads.
    """
    work = {t: _calls(t, rounds) for t in range(THREADS)}
    expected = {t: [_run(runtimes, kind, ids) for kind, ids in calls] for t, calls in work.items()}
    got = {t: [] for t in work}
    errors = []
    barrier = threading.Barrier(THREADS)

    def body(t):
        try:
            barrier.wait()
            for kind, ids in work[t]:
                got[t].append(_run(runtimes, kind, ids))
        except Exception as e:  # reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=body, args=(t,)) for t in work]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    pairs = [(kind, e, g) for t in work for (kind, _), e, g in zip(work[t], expected[t], got[t], strict=True)]
    return pairs, errors


def test_eight_threads_match_sequential_calls():
    runtimes = _runtimes(_fault_exports.export_dir())
    try:
        pairs, errors = run_concurrently(runtimes, rounds=2)
    finally:
        runtimes[1].close()
    assert not errors, errors
    assert len(pairs) == THREADS * 2 * 3
    for kind, expected, got in pairs:
        if kind == "generate":
            np.testing.assert_array_equal(got, expected)
        else:
            assert_close(got, expected, n=N_LOGITS, paths=2, what=kind)


def _rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(rounds=25):
    runtimes = _runtimes(_fault_exports.export_dir())
    run_concurrently(runtimes, rounds=1)  # warm up
    before = _rss_mb()
    pairs, errors = run_concurrently(runtimes, rounds=rounds)
    after = _rss_mb()
    mismatches = 0
    for kind, expected, got in pairs:
        if kind == "generate":
            mismatches += int(not np.array_equal(got, expected))
        else:
            mismatches += int(np.abs(got - expected).max() > 0)
    runtimes[1].close()
    print(
        f"threads {THREADS}, concurrent calls {len(pairs)}, errors {len(errors)}, "
        f"mismatches (not bit-identical) {mismatches}, RSS {before:.0f} -> {after:.0f} MB"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 25)
