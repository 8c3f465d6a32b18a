"""After `Model.quantize("int8")`: no float kernel outside the documented ones, over `model.weights` (not a list
of known names), for a mixture-of-experts LM (Mixtral's and Qwen MoE's blocks), a dense LM with LoRA merged and
every shipped feature map; no warning naming a package layer that holds a kernel; the quantized MoE LM's step
against its parallel form, its `.keras` round trip, and its exports through `verify`.

The float kernels that stay, and why (`KEPT_FLOAT`; docs/dev/testing.md, "The quantization error model"):
the feature maps' weights (their features feed an ``exp`` and the float32 state), the MoE router (a discrete
top-k choice: a rounding error in a router logit swaps the experts), the short convolution's taps (a depthwise
filter of 4 taps per channel: no product over the width to take in int8), the recurrences' gates (they enter
the float32 decay of every later step), and the quantization scales themselves. Biases (``[H, K]`` for q, k, v)
and norms are vectors of each channel, not kernels.

The quantized LM against the float one has no bound of the error model here: a router picks its experts from
the hidden state, which the quantized attention has changed, so a token near a routing boundary changes
experts. `tests/layers/test_quantized_experts.py` bounds the experts against the float layer on the same input.
"""

import collections
import random
import warnings

import keras
import numpy as np
import pytest

from keras_linattn.export import _verify_bounds
from keras_linattn.feature_maps import registry as feature_maps
from keras_linattn.layers import MixtureOfExperts
from keras_linattn.models import LinearBackbone, LinearCausalLM
from tests.models.test_quantize import _package_kernel_layers
from tests.tolerance import bound

pytestmark = pytest.mark.numeric

VOCAB, WIDTH, HEADS, T = 48, 32, 4, 11
MOE = [
    {"num_experts": 4, "top_k": 2, "expert_dim": 24},  # Mixtral: renormalized top-k
    {"num_experts": 4, "top_k": 2, "expert_dim": 24, "normalize_top_k": False, "shared_expert_dim": 20},  # Qwen MoE
]

# Float weights of rank >= 2 outside the feature maps that `quantize("int8")` keeps, by weight name.
KEPT_FLOAT = {
    "router_kernel": "the MoE router: a discrete top-k choice, which a rounding error would change",
    "conv_q": "short convolution taps [size, H, D]: a depthwise filter, no product over the width",
    "conv_k": "short convolution taps",
    "conv_v": "short convolution taps",
    "gate_kernel": "a recurrence's decay gate: it enters the float32 decay of every later step",
    "gate_down": "a recurrence's decay gate (low rank)",
    "gate_up": "a recurrence's decay gate (low rank)",
    "beta_kernel": "the delta rule's write strength: it enters the float32 state",
}


def _seed(seed=0):
    keras.utils.set_random_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _lm(num_layers=2, **kwargs):
    _seed()
    backbone = LinearBackbone(
        vocabulary_size=VOCAB,
        num_layers=num_layers,
        hidden_dim=WIDTH,
        num_heads=HEADS,
        intermediate_dim=2 * WIDTH,
        **kwargs,
    )
    lm = LinearCausalLM(backbone=backbone, preprocessor=None)
    lm(np.ones((1, 4), "int32"))
    return lm


def _moe_lm():
    return _lm(normalization="rms_norm", feedforward="gated", activation="silu", moe=MOE)


