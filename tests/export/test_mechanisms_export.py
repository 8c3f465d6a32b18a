"""The recall mechanisms through the one decode contract: SavedModel and ONNX parity, identical tokens.

Every mechanism's decode state (decayed (S, z), convolution buffers, window
buffers) goes through the exported ``step``/``generate`` signatures and the
ONNX generate graph, derived from `state_spec`. One combined configuration
runs in the default suite: Based's taylor map with a convolution and a window
(every buffer kind in the state) plus what a linearized Llama needs (RoPE: a
position in each block's state; GQA; the window's gamma) and the window's
options for length past training. Each mechanism alone is `slow`: each
configuration is one SavedModel and one ONNX export, the costliest setup of
the suite.
"""

import keras
import numpy as np
import pytest

from keras_linattn import export, feature_maps, samplers
from keras_linattn.models import LinearCausalLM

VOCAB = 48
# The export target: parity within 1e-4 of Keras.
PARITY = 1e-4
# verify's inputs: lengths past several chunks (4), windows, convolution taps and both sides of a
# chunk boundary (verify's default adds a length of 70, which reaches no other code path).
SHAPES = [(1, 7), (3, 13), (2, 30)]

CONFIGS = {
    "based": dict(feature_map="taylor", key_dim=4, conv_size=3, window_size=4),
    "scalar_conv": dict(decay="scalar", conv_size=4),
    "fixed": dict(decay="fixed"),
    "channel_unnormalized": dict(decay="channel", normalize=False),
    "window_elu": dict(window_size=6),
    "gated_delta_conv": dict(update="delta", normalize=False, decay="scalar", conv_size=4, feature_map=None),
    # What a linearized Llama needs: RoPE (a position in each block's state), GQA, the window's gamma.
    "pretrained": dict(
        feature_map=feature_maps.get("hedgehog", share_qk=False),
        window_size=4,
        window_gamma=0.1,
        num_key_value_heads=1,
        rope_max_wavelength=10000,
    ),
}
# The window's options for length past training: an unrotated-key buffer and an older-key count.
CONFIGS["pretrained_length"] = dict(CONFIGS["pretrained"], linear_rope=False, linear_mean=True)
CONFIGS["based_pretrained"] = dict(CONFIGS["based"], window_gamma=0.1, num_key_value_heads=1, rope_max_wavelength=10000)
# Every buffer kind at once: Based's, a linearized Llama's layout (GQA buffers of one key/value head)
# and the window's length options (the unrotated-key buffer, the older-key count).
CONFIGS["based_pretrained_length"] = dict(CONFIGS["based_pretrained"], linear_rope=False, linear_mean=True)
# In `make test`: the one combination (one export); each configuration alone in `make test-slow`.
FAST = {"based_pretrained_length"}


def _params():
    return [pytest.param(name, marks=() if name in FAST else pytest.mark.slow) for name in CONFIGS]


@pytest.fixture(scope="module", params=_params())
def exported(request, tmp_path_factory):
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(1234)
    # One block: every buffer kind of a mechanism lives in each block's state; several
    # blocks in one state are exported by the shared tiny LM (tests/_shared_exports.py).
    lm = LinearCausalLM(
        vocabulary_size=VOCAB,
        num_layers=1,
        hidden_dim=16,
        num_heads=2,
        intermediate_dim=32,
        chunk_size=4,
        **CONFIGS[request.param],
    )
    # Logits spread well apart (the default init gives near-ties that any
    # rounding difference can flip): deterministic weights of scale 0.5.
    rng = np.random.default_rng(7)
    for w in lm.trainable_weights:
        w.assign((rng.standard_normal(w.shape) * 0.5).astype(w.dtype))
    out = tmp_path_factory.mktemp(f"mech_{request.param}")
    version_dir = export.export_saved_model(lm, str(out / "sm"))
    paths = export.export_onnx(lm, str(out / "lm.onnx"))
    return request.param, lm, version_dir, paths


def test_parity_within_the_target(exported):
    name, lm, version_dir, paths = exported
    report = export.verify(
        lm,
        saved_model_dir=version_dir,
        onnx_path=paths["model"],
        onnx_step_path=paths["step"],
        shapes=SHAPES,
        saved_model_tolerance=PARITY,
        onnx_tolerance=PARITY,
        raise_on_failure=False,
    )
    assert report.ok, report.table()
    checked = {(r.backend, r.signature.split(":")[0]) for r in report.rows}
    assert checked >= {
        ("saved_model", "serving_default"),
        ("saved_model", "step"),
        ("saved_model", "generate"),
        ("onnx", "serving_default"),
        ("onnx", "step"),
    }, checked
    assert max(r.max_rel for r in report.rows if not r.exact) <= PARITY


def test_keras_saved_model_and_onnx_give_identical_tokens(exported):
    name, lm, version_dir, paths = exported
    rng = np.random.default_rng(3)
    prompt = rng.integers(1, VOCAB, size=(3, 6)).astype("int32")
    mask = np.ones_like(prompt)
    mask[1, :2] = 0  # a left-padded row
    prompt[1, :2] = 0
    runner = export.SavedModelRunner(version_dir)
    generator = export.OnnxGenerator(paths["step"], device="cpu")
    for sampler in (samplers.get("greedy"), samplers.get("top_k", k=5, temperature=0.9)):
        keras_ids = lm.generate(prompt, max_length=16, sampler=sampler, seed=11, padding_mask=mask)
        feeds = {"prompt_ids": prompt, "padding_mask": mask, "max_length": np.int32(16)}
        if isinstance(sampler, samplers.GreedySampler):
            sm_ids = runner.run("generate", feeds)["output_ids"]
        else:
            temperature, top_k, top_p = sampler.sampling_params()
            feeds.update(
                temperature=np.float32(temperature), top_k=np.int32(top_k), top_p=np.float32(top_p), seed=np.int64(11)
            )
            sm_ids = runner.run("generate_sampled", feeds)["output_ids"]
        onnx_ids = generator.generate(prompt, max_length=16, sampler=sampler, seed=11, padding_mask=mask)
        np.testing.assert_array_equal(sm_ids, keras_ids, err_msg=f"{name}: SavedModel vs Keras")
        np.testing.assert_array_equal(np.asarray(onnx_ids), keras_ids, err_msg=f"{name}: ONNX vs Keras")
