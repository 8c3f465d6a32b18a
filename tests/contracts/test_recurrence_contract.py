"""The contract battery: every registered recurrence, through the same checks.

Parametrized over `keras_linattn.recurrences.available()` (built-ins and
whatever else is registered when the tests are collected, such as the
test-only `scratch_fixed_decay` of tests/contracts/scratch_recurrence.py)
and each class's `contract_configs`. Every other case runs with a short
convolution, so that both pipelines (with and without it) meet every
recurrence. The checks:

- outputs and gradients (input and every weight) against a float64 oracle
  composed from the stages' hooks (`ShortConvolution.oracle`,
  `Recurrence.oracle`, the output norm in float64);
- step == parallel, two pieces chained through the state == one pass, and
  a left-padded row == the same tokens unpadded;
- XLA == eager; mixed bfloat16 close to float32 with a float32 state;
- `.keras` round trip (safe mode) with identical outputs;
- SavedModel and ONNX parity and identical tokens for an LM built on the
  recurrence (slow, except the test-only recurrence: the fast twin, which
  also shows that a plug-in exports with no edit to the package).
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_linattn import recurrences
from keras_linattn.layers import LinearAttention
from keras_linattn.ops.core import _mask_keys
from tests._backend import xla
from tests._helpers import _outputs_and_gradients
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric

DIM, HEADS, KEY_DIM, T, CHUNK, CONV = 16, 2, 8, 11, 4, 3
# Every recurrence with the seed map (elu): the contract is the recurrence's, not the default map's.
MAP = "elu"
FAST_EXPORT = {"scratch_fixed_decay"}


def _cases():
    cases = []
    for name in recurrences.available():
        for i, config in enumerate(recurrences.get_class(name).contract_configs):
            cases.append((name, config, CONV if len(cases) % 2 else None, f"{name}-{i}"))
    return cases


CASES = _cases()
IDS = [case[-1] for case in CASES]


def _recurrence(case):
    name, config, _, _ = case
    return recurrences.get(name, **config)


def _layer(case, **extra):
    extra = {"feature_map": MAP, **extra}
    layer = LinearAttention(HEADS, KEY_DIM, chunk_size=CHUNK, recurrence=_recurrence(case), conv_size=case[2], **extra)
    layer.build((None, None, DIM), (None, None, DIM))
    # Weights that start at zero (data-independent gates, biases) get values,
    # so that every data-dependent path is exercised.
    rng = np.random.default_rng(1)
    for w in layer.weights:
        if not np.asarray(w).any():
            w.assign(0.3 * rng.normal(size=w.shape))
    return layer


def _inputs(rng, batch=2, t=T):
    x = rng.normal(size=(batch, t, DIM)).astype("float32")
    mask = np.ones((batch, t), bool)
    mask[1, :3] = False  # a left-padded row
    return x, mask


def _n(layer):
    """Terms of the longest sum: T keys, C features, D key dims, K taps, H * M outputs."""
    return T + layer.feature_dim + KEY_DIM + (layer.conv_size or 0) + HEADS * layer.value_dim


def _oracle(layer, x, mask):
    """Projections, then the stages' float64 hooks, then the output projection."""
    q, k, v = layer.project(x, x)
    keep = ops.convert_to_tensor(mask)
    k = _mask_keys(k, keep)
    gate_keys = k
    q, k, v = layer.short_conv.oracle(q, k, v, keep)
    att = layer.recurrence.oracle(q, k, v, gate_keys, keep)
    att = ops.cast(layer.output_norm(ops.cast(att, "float64"), "float64"), "float32")
    return layer.output_dense(att)


