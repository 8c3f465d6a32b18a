"""MixtureOfExperts: the routed feed-forward against a float64 per-token oracle, its step form, its serialization."""

import keras
import numpy as np
import pytest

import keras_linattn
from keras_linattn.layers import MixtureOfExperts
from keras_linattn.models import LinearBackbone, LinearCausalLM
from tests.tolerance import assert_close

pytestmark = pytest.mark.numeric

DIM, EXPERTS, TOP_K, INTER, SHARED = 16, 4, 2, 24, 20


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _oracle(moe, x):
    """Per token in float64: the softmax router's top-k experts, their weighted sum, the gated shared expert."""
    w = {v.name: np.asarray(v, "float64") for v in moe.weights}
    flat = np.asarray(x, "float64").reshape(-1, DIM)
    out = np.zeros_like(flat)
    for n, h in enumerate(flat):
        logits = h @ w["router_kernel"]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        picked = np.argsort(-p)[: moe.top_k]
        weights = p[picked] / (p[picked].sum() if moe.normalize_top_k else 1.0)
        for e, g in zip(picked, weights, strict=True):
            hidden = _silu(h @ w["expert_gate_kernel"][e]) * (h @ w["expert_up_kernel"][e])
            out[n] += g * (hidden @ w["expert_down_kernel"][e])
        if moe.shared_expert_dim is not None:
            shared = _silu(h @ w["shared_expert_gate_kernel"]) * (h @ w["shared_expert_up_kernel"])
            gate = 1.0 / (1.0 + np.exp(-(h @ w["shared_expert_weight_kernel"])))
            out[n] += (shared @ w["shared_expert_down_kernel"]) * gate
    return out.reshape(np.shape(x))


@pytest.fixture(scope="module", params=[(True, None), (False, SHARED)], ids=["mixtral", "qwen_moe"])
def moe(request):
    normalize, shared = request.param
    keras.utils.set_random_seed(0)
    layer = MixtureOfExperts(EXPERTS, TOP_K, INTER, normalize_top_k=normalize, shared_expert_dim=shared)
    layer.build((None, None, DIM))
    rng = np.random.default_rng(0)
    for v in layer.weights:  # a router with spread logits: the top-k choice differs across tokens
        v.assign(rng.normal(0.0, 1.0 if "router" in v.name else 0.2, tuple(v.shape)).astype("float32"))
    return layer


def test_the_sequence_and_step_forms_compute_the_routed_experts(moe):
    x = np.random.default_rng(1).normal(size=(3, 7, DIM)).astype("float32")  # [B, T, dim]
    want = _oracle(moe, x)
    # A sum of top_k expert paths (plus the shared one), each two float32 products of length dim and expert_dim.
    assert_close(np.asarray(moe(x)), want, paths=2 * (TOP_K + 1), n=max(DIM, INTER))
    for t in range(x.shape[1]):  # the one-token form gathers the picked experts' kernels
        assert_close(np.asarray(moe(x[:, t], step=True)), want[:, t], paths=2 * (TOP_K + 1), n=max(DIM, INTER))
    picked = np.argsort(-np.asarray(x.reshape(-1, DIM) @ np.asarray(moe.router_kernel)), axis=-1)[:, :TOP_K]
    assert len({tuple(sorted(row)) for row in picked}) > 1  # the routing is exercised, not one expert pair


def test_the_layer_round_trips_through_its_config_and_weights(moe, tmp_path):
    inputs = keras.Input((None, DIM))
    model = keras.Model(inputs, moe(inputs))
    path = str(tmp_path / "moe.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    x = np.random.default_rng(2).normal(size=(2, 5, DIM)).astype("float32")
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(model(x)))
    config = loaded.layers[-1].get_config()
    assert (config["num_experts"], config["top_k"], config["shared_expert_dim"]) == (
        EXPERTS,
        TOP_K,
        moe.shared_expert_dim,
    )


def test_bad_sizes_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="top_k.*Received: top_k=5"):
        MixtureOfExperts(4, 5, 8)
    with pytest.raises(ValueError, match="expert_dim"):
        MixtureOfExperts(4, 2, 0)
    with pytest.raises(ValueError, match="moe.*Received: moe="):
        LinearBackbone(vocabulary_size=16, num_layers=2, hidden_dim=8, num_heads=2, intermediate_dim=8, moe=[{}])


def test_a_backbone_with_moe_layers_saves_reloads_and_relinearizes_them(tmp_path):
    # One block with experts and a shared expert, one dense (Qwen MoE's dense layers), in a `.keras` file.
    keras.utils.set_random_seed(0)
    moe = [{"num_experts": 3, "top_k": 2, "expert_dim": 12, "normalize_top_k": False, "shared_expert_dim": 10}, None]
    lm = LinearCausalLM(
        LinearBackbone(
            vocabulary_size=32,
            num_layers=2,
            hidden_dim=16,
            num_heads=2,
            intermediate_dim=24,
            normalization="rms_norm",
            feedforward="gated",
            activation="silu",
            moe=moe,
        )
    )
    assert isinstance(lm.decoder_blocks[0]._moe, MixtureOfExperts) and lm.decoder_blocks[1]._moe is None
    assert lm.backbone.get_config()["moe"] == moe
    path = str(tmp_path / "lm.keras")
    lm.save(path)
    loaded = keras.saving.load_model(path)
    ids = np.random.default_rng(3).integers(0, 32, (2, 9)).astype("int32")
    np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(lm(ids)))
    assert loaded.backbone.moe == lm.backbone.moe
    other = keras_linattn.linearize(lm, feature_map="elu", window_size=4)  # another attention, the same experts
    assert other.backbone.moe == lm.backbone.moe
    for ours, theirs in zip(other.decoder_blocks[0]._moe.weights, lm.decoder_blocks[0]._moe.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