def _quantize(lm):
    """Quantizes `lm` to int8; returns the messages of the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm.quantize("int8")
    return [str(w.message) for w in caught]


def float_kernels(model):
    """``{reason: [paths]}`` of the float weights of rank >= 2; "not kept on purpose" lists the ones to fix.

    Every weight of `model.weights` is looked at: a float kernel that is
    none of `KEPT_FLOAT`'s, no feature map's weight, bias or scale lands
    under "not kept on purpose".
    """
    maps = [layer.path for layer in model._flatten_layers() if "FeatureMap" in type(layer).__name__]
    found = collections.defaultdict(list)
    for weight in {id(w): w for w in model.weights}.values():
        if len(weight.shape) < 2 or "float" not in str(weight.dtype):
            continue
        name = weight.path.rsplit("/", 1)[-1]
        if any(weight.path.startswith(p + "/") for p in maps):
            reason = "feature map"
        elif name.endswith("_scale"):
            reason = "quantization scale"
        elif name == "bias" or name.endswith("_bias"):
            reason = "bias"
        else:
            reason = KEPT_FLOAT.get(name, "not kept on purpose")
        found[reason].append(weight.path)
    return dict(found)


def _int8_paths(model):
    return {w.path for w in model.weights if str(w.dtype) == "int8"}


@pytest.fixture(scope="module")
def moe_lm():
    """``(float LM, int8 LM, warnings of quantize)``: the same weights before and after."""
    reference, lm = _moe_lm(), _moe_lm()
    return reference, lm, _quantize(lm)


def test_every_expert_kernel_of_the_moe_lm_is_int8_and_no_other_float_kernel_remains(moe_lm):
    _, lm, _ = moe_lm
    found = float_kernels(lm)
    assert "not kept on purpose" not in found, found["not kept on purpose"]
    # Two routers, one a block; the short convolution's three taps a block; nothing else.
    assert len(found["the MoE router: a discrete top-k choice, which a rounding error would change"]) == 2
    int8 = _int8_paths(lm)
    experts = {p for p in int8 if "/feedforward_experts/" in p}
    assert len(experts) == 3 + 3 + 4  # gate, up, down in each block; the second block's shared expert (4)
    assert len(int8) == len(experts) + 4 * 2 + 1  # q, k, v, o a block; the tied embedding
    moes = [layer for layer in lm._flatten_layers() if isinstance(layer, MixtureOfExperts)]
    assert len(moes) == 2 and {m.quantization_mode for m in moes} == {"int8"}


def test_no_warning_names_a_package_layer_with_a_kernel(moe_lm):
    reference, _, messages = moe_lm
    kernel_layers = _package_kernel_layers(reference)
    assert {"_ProjectionDense", "MixtureOfExperts"} <= kernel_layers  # the check covers the experts
    named = [m for m in messages for name in kernel_layers if f"Layer {name} " in m]
    assert not named


def _step_logits(lm, tokens):
    state = lm.get_initial_state(tokens.shape[0])
    logits = []
    for t in range(tokens.shape[1]):
        logit, state = lm.step(tokens[:, t], state)
        logits.append(np.asarray(logit))
    return np.stack(logits, axis=1)  # [B, T, V]


def test_step_matches_parallel_on_the_quantized_moe_lm(moe_lm):
    """Both forms round the same values to the same int8 grid: the float bound plus `quantized_term`."""
    _, lm, _ = moe_lm
    tokens = np.random.RandomState(1).randint(0, VOCAB, (2, T)).astype("int32")
    parallel = np.asarray(lm(tokens))
    stepped = _step_logits(lm, tokens)
    n = _verify_bounds._reduction_length(lm, T)
    float_bound = bound("float32", n, paths=2)
    n_q, eps_q = _verify_bounds.quantized_reduction(lm)
    # The experts' products count: top_k * (dim, dim, expert_dim) a block, and the shared expert's four.
    assert n_q >= 2 * 2 * (WIDTH + WIDTH + 24) + 3 * WIDTH + 20
    term = _verify_bounds.quantized_term(float_bound, n_q, eps_q)
    err = np.abs(stepped - parallel).max() / np.abs(parallel).max()
    assert err <= float_bound + term, (err, float_bound, term)


def test_the_quantized_moe_lm_saves_and_loads_bit_for_bit(moe_lm, tmp_path):
    _, lm, _ = moe_lm
    tokens = np.random.RandomState(5).randint(0, VOCAB, (2, T)).astype("int32")
    path = str(tmp_path / "int8_moe.keras")
    lm.save(path)
    loaded = keras.saving.load_model(path)
    assert _int8_paths(loaded) == _int8_paths(lm)
    np.testing.assert_array_equal(np.asarray(loaded(tokens)), np.asarray(lm(tokens)))
    token = tokens[:, 0]
    logits, _ = loaded.step(token, loaded.get_initial_state(2))
    want, _ = lm.step(token, lm.get_initial_state(2))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(want))


def test_a_linearized_qwen_moe_checkpoint_quantizes_every_expert_kernel(tmp_path):
    """The path users take: a keras-hub Qwen1.5-MoE teacher (shared expert, q/k/v biases) from a local
    checkpoint, linearized with a softmax window and hedgehog maps, then quantized."""
    import keras_linattn
    from tests.linearization import _hf_checkpoints as hf

    _seed()
    config = hf.small_moe("Qwen1.5-MoE-A2.7B")
    hf.write_checkpoint(tmp_path, config, hf.moe_tensors(config, attention_bias=True))
    student = keras_linattn.linearize(hf.load("QwenMoeCausalLM", str(tmp_path)), window_size=16)
    kernel_layers = _package_kernel_layers(student)
    messages = _quantize(student)
    assert "MixtureOfExperts" in kernel_layers
    assert not [m for m in messages for name in kernel_layers if f"Layer {name} " in m]
    found = float_kernels(student)
    assert "not kept on purpose" not in found, found["not kept on purpose"]
    assert "feature map" in found  # hedgehog's kernels, kept float
    experts = {p for p in _int8_paths(student) if "experts" in p}
    assert len(experts) == 7 * config["num_hidden_layers"]  # gate, up, down and the shared expert's four


@pytest.mark.parametrize("feature_map", sorted(feature_maps.available()))
def test_no_float_kernel_remains_under_any_feature_map(feature_map):
    lm = _lm(num_layers=1, feature_map=feature_map)
    messages = _quantize(lm)
    found = float_kernels(lm)
    assert "not kept on purpose" not in found, found["not kept on purpose"]
    assert len(_int8_paths(lm)) == 6 + 1  # q, k, v, o, two feed-forwards; the tied embedding
    assert not [m for m in messages for name in _package_kernel_layers(lm) if f"Layer {name} " in m]


def test_no_float_kernel_remains_in_a_dense_lm_with_lora_merged():
    from keras_linattn.linearization import enable_lora, merge_lora

    lm = _lm()
    enable_lora(lm, rank=2, alpha=4)
    merged = merge_lora(lm)
    _quantize(merged)
    found = float_kernels(merged)
    assert "not kept on purpose" not in found, found["not kept on purpose"]
    assert not [p for paths in found.values() for p in paths if "lora" in p]  # merged: no adapter left
    assert len(_int8_paths(merged)) == 6 * 2 + 1


@pytest.mark.parametrize(
    "mechanism", [{"decay": "scalar"}, {"decay": "channel"}, {"update": "delta", "normalize": False}]
)
def test_the_recurrences_gates_are_the_only_other_float_kernels(mechanism):
    lm = _lm(num_layers=1, **mechanism)
    _quantize(lm)
    found = float_kernels(lm)
    assert "not kept on purpose" not in found, found["not kept on purpose"]
    gates = {KEPT_FLOAT[k] for k in ("gate_kernel", "gate_down", "beta_kernel")}
    assert gates & set(found)  # the mechanism's gate is there, and kept on purpose


@pytest.mark.slow
def test_the_quantized_moe_lm_exports_int8_products_and_passes_verify(moe_lm, tmp_path):
    import onnx

    from keras_linattn import export

    _, lm, _ = moe_lm
    version_dir = export.export_saved_model(lm, str(tmp_path / "sm"), warmup=False)
    paths = export.export_onnx(lm, str(tmp_path / "lm.onnx"))
    report = export.verify(lm, saved_model_dir=version_dir, onnx_path=paths["model"], decode_steps=3)
    assert report.ok
    for kind in ("model", "step"):
        graph = onnx.load(paths[kind]).graph
        readers = collections.defaultdict(list)
        for node in graph.node:
            for name in node.input:
                readers[name].append(node)
        experts = [i.name for i in graph.initializer if i.data_type == onnx.TensorProto.INT8 and "experts" in i.name]
        assert len(experts) == 3 + 3 + 4, (kind, experts)
        for name in experts:  # through shape ops and the step's gather of the picked experts, to integer products
            consumers, frontier = set(), [name]
            while frontier:
                for node in readers[frontier.pop()]:
                    if node.op_type in ("Reshape", "Transpose", "Identity", "Squeeze", "Unsqueeze", "Gather"):
                        frontier.extend(node.output)
                    else:
                        consumers.add(node.op_type)
            assert consumers == {"MatMulInteger"}, (kind, name, consumers)
