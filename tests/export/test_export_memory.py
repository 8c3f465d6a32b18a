"""Memory of `export_onnx` and `verify`: no whole copy of a weight while writing, one session at a time in verify.

The write-out is checked with `tracemalloc` (numpy's buffers and Python's bytes
are traced): writing weights of `W` bytes each, in slices of `CHUNK_BYTES`
lowered to `W / 16`, must never hold half a weight. Holding a whole weight at
once (its ``numpy()`` copy, its serialized tensor) passes that bound; the
slices do not come near it. The bytes written are those of the one-shot
serialization (`numpy_helper.from_array`), bit for bit.

`verify` must hold at most one onnxruntime session (one copy of the weights):
the model graph's session is made after the weight checks and is freed before
the step and generate graphs load theirs.
"""

import gc
import importlib
import io
import tracemalloc
import weakref

import keras
import numpy as np
import pytest
from onnx import ModelProto, numpy_helper

from keras_linattn import export
from keras_linattn.export import _onnx_publish, _verify_decoding, _verify_weights
from tests import _shared_exports

pytestmark = pytest.mark.tf_only("ONNX export runs on TensorFlow")

verify_module = importlib.import_module("keras_linattn.export.verify")

_ROWS, _COLS = 512, 1024  # one float32 weight: 2 MiB
_WEIGHT_BYTES = _ROWS * _COLS * 4


def _variables(count=3):
    rng = np.random.default_rng(0)
    return [keras.Variable(rng.normal(size=(_ROWS, _COLS)).astype("float32"), name=f"w{i}") for i in range(count)]


def _peak_traced(fn):
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(_onnx_publish, "CHUNK_BYTES", _WEIGHT_BYTES // 16)


def test_external_data_is_written_without_a_whole_weight_in_memory(small_chunks, tmp_path):
    variables = _variables()
    layout = {}

    def write():
        layout["offsets"], _ = _onnx_publish.write_external_data(tmp_path / "w.data", variables, [0, 1, 2], "e")

    peak = _peak_traced(write)
    assert peak < _WEIGHT_BYTES / 2, f"{peak} bytes traced at once writing weights of {_WEIGHT_BYTES} bytes"
    data = (tmp_path / "w.data").read_bytes()
    for i, variable in enumerate(variables):
        offset, length = layout["offsets"][i]
        assert data[offset : offset + length] == variable.numpy().tobytes()


def test_inline_weights_are_written_without_a_whole_weight_in_memory(small_chunks, tmp_path):
    variables = _variables()
    names = [v.name for v in variables]
    proto = ModelProto()
    peak = _peak_traced(
        lambda: _onnx_publish.save_with_weights(proto, tmp_path / "m.onnx", [0, 1, 2], variables, names)
    )
    assert peak < _WEIGHT_BYTES / 2, f"{peak} bytes traced at once writing weights of {_WEIGHT_BYTES} bytes"
    loaded = ModelProto.FromString((tmp_path / "m.onnx").read_bytes())
    for tensor, variable in zip(loaded.graph.initializer, variables, strict=True):
        np.testing.assert_array_equal(numpy_helper.to_array(tensor), variable.numpy())


@pytest.mark.parametrize(
    "shape, dtype",
    [((_ROWS, _COLS), "float32"), ((300, 7, 3), "bfloat16"), ((33,), "float16"), ((), "float32"), ((0, 4), "int8")],
)
def test_an_inline_weight_is_the_bytes_of_its_one_shot_serialization(small_chunks, shape, dtype):
    value = np.random.default_rng(1).normal(size=shape) * 10
    variable = keras.Variable(value.astype(np.float32), dtype=dtype, name="w")
    want = ModelProto()
    want.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(variable.numpy()), "dense/kernel"))
    got = io.BytesIO()
    _onnx_publish.write_initializer(got, variable, "dense/kernel")
    assert got.getvalue() == want.SerializeToString()


def test_verify_holds_one_onnx_session_at_a_time(monkeypatch):
    model, _, paths = _shared_exports.limited_export()
    sessions = []

    class Recorded(verify_module.OnnxPredictor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            sessions.append(weakref.ref(self))

    def alive():
        gc.collect()
        return [ref() for ref in sessions if ref() is not None]

    seen = {}

    def recording(name, fn):
        def wrapped(*args, **kwargs):
            seen[name] = len(alive())
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(verify_module, "OnnxPredictor", Recorded)
    monkeypatch.setattr(_verify_weights, "check_files", recording("weights", _verify_weights.check_files))
    monkeypatch.setattr(_verify_decoding, "check_decoding", recording("decoding", _verify_decoding.check_decoding))
    report = export.verify(model, onnx_path=paths["model"], shapes=[(1, 5)], decode_steps=3)
    assert report.ok, report
    assert len(sessions) == 1  # the model graph's session was made
    assert seen == {"weights": 0, "decoding": 0}, f"model graph sessions alive when each check began: {seen}"
