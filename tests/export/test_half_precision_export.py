"""Exports of bfloat16 models: 16-bit weights in the files, float32 computation (`export._float_compute`).

tf2onnx's conversion of a graph computing in bfloat16 binds float16 and
bfloat16 in one node, which onnxruntime refuses to load; the export traces
the layers computing in float32 on their bfloat16 weights instead. `verify`
computes its reference the same way, so its bounds are the float32 error
model's; the stored weights are compared with the model's exactly.
"""

import collections
import os
import random

import keras
import numpy as np
import onnx
import pytest

from keras_linattn import export
from keras_linattn.export import _float_compute
from keras_linattn.models import LinearBackbone, LinearCausalLM

pytestmark = [pytest.mark.numeric, pytest.mark.tf_only("ONNX and SavedModel exports run on TensorFlow")]


def _lm(dtype=None):
    keras.utils.set_random_seed(0)
    np.random.seed(0)
    random.seed(0)
    backbone = LinearBackbone(
        vocabulary_size=40, num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=32, dtype=dtype
    )
    return LinearCausalLM(backbone=backbone, preprocessor=None)


def _compute_dtypes(model):
    return {layer.dtype_policy.compute_dtype for layer in model._flatten_layers(include_self=True)}


@pytest.fixture(scope="module")
def bfloat16_onnx(tmp_path_factory):
    lm = _lm("bfloat16")
    path = str(tmp_path_factory.mktemp("bf16") / "lm.onnx")
    policies = [layer.dtype_policy for layer in lm._flatten_layers(include_self=True)]
    return lm, export.export_onnx(lm, path, include_step=False), policies


@pytest.mark.slow  # one graph's conversion: 10-20 s on 2 loaded cores
def test_a_bfloat16_onnx_export_loads_and_stores_bfloat16_weights(bfloat16_onnx):
    import onnxruntime as ort

    lm, paths, policies = bfloat16_onnx
    ort.InferenceSession(paths["model"], providers=["CPUExecutionProvider"])  # raised: float16 and bfloat16 in a Gemm
    stored = {tensor.name: tensor.data_type for tensor in onnx.load(paths["model"]).graph.initializer}
    weights = {w.path for w in lm.weights if str(w.dtype) == "bfloat16"}
    assert weights and weights <= set(stored)
    assert {stored[name] for name in weights} == {onnx.TensorProto.BFLOAT16}
    # The layers have their own policies again after the export.
    assert [layer.dtype_policy for layer in lm._flatten_layers(include_self=True)] == policies
    assert "bfloat16" in _compute_dtypes(lm)


@pytest.mark.slow
def test_a_bfloat16_onnx_export_passes_verify(bfloat16_onnx):
    lm, paths, _ = bfloat16_onnx
    report = export.verify(lm, onnx_path=paths["model"], shapes=[(2, 5)], raise_on_failure=False)
    assert report.ok, report.table()
    compared = [row for row in report.rows if not row.exact]
    # The float32 error model's bound: the export computes in float32, as the reference does.
    assert compared and all(row.tolerance < 1e-3 for row in compared)


def test_float32_compute_switches_only_16_bit_layers_and_restores_them():
    lm = _lm("bfloat16")
    before = [layer.dtype_policy for layer in lm._flatten_layers(include_self=True)]
    # Each weight keeps its own dtype: bfloat16, and float32 where a layer stores it so on purpose
    # (the short convolution's and the recurrences' weights, `autocast=False`).
    weight_dtypes = [w.dtype for w in lm.weights]
    assert "bfloat16" in weight_dtypes
    with pytest.raises(RuntimeError, match="inside"):
        with _float_compute.float32_compute(lm) as switched:
            assert switched > 0
            assert [w.dtype for w in lm.weights] == weight_dtypes
            assert "bfloat16" not in _compute_dtypes(lm)
            raise RuntimeError("inside")
    assert [layer.dtype_policy for layer in lm._flatten_layers(include_self=True)] == before
    with _float_compute.float32_compute(_lm()) as switched:
        assert switched == 0


@pytest.mark.slow
def test_a_bfloat16_saved_model_carries_bfloat16_variables(tmp_path):
    import tensorflow as tf

    lm = _lm("bfloat16")
    version_dir = export.export_saved_model(lm, os.path.join(tmp_path, "sm"), warmup=False, include_generate=False)
    reader = tf.train.load_checkpoint(os.path.join(version_dir, "variables", "variables"))
    dtypes = [dtype for name, dtype in reader.get_variable_to_dtype_map().items() if "OBJECT_GRAPH" not in name]
    # Every weight in its own dtype: the model's bfloat16 weights as bfloat16, its float32 ones as float32.
    stored = collections.Counter(dtype.name for dtype in dtypes if dtype.is_floating)
    assert stored == collections.Counter(str(w.dtype) for w in lm.weights) and stored["bfloat16"] > 0
    report = export.verify(lm, saved_model_dir=version_dir, shapes=[(2, 5)], decode_steps=2, raise_on_failure=False)
    assert report.ok, report.table()
