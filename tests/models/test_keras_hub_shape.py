"""LinearBackbone / LinearCausalLM / LinearCausalLMPreprocessor as keras-hub models.

Presets, string prompts, keras-hub samplers, compile settings restored from
`.keras`, keras-hub's input dicts in `fit`, the backbone under another head,
and `import keras_linattn` without keras_hub.
"""

import os
import subprocess
import sys

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn.models import LinearBackbone, LinearCausalLM, LinearCausalLMPreprocessor
from tests.tolerance import assert_close

SMALL = dict(vocabulary_size=None, num_layers=2, hidden_dim=16, num_heads=2, intermediate_dim=32)


def _byte_to_unicode():
    """GPT-2's map from bytes to printable characters (its byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def char_tokenizer():
    """A keras-hub `GPT2Tokenizer` with one token per byte and ``<|endoftext|>`` = 0.

    keras-hub's BPE needs at least one merge: the one given joins the bytes
    0x00 and 0x01, which no test text holds.
    """
    vocabulary = {"<|endoftext|>": 0}
    for i, ch in enumerate(_byte_to_unicode().values()):
        vocabulary[ch] = i + 1
    pair = _byte_to_unicode()[0] + _byte_to_unicode()[1]
    vocabulary[pair] = len(vocabulary)
    return keras_hub.tokenizers.GPT2Tokenizer(vocabulary=vocabulary, merges=[" ".join(pair)])


def _lm(preprocessor=None, **kwargs):
    keras.utils.set_random_seed(0)
    config = dict(SMALL, vocabulary_size=258)
    config.update(kwargs)
    backbone = LinearBackbone(**config)
    return LinearCausalLM(backbone, preprocessor=preprocessor)


def _ids(batch=2, length=12, vocab=258, seed=0):
    return np.random.default_rng(seed).integers(1, vocab, (batch, length)).astype("int32")


def test_flat_constructor_builds_the_same_model_as_backbone_plus_task():
    keras.utils.set_random_seed(0)
    flat = LinearCausalLM(**dict(SMALL, vocabulary_size=258))
    split = _lm()
    assert isinstance(flat.backbone, LinearBackbone)
    assert [w.shape for w in flat.weights] == [w.shape for w in split.weights]
    ids = _ids()
    assert_close(np.asarray(flat(ids)), np.asarray(split(ids)), paths=1, n=16)


def test_logits_are_the_head_on_the_backbone_output():
    lm = _lm()
    ids = _ids()
    hidden = np.asarray(lm.backbone(ids), "float64")  # [B, T, dim]
    table = np.asarray(lm.backbone.token_embedding.embeddings, "float64")  # [V, dim]
    want = hidden @ table.T
    assert_close(np.asarray(lm(ids)), want, paths=2, n=16)


def test_preset_round_trip_gives_a_linear_causal_lm_with_equal_logits_and_state(tmp_path):
    lm = _lm(preprocessor=LinearCausalLMPreprocessor(char_tokenizer(), sequence_length=16))
    preset = str(tmp_path / "preset")
    lm.save_to_preset(preset)
    loaded = keras_hub.models.CausalLM.from_preset(preset)
    assert type(loaded) is LinearCausalLM
    assert type(loaded.preprocessor) is LinearCausalLMPreprocessor
    ids = _ids()
    np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(lm(ids)))
    _, state = lm.call_with_state(ids, lm.get_initial_state(2))
    _, state2 = loaded.call_with_state(ids, loaded.get_initial_state(2))
    for a, b in zip(state, state2, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    backbone = keras_hub.models.Backbone.from_preset(preset)
    assert type(backbone) is LinearBackbone
    np.testing.assert_array_equal(np.asarray(backbone(ids)), np.asarray(lm.backbone(ids)))


def test_string_prompts_generate_strings():
    lm = _lm(preprocessor=LinearCausalLMPreprocessor(char_tokenizer(), sequence_length=24))
    out = lm.generate(["def f(x):", "import"], max_length=20, stop_token_ids=None)
    assert isinstance(out, list) and len(out) == 2
    assert out[0].startswith("def f(x):") and out[1].startswith("import")
    # The continuation is the model's greedy decode of the token-id prompts.
    packed = lm.preprocessor.generate_preprocess(["def f(x):", "import"])
    ids = lm.generate(packed["token_ids"], max_length=20, padding_mask=packed["padding_mask"], stop_token_ids=None)
    byte_of = {ch: b for b, ch in _byte_to_unicode().items()}
    inverse = {v: k for k, v in lm.preprocessor.tokenizer.vocabulary.items()}
    for row, text in zip(ids, out, strict=True):
        mask = row != 0  # left padding and the start token (id 0) are not text
        want = bytes(byte_of[inverse[int(t)]] for t in row[mask]).decode("utf-8", errors="replace")
        assert text == want
    single = lm.generate("import", max_length=12, stop_token_ids=None)
    assert isinstance(single, str) and single == lm.generate(["import"], max_length=12, stop_token_ids=None)[0]
    stripped = lm.generate(["import"], max_length=12, stop_token_ids=None, strip_prompt=True)[0]
    assert single == "import" + stripped


def test_string_prompts_need_a_preprocessor():
    with pytest.raises(ValueError, match="preprocessor"):
        _lm().generate(["abc"], max_length=8)


def test_keras_hub_top_k_sampler_draws_within_the_top_k():
    lm = _lm()
    lm.compile(sampler=keras_hub.samplers.TopKSampler(k=5, seed=1))
    prompt = _ids(batch=3, length=4)
    out = lm.generate(prompt, max_length=16, stop_token_ids=None)
    assert out.shape == (3, 16)
    np.testing.assert_array_equal(out[:, :4], prompt)
    logits = np.asarray(lm(out))  # logits[:, t] predict token t + 1
    ranks = (logits[:, 3:-1] > np.take_along_axis(logits[:, 3:-1], out[:, 4:, None], axis=-1)).sum(-1)
    assert ranks.max() < 5, ranks
    greedy = lm.generate(prompt, max_length=16, sampler="greedy", stop_token_ids=None)
    assert (out != greedy).any()  # it samples, not argmax


def test_search_samplers_are_refused_clearly():
    with pytest.raises(ValueError, match="BeamSampler"):
        _lm().compile(sampler=keras_hub.samplers.BeamSampler(num_beams=2))


def test_fit_takes_keras_hub_dicts_and_padding_masks():
    lm = _lm(num_layers=1)  # one block: the fit path is the same, its trace half as long
    lm.compile(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ids = _ids(batch=4, length=10)
    mask = np.ones_like(ids)
    mask[:2, :3] = 0  # two left-padded rows
    history = lm.fit({"token_ids": ids, "padding_mask": mask}, ids, sample_weight=mask, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    # The padding mask reaches the model: junk under the padding changes nothing.
    junk = ids.copy()
    junk[:2, :3] = 7
    np.testing.assert_array_equal(
        np.asarray(lm({"token_ids": ids, "padding_mask": mask}))[:2, 3:],
        np.asarray(lm({"token_ids": junk, "padding_mask": mask}))[:2, 3:],
    )


def test_a_tuple_input_gets_a_clear_error():
    with pytest.raises(ValueError, match="tuple is ambiguous"):
        _lm()((_ids(), np.ones((2, 12), "int32")))


def test_fit_on_strings_through_the_preprocessor():
    pre = LinearCausalLMPreprocessor(char_tokenizer(), sequence_length=16)
    lm = _lm(preprocessor=pre, num_layers=1)  # one block: the fit path is the same, its trace half as long
    lm.compile(optimizer=keras.optimizers.Adam(1e-2))
    text = ["def f(x):\n    return x", "import os", "for i in range(3):", "x = 1"]
    # A repeated string dataset with steps_per_epoch: fit maps the preprocessor over it and makes its
    # iterator once (a list of strings gets a new iterator, and the tokenizer's set-up, every epoch).
    strings = tf.data.Dataset.from_tensor_slices(text).batch(2).repeat()
    history = lm.fit(strings, steps_per_epoch=2, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_preprocessor_pads_on_the_left_and_weights_real_targets_only():
    pre = LinearCausalLMPreprocessor(char_tokenizer(), sequence_length=8)
    x, y, w = pre(["ab", "abcdef"])
    ids, mask, y, w = (np.asarray(t) for t in (x["token_ids"], x["padding_mask"], y, w))
    a, b = np.asarray(pre.tokenizer("a"))[0], np.asarray(pre.tokenizer("b"))[0]
    # "ab": [pad x4] [start a b end] -> x = 8 first ids, y = 8 last ids.
    np.testing.assert_array_equal(ids[0], [0, 0, 0, 0, 0, 0, a, b])
    np.testing.assert_array_equal(mask[0].astype(int), [0, 0, 0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(y[0], [0, 0, 0, 0, 0, a, b, 0])
    np.testing.assert_array_equal(w[0].astype(int), [0, 0, 0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(w[1].astype(int), [0, 1, 1, 1, 1, 1, 1, 1])  # start + 6 + end = 8 of 9
    packed = pre.generate_preprocess(["ab", "abcdef"])
    assert packed["token_ids"].shape == (2, 7)  # start + the longest prompt
    np.testing.assert_array_equal(packed["padding_mask"][0], [0, 0, 0, 0, 1, 1, 1])


def test_keras_reload_restores_compile_and_fit_continues_with_the_same_loss(tmp_path):
    lm = _lm(num_layers=1)  # one block: the fit path is the same, its trace half as long
    lm.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sampler=keras_hub.samplers.TopKSampler(k=3, seed=2),
    )
    ids = _ids(batch=4, length=10)
    lm.fit(ids[:, :-1], ids[:, 1:], epochs=2, verbose=0, shuffle=False)
    path = str(tmp_path / "lm.keras")
    lm.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is LinearCausalLM
    assert isinstance(loaded.sampler, keras_hub.samplers.TopKSampler) and loaded.sampler.k == 3
    assert loaded.optimizer.iterations.numpy() == lm.optimizer.iterations.numpy()
    after = lm.fit(ids[:, :-1], ids[:, 1:], epochs=1, verbose=0, shuffle=False).history["loss"][0]
    after_loaded = loaded.fit(ids[:, :-1], ids[:, 1:], epochs=1, verbose=0, shuffle=False).history["loss"][0]
    assert_close(after_loaded, after, paths=2, n=10 * 258)
    for a, b in zip(lm.weights, loaded.weights, strict=True):
        assert_close(np.asarray(b), np.asarray(a), paths=2, n=64)


def test_keras_reload_of_an_uncompiled_round2_style_model_warns_nothing(tmp_path):
    import warnings

    lm = _lm()
    path = str(tmp_path / "lm.keras")
    lm.save(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.saving.load_model(path)
    messages = [str(w.message) for w in caught if "compile" in str(w.message) or "Skipping" in str(w.message)]
    assert messages == []
    ids = _ids()
    np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(lm(ids)))


def test_backbone_under_another_head():
    keras.utils.set_random_seed(0)
    backbone = LinearBackbone(**dict(SMALL, vocabulary_size=50))
    ids = _ids(batch=4, length=8, vocab=50)
    hidden = backbone({"token_ids": ids, "padding_mask": np.ones_like(ids)})  # [B, T, dim]
    head = keras.layers.Dense(3)
    classifier_logits = head(hidden[:, -1])  # a classifier on the last position
    assert classifier_logits.shape == (4, 3)
    lm = LinearCausalLM(backbone)
    assert_close(np.asarray(lm.backbone(ids)), np.asarray(hidden), paths=1, n=16)


def test_import_keras_linattn_does_not_import_keras_hub(tmp_path):
    saved = str(tmp_path / "lm.keras")
    _lm().save(saved)
    code = (
        "import sys, keras, keras_linattn, keras_linattn.layers, keras_linattn.ops, keras_linattn.export;"
        "assert 'keras_hub' not in sys.modules, 'keras_hub imported';"
        # Linearizing a plain Keras model does not import it either (as
        # tests/linearization/test_linearize.py::test_import_does_not_load_keras_hub, one process for both).
        "inputs = keras.Input((4, 8));"
        "mha = keras.Model(inputs, keras.layers.MultiHeadAttention(2, 4)(inputs, inputs, use_causal_mask=True));"
        "keras_linattn.linearize(mha, window_size=4);"
        "assert 'keras_hub' not in sys.modules, 'keras_hub imported by linearize';"
        # A saved LM loads without importing keras_linattn.models first (it is imported then).
        f"lm = keras.saving.load_model({saved!r});"
        "assert 'keras_hub' in sys.modules;"
        "from keras_linattn.models import LinearCausalLM;"
        "assert isinstance(lm, LinearCausalLM), type(lm)"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    root = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, cwd=root
    )
    assert result.returncode == 0, result.stderr[-2000:]
