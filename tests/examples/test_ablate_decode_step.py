"""benchmarks/ablate_decode_step.py: its variants, the fused projections it times, the classes left as they were."""

import keras
import keras_hub
import numpy as np

import keras_linattn
from benchmarks import ablate_decode_step as A
from keras_linattn.layers import _attention_base
from keras_linattn.layers import linear_attention as la
from keras_linattn.recurrences import window


def _student():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=50, num_layers=1, num_query_heads=4, num_key_value_heads=2, hidden_dim=16, intermediate_dim=32
    )
    teacher = keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
    return keras_linattn.linearize(teacher, window_size=4)


def test_the_fused_variant_projects_as_the_three_kernels_do():
    student = _student()
    attention = student.backbone.decoder_blocks[0]._self_attention
    x = np.random.default_rng(0).normal(size=(2, 1, 16)).astype("float32")
    expected = [np.asarray(t) for t in attention.project(x, x, x)]
    originals = (_attention_base.ProjectedAttention.project, window.WindowRecurrence.features, la.LinearAttention.step)
    undo = A._patch()
    try:
        A._fuse(student)
        A._ACTIVE["variant"] = "fused_qkv"
        fused = [np.asarray(t) for t in attention.project(x, x, x)]
        kernel, bias, sizes = attention._ablation_fused
        attention._ablation_fused = (np.zeros_like(kernel), bias, sizes)  # the variant reads these, not the layers
        biased = np.asarray(attention.project(x, x, x)[0])
        A._ACTIVE["variant"] = "step"
        unfused = [np.asarray(t) for t in attention.project(x, x, x)]
    finally:
        undo()
        A._ACTIVE["variant"] = "step"
    for got, ref in zip(fused, expected, strict=True):
        assert got.shape == ref.shape  # k and v repeated to the query heads, as `project` does
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(biased, np.broadcast_to(bias[: sizes[0]].reshape(1, 1, 4, 4), biased.shape))
    for got, ref in zip(unfused, expected, strict=True):
        np.testing.assert_array_equal(got, ref)
    restored = (_attention_base.ProjectedAttention.project, window.WindowRecurrence.features, la.LinearAttention.step)
    assert restored == originals


def test_a_tiny_run_times_every_variant_and_profiles_the_step(tmp_path):
    out = tmp_path / "ablate.json"
    result = A.main(["--family", "gpt2", "--layers", "1", "--vocabulary", "64", "--rounds", "1", "--calls", "2",
                     "--profile", "2", "--out", str(out)])  # fmt: skip
    assert set(result["ms"]) == set(A.VARIANTS)
    profile = result["profile"]
    assert profile["calls"] == 2
    # One layer: q, k, v, output, two feed-forward kernels and the vocabulary head (7), the query's and the
    # key's feature-map products and the linear readout (3; batched products at one token, not einsums).
    products = [row["count"] for t, row in profile["by_type"].items() if t in A.MATRIX_OPS and "Einsum" not in t]
    assert sum(products) == 10
    assert {"query", "key", "value", "hedgehog_feature_map"} <= set(profile["by_scope"])
    assert 0 < profile["matrix_op_ms_per_call"] < profile["op_ms_per_call"]
    assert all(ms > 0 for ms in result["ms"].values())
    assert set(result["saved_ms"]) == set(A.VARIANTS) - {"step"}
    assert out.exists()
    assert la.LinearAttention.step.__name__ == "step"  # the classes are left as they were


def test_the_profile_counts_each_op_once_a_call_under_its_scope(tmp_path):
    import tensorflow as tf

    w = tf.Variable(tf.ones((8, 8)))

    @tf.function(autograph=False)
    def f(x):
        with tf.name_scope("dense"):
            y = tf.matmul(x, w)
        return tf.reduce_sum(y * y)

    x = tf.ones((1, 8))
    for _ in range(150):
        f(x)  # a function run this often no longer has its ops recorded: the profile traces it afresh
    profile = A.profile_ops(f, (x,), 3, str(tmp_path))
    assert profile["calls"] == 3
    products = {t: row for t, row in profile["by_type"].items() if t in A.MATRIX_OPS}
    assert len(products) == 1 and next(iter(products.values()))["count"] == 1.0
    assert profile["by_scope"]["dense"]["count"] >= 1.0  # the product (and its variable read)
    assert profile["by_type"]["Sum"]["count"] == 1.0 and "__inference" not in str(profile["by_type"])
    assert not any(t.startswith(("Process", "KernelAndDeviceFunc")) for t in profile["by_type"])


def test_an_op_scope_is_its_layer_without_the_keras_suffix():
    assert A._scope("query_3/MatMul") == "query"
    assert A._scope("hedgehog_feature_map_12/einsum/Einsum") == "hedgehog_feature_map"
    assert A._scope("mul_9") == "(unscoped)"
    assert A._scope("feedforward_output_dense/BiasAdd") == "feedforward_output_dense"


def test_the_profile_refuses_more_calls_than_it_can_record(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="calls"):
        A.profile_ops(lambda x: x, (1.0,), A.MAX_PROFILED_CALLS + 1, str(tmp_path))