def test_the_registry_holds_the_built_ins_and_the_test_only_recurrence():
    assert {"additive", "decay", "delta", "window", "scratch_fixed_decay"} <= set(recurrences.available())
    assert "scratch_fixed_decay" in {case[0] for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_outputs_and_gradients_match_the_float64_oracle(rng, case):
    layer = _layer(case)
    x, mask = _inputs(rng)
    weights = layer.trainable_variables
    out, grads = _outputs_and_gradients(lambda x_: layer(x_, x_, key_mask=mask, use_causal_mask=True), x, weights)
    ref, ref_grads = _outputs_and_gradients(lambda x_: _oracle(layer, x_, mask), x, weights)
    n = _n(layer)
    # Chunked exponents are differences of float32 cumulative log decays.
    conditioning = layer.recurrence.conditioning(layer.project(x, x)[1])
    assert_close(out, ref, n=n, conditioning=conditioning, what="outputs")
    assert_close(grads, ref_grads, n=2 * n + DIM, conditioning=conditioning, what="gradients")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_step_pieces_and_padding_equal_one_pass(rng, case):
    layer = _layer(case)
    x, mask = _inputs(rng)
    full, state = layer(x, x, key_mask=mask, use_causal_mask=True, return_state=True)
    spec = layer.state_spec()
    assert len(state) == len(spec)
    for entry, part in zip(spec, state, strict=True):
        assert tuple(part.shape) == (2,) + tuple(entry.shape) and part.dtype == "float32", entry.name
    n = _n(layer)
    a, st = layer(x[:, :5], x[:, :5], key_mask=mask[:, :5], use_causal_mask=True, return_state=True)
    b, st2 = layer(x[:, 5:], x[:, 5:], key_mask=mask[:, 5:], use_causal_mask=True, return_state=True, initial_state=st)
    assert_close(np.concatenate([a, b], 1), full, n=n, paths=2, what="pieces")
    for entry, p, q in zip(spec, st2, state, strict=True):
        assert_close(p, q, n=T, paths=2, what=f"state {entry.name}")
    s = layer.get_initial_state(1)
    outs = []
    for t in range(T):
        o, s = layer.step(x[:1, t], x[:1, t], s)
        outs.append(np.asarray(o))
    assert_close(np.stack(outs, 1), np.asarray(full)[:1], n=n, paths=2, what="steps")
    unpadded = layer(x[1:, 3:], x[1:, 3:], use_causal_mask=True)
    assert_close(np.asarray(full)[1:, 3:], unpadded, n=n, paths=2, what="left padding")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_xla_matches_eager(rng, case):
    layer = _layer(case)
    x, mask = _inputs(rng)
    eager = layer(x, x, key_mask=mask, use_causal_mask=True)
    compiled = xla(lambda a, m: layer(a, a, key_mask=m, use_causal_mask=True))(x, mask)
    assert_close(compiled, eager, n=_n(layer), paths=2, what="XLA vs eager")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_mixed_bfloat16_is_close_to_float32_with_a_float32_state(rng, case):
    ref = _layer(case)
    x, mask = _inputs(rng)
    expected = ref(x, x, key_mask=mask, use_causal_mask=True)
    keras.config.set_dtype_policy("mixed_bfloat16")
    layer = _layer(case)
    for w_ref, w in zip(ref.weights, layer.weights, strict=True):
        w.assign(w_ref)
    out, state = layer(x, x, key_mask=mask, use_causal_mask=True, return_state=True)
    assert all(part.dtype == "float32" for part in state)
    n = DIM + _n(layer)
    conditioning = ref.recurrence.conditioning(ref.project(x, x)[1])
    assert_close(out, expected, n=n, dtype="bfloat16", conditioning=conditioning, what="bf16 vs float32")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_keras_round_trip(rng, tmp_path, case):
    inp = keras.Input((None, DIM))
    layer = LinearAttention(
        HEADS, KEY_DIM, feature_map=MAP, chunk_size=CHUNK, recurrence=_recurrence(case), conv_size=case[2]
    )
    model = keras.Model(inp, layer(inp, inp, use_causal_mask=True))
    x, _ = _inputs(rng)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)  # safe_mode=True
    np.testing.assert_array_equal(loaded(x), model(x))
    restored = loaded.layers[-1]
    assert type(restored.recurrence) is type(layer.recurrence)
    assert restored.recurrence.get_config() == layer.recurrence.get_config()
    assert [e.name for e in restored.state_spec()] == [e.name for e in layer.state_spec()]


# ------------------------------------------------------------------ export
VOCAB = 48
PARITY = 1e-4  # the export target: parity within 1e-4 of Keras
# verify's inputs: lengths past several chunks (4), convolution taps and both sides of a chunk
# boundary (verify's default adds a length of 70, which reaches no other code path).
EXPORT_SHAPES = [(1, 7), (3, 13), (2, 30)]


def _export_params():
    return [pytest.param(case, id=case[-1], marks=() if case[0] in FAST_EXPORT else pytest.mark.slow) for case in CASES]


@pytest.mark.parametrize("case", _export_params())
def test_saved_model_and_onnx_parity_and_identical_tokens(tmp_path, case):
    from keras_linattn import export, samplers
    from keras_linattn.models import LinearCausalLM

    keras.utils.set_random_seed(1234)
    lm = LinearCausalLM(
        vocabulary_size=VOCAB,
        num_layers=1,
        hidden_dim=DIM,
        num_heads=HEADS,
        intermediate_dim=32,
        chunk_size=CHUNK,
        recurrence=recurrences.serialize(_recurrence(case)),
        feature_map=MAP,
        conv_size=case[2],
    )
    rng = np.random.default_rng(7)
    for w in lm.trainable_weights:  # logits spread well apart: no near-ties for rounding to flip
        w.assign((rng.standard_normal(w.shape) * 0.5).astype(w.dtype))
    version_dir = export.export_saved_model(lm, str(tmp_path / "sm"))
    paths = export.export_onnx(lm, str(tmp_path / "lm.onnx"))
    report = export.verify(
        lm,
        saved_model_dir=version_dir,
        onnx_path=paths["model"],
        onnx_step_path=paths["step"],
        shapes=EXPORT_SHAPES,
        saved_model_tolerance=PARITY,
        onnx_tolerance=PARITY,
        raise_on_failure=False,
    )
    assert report.ok, report.table()
    prompt = rng.integers(1, VOCAB, size=(2, 5)).astype("int32")
    mask = np.ones_like(prompt)
    mask[1, :2] = 0
    prompt[1, :2] = 0
    greedy = samplers.get("greedy")
    keras_ids = lm.generate(prompt, max_length=12, sampler=greedy, padding_mask=mask)
    feeds = {"prompt_ids": prompt, "padding_mask": mask, "max_length": np.int32(12)}
    sm_ids = export.SavedModelRunner(version_dir).run("generate", feeds)["output_ids"]
    onnx_ids = export.OnnxGenerator(paths["step"], device="cpu").generate(
        prompt, max_length=12, sampler=greedy, padding_mask=mask
    )
    np.testing.assert_array_equal(sm_ids, keras_ids, err_msg="SavedModel vs Keras")
    np.testing.assert_array_equal(np.asarray(onnx_ids), keras_ids, err_msg="ONNX vs Keras")
