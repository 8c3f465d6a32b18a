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


def test_a_tiny_run_times_every_variant(tmp_path):
    out = tmp_path / "ablate.json"
    result = A.main(["--family", "gpt2", "--layers", "1", "--vocabulary", "64", "--rounds", "1", "--calls", "2",
                     "--out", str(out)])  # fmt: skip
    assert set(result["ms"]) == set(A.VARIANTS)
    assert all(ms > 0 for ms in result["ms"].values())
    assert set(result["saved_ms"]) == set(A.VARIANTS) - {"step"}
    assert out.exists()
    assert la.LinearAttention.step.__name__ == "step"  # the classes are left as they were
