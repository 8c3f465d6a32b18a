"""`generate_jit_compile`: XLA or a plain `tf.function` for generate, the same tokens either way."""

import keras
import numpy as np
import pytest

from keras_linattn.models import LinearCausalLM, _generate_compile

pytestmark = pytest.mark.tf_only("tf.function / XLA choice of the TensorFlow backend")


def _lm():
    keras.utils.set_random_seed(0)
    lm = LinearCausalLM(vocabulary_size=30, num_layers=1, hidden_dim=8, num_heads=2, intermediate_dim=16)
    lm(np.zeros((1, 4), "int32"))
    return lm


def test_auto_picks_xla_on_a_cpu_for_small_models_only(monkeypatch):
    lm = _lm()
    assert lm.generate_jit_compile == "auto"
    assert _generate_compile.generate_uses_xla(lm)  # a few KB of weights, no GPU here
    monkeypatch.setattr(_generate_compile, "XLA_CPU_WEIGHT_BYTES", 0)
    assert not _generate_compile.generate_uses_xla(lm)
    lm.generate_jit_compile = True
    assert _generate_compile.generate_uses_xla(lm)
    lm.generate_jit_compile = False
    assert not _generate_compile.generate_uses_xla(lm)


def test_the_compiled_functions_follow_the_choice_and_give_the_same_tokens():
    lm = _lm()
    prompt = np.random.default_rng(0).integers(0, 30, size=(2, 5)).astype("int32")
    tokens = {}
    for jit in (True, False):
        lm.generate_jit_compile = jit
        lm._generation.functions.clear()
        tokens[jit] = np.asarray(lm.generate(prompt, max_length=12, stop_token_ids=None))
        prefill, decode = lm._generate_functions()
        assert prefill._jit_compile is jit and decode._jit_compile is jit
    np.testing.assert_array_equal(tokens[True], tokens[False])


def test_a_bad_choice_is_refused():
    lm = _lm()
    lm.generate_jit_compile = "yes"
    lm._generation.functions.clear()
    with pytest.raises(ValueError, match="generate_jit_compile"):
        lm.generate(np.zeros((1, 3), "int32"), max_length=5, stop_token_ids=None)
