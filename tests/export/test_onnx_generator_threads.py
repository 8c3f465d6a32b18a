"""`OnnxGenerator` creates its generate-graph session once, whatever the number of threads calling first.

Before, `_generate_graph` checked and set the session without a lock: 8
threads calling `generate` on a fresh generator created 8 sessions (each
loading the graph and its weights).
"""

import threading
import time

import numpy as np
import pytest

from keras_linattn import export
from keras_linattn.export import onnx_generator
from tests import _shared_exports

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.tf_only("the ONNX export converts a TensorFlow graph")

THREADS = 8


@pytest.fixture(scope="module")
def lm_onnx():
    # tiny_lm() exported once per run for every file that reads it (tests/_shared_exports.py)
    model, _, paths = _shared_exports.lm_export()
    return model, paths


def test_threads_on_a_fresh_generator_create_one_session(lm_onnx, monkeypatch):
    model, paths = lm_onnx
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 40, size=(2, 3 + i % 3)).astype("int32") for i in range(THREADS)]
    expected = [np.asarray(model.generate(p, max_length=10)) for p in prompts]

    generator = export.OnnxGenerator(paths["step"], device="cpu")  # the step session: created here
    created = []

    class SlowPredictor(onnx_generator.OnnxPredictor):
        """Counts the sessions; a slow start keeps every thread in the window an unlocked check leaves."""

        def __init__(self, *args, **kwargs):
            created.append(args[0])
            time.sleep(0.3)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(onnx_generator, "OnnxPredictor", SlowPredictor)
    barrier = threading.Barrier(THREADS)
    results, errors = [None] * THREADS, []

    def run(i):
        try:
            barrier.wait()
            results[i] = generator.generate(prompts[i], max_length=10)
        except Exception as e:  # reported below: an exception in a thread would pass silently
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert created == [generator.generate_path], f"{len(created)} sessions created"
    for got, want in zip(results, expected, strict=True):
        np.testing.assert_array_equal(got, want)  # Keras' greedy tokens
