"""SavedModel export: signatures, TF Serving layout, warmup, decoding, errors.

The SavedModel is always run through `SavedModelRunner` (TF1 loader +
Session, the path of TF Serving and `saved_model_cli run`) and compared with
the Keras model run here, on shapes never seen at export time.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_linattn as kla
from keras_linattn import export
from keras_linattn import feature_maps as fmaps
from keras_linattn.feature_maps.random_features import RandomFeatureMap
from keras_linattn.models import LinearCausalLM
from tests import _shared_exports
from tests._helpers import layer_conditioning
from tests.tolerance import assert_close, bound

SAVED_MODEL_CLI = os.path.join(os.path.dirname(sys.executable), "saved_model_cli")
DIM = 16
CHUNK = 4
# (batch, length): none seen at export; 7, 13 and 30 are not multiples of CHUNK.
SHAPES = [(1, 7), (3, 13), (2, 30)]
FAST_MAPS = ("elu", "favor+", "ffn")
HEADS, KEY_DIM = 2, 8  # of the encoder's attention


def seeded_feature_map(name, seed):
    """A registered map; random-feature maps (favor+, favor_trig) get an explicit seed
    (unseeded, they draw their projection from OS entropy)."""
    fm = fmaps.get(name)
    return fmaps.get(name, seed=seed) if isinstance(fm, RandomFeatureMap) else fm


def encoder(feature_map, causal, seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((None, DIM), name="features")
    x = kla.layers.LinearAttention(
        HEADS, KEY_DIM, feature_map=seeded_feature_map(feature_map, seed), chunk_size=CHUNK, name="attention"
    )(inp, inp, use_causal_mask=causal)
    x = keras.layers.LayerNormalization(name="norm")(x + inp)
    out = keras.layers.Dense(5, name="head")(x)
    return keras.Model(inp, out, name="encoder")


def tiny_lm(feature_map="elu", seed=0):
    keras.utils.set_random_seed(seed)
    return LinearCausalLM(
        vocabulary_size=40,
        num_layers=2,
        hidden_dim=16,
        num_heads=2,
        intermediate_dim=32,
        chunk_size=CHUNK,
        feature_map=seeded_feature_map(feature_map, seed),
        # No short convolution: the exports' expectations are every layer's (S, z) then the position.
        conv_size=None,
    )


# ------------------------------------------------- error model of the exports
# An export and Keras are two float32 computations of the same function (the
# ONNX graph runs other kernels): paths=2, n = the reduction lengths of the
# model on its longest path (docs/dev/testing.md).
def feature_map_reduction(fm, key_dim):
    """Length of the reductions inside a feature map applied to ``key_dim``-vectors."""
    if isinstance(fm, (fmaps.EluFeatureMap, fmaps.ReluFeatureMap, fmaps.TaylorFeatureMap)):
        return 0  # elementwise (taylor: products of entries, no sums)
    c = fm.feature_dim(key_dim)
    if isinstance(fm, fmaps.HedgehogFeatureMap):
        return key_dim + c // 2  # projection over D, then the softmax normalizer over F = C / 2
    if isinstance(fm, RandomFeatureMap):
        return key_dim  # w . x over D (|x|^2 over D runs beside it)
    depth = fm.depth  # trainable stacks: the first unit reduces over D, the next ones over C
    rank = fm.gate_rank(c) if isinstance(fm, fmaps.AOGLUFeatureMap) else 0  # low-rank gate (u A) B adds r
    return key_dim + (depth - 1) * c + depth * rank


def attention_terms(att, length):
    """Reduction length through a `LinearAttention` on ``length`` keys, without its input projection."""
    fm = att.feature_map
    return (
        feature_map_reduction(fm, att.key_dim)
        + length
        + fm.feature_dim(att.key_dim)  # attention over S keys and C features
        + att.num_heads * att.value_dim  # output projection over H * M
    )


def encoder_tolerance(model, x, causal):
    """``n`` and ``conditioning`` of `encoder`'s outputs on ``x [B, S, DIM]``."""
    att = model.get_layer("attention")
    n = (
        DIM  # input projections over the DIM features
        + attention_terms(att, x.shape[1])
        + 2 * DIM  # LayerNorm: mean, then variance, over DIM
        + DIM  # head Dense over DIM
    )
    return {"n": n, "conditioning": layer_conditioning(att, x, x, causal=causal)}


def lm_tolerance(model, ids):
    """``n`` and ``conditioning`` of a `LinearCausalLM`'s logits on ``ids [B, S]``.

    The conditioning is the product of the blocks' normalizer conditionings
    (each block's error is amplified by the later ones); 1 for positive maps.
    """
    d, n, conditioning = model.hidden_dim, 0, 1.0
    x = model.token_embedding(ids)  # [B, S, d]; no position embedding in these models
    for block in model.decoder_blocks:
        att = block.attention
        n += (
            2 * d  # pre-attention LayerNorm: mean, then variance, over d
            + d
            + attention_terms(att, ids.shape[1])  # projections over d, then attention
            + 2 * d
            + d
            + block.intermediate_dim  # FFN: LayerNorm, Dense over d, Dense over I
        )
        h = block._attention_norm(x)  # the attention's input
        conditioning *= layer_conditioning(att, h, h, causal=True)
        x = block(x)
    n += 2 * d + d  # final LayerNorm, logits (the tied embedding) over d
    return {"n": n, "conditioning": conditioning}


def map_params():
    params = []
    for name in kla.feature_maps.available():
        marks = [] if name in FAST_MAPS else [pytest.mark.slow]
        for causal in (False, True):
            params.append(pytest.param(name, causal, marks=marks, id=f"{name}-{'causal' if causal else 'bidir'}"))
    return params


@pytest.mark.parametrize("feature_map,causal", map_params())
def test_serving_default_matches_keras(tmp_path, rng, feature_map, causal):
    model = encoder(feature_map, causal)
    version_dir = export.export_saved_model(model, tmp_path / "encoder")
    assert version_dir == str(tmp_path / "encoder" / "1")
    with export.SavedModelRunner(version_dir) as runner:
        assert runner.input_info("serving_default") == {"features": (np.float32, [-1, -1, DIM])}
        for batch, length in SHAPES:
            x = rng.standard_normal((batch, length, DIM)).astype("float32")
            expected = model(x, training=False).numpy()
            got = runner.run("serving_default", {"features": x})["head"]
            assert got.shape == expected.shape
            assert_close(got, expected, paths=2, what=f"{batch}x{length}", **encoder_tolerance(model, x, causal))


def test_saved_model_cli_show_and_run(tmp_path, rng):
    model = encoder("elu", causal=True)
    version_dir = export.export_saved_model(model, tmp_path / "encoder")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    show = subprocess.run(
        [SAVED_MODEL_CLI, "show", "--dir", version_dir, "--all"], capture_output=True, text=True, env=env, timeout=300
    )
    assert show.returncode == 0, show.stderr[-2000:]
    text = show.stdout
    assert "signature_def['serving_default']" in text
    assert "inputs['features'] tensor_info" in text
    assert "shape: (-1, -1, 16)" in text
    assert "outputs['head'] tensor_info" in text
    assert "shape: (-1, -1, 5)" in text

    x = rng.standard_normal((3, 11, DIM)).astype("float32")
    np.save(tmp_path / "x.npy", x)
    run = subprocess.run(
        [
            SAVED_MODEL_CLI,
            "run",
            "--dir",
            version_dir,
            "--tag_set",
            "serve",
            "--signature_def",
            "serving_default",
            "--inputs",
            f"features={tmp_path / 'x.npy'}",
            "--outdir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    got = np.load(tmp_path / "out" / "head.npy")
    assert_close(got, model(x).numpy(), paths=2, **encoder_tolerance(model, x, causal=True))


def test_warmup_requests_parse_and_replay(tmp_path):
    model = encoder("elu", causal=False)
    version_dir = export.export_saved_model(model, tmp_path / "enc", warmup_batch_size=2, warmup_length=9)
    path = os.path.join(version_dir, "assets.extra", "tf_serving_warmup_requests")
    from tensorflow_serving.apis import prediction_log_pb2

    records = list(tf.data.TFRecordDataset(path).as_numpy_iterator())
    assert len(records) == 1
    log = prediction_log_pb2.PredictionLog.FromString(records[0])
    assert log.WhichOneof("log_type") == "predict_log"
    request = log.predict_log.request
    assert request.model_spec.signature_name == "serving_default"
    assert request.model_spec.name == "enc"
    x = tf.make_ndarray(request.inputs["features"])
    assert x.shape == (2, 9, DIM) and x.dtype == np.float32
    with export.SavedModelRunner(version_dir) as runner:
        got = runner.run("serving_default", {"features": x})["head"]
    assert_close(got, model(x).numpy(), paths=2, **encoder_tolerance(model, x, causal=False))


def test_versions_and_description(tmp_path):
    model = encoder("relu", causal=False)
    base = tmp_path / "enc"
    assert export.export_saved_model(model, base) == str(base / "1")
    assert export.export_saved_model(model, base) == str(base / "2")
    assert export.export_saved_model(model, base, version=7) == str(base / "7")
    assert export.export_saved_model(model, base) == str(base / "8")
    assert sorted(os.listdir(base)) == ["1", "2", "7", "8"]  # no temporary leftovers
    desc = export.read_description(str(base / "8"))
    assert desc["inputs"] == [{"name": "features", "dtype": "float32", "shape": [None, None, DIM]}]
    assert desc["outputs"] == ["head"]
    assert desc["signatures"] == ["serving_default"]
    assert export.latest_version_dir(str(base)) == str(base / "8")


# ------------------------------------------------------------------ errors
def test_unbuilt_model_is_refused(tmp_path):
    model = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="not built"):
        export.export_saved_model(model, tmp_path / "m")
    assert not (tmp_path / "m").exists()
    with pytest.raises(ValueError, match="not built"):
        export.export_onnx(model, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_existing_version_is_refused(tmp_path):
    model = encoder("elu", causal=False)
    export.export_saved_model(model, tmp_path / "m", version=3)
    before = sorted(os.listdir(tmp_path / "m" / "3"))
    with pytest.raises(ValueError, match="already exists"):
        export.export_saved_model(model, tmp_path / "m", version=3)
    assert sorted(os.listdir(tmp_path / "m")) == ["3"]
    assert sorted(os.listdir(tmp_path / "m" / "3")) == before


def test_base_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("not a directory")
    with pytest.raises(ValueError, match="must be a directory"):
        export.export_saved_model(encoder("elu", False), path)
    assert path.read_text() == "not a directory"


def test_failed_export_leaves_nothing_behind(tmp_path):
    model = encoder("elu", causal=False)
    # A wrong input signature fails while tracing, after the temp dir exists.
    bad = [tf.TensorSpec((None, None, DIM + 1), tf.float32, name="features")]
    with pytest.raises(ValueError):
        export.export_saved_model(model, tmp_path / "fresh", input_signature=bad)
    assert not (tmp_path / "fresh").exists()
    export.export_saved_model(model, tmp_path / "kept", version=1)
    with pytest.raises(ValueError):
        export.export_saved_model(model, tmp_path / "kept", input_signature=bad)
    assert sorted(os.listdir(tmp_path / "kept")) == ["1"]


def test_verify_detects_a_wrong_export(tmp_path):
    model = encoder("elu", causal=True, seed=0)
    other = encoder("elu", causal=True, seed=1)  # same architecture, other weights
    version_dir = export.export_saved_model(other, tmp_path / "m")
    with pytest.raises(export.VerificationError, match="exceed tolerance"):
        export.verify(model, saved_model_dir=version_dir, shapes=[(2, 9)])
    report = export.verify(other, saved_model_dir=version_dir, shapes=[(2, 9)])
    # Two checks: the stored weights (exact) and serving_default's outputs.
    assert report.ok and [r.signature for r in report.rows] == ["variables:weights", "serving_default:head"]
    assert report.rows[0].max_abs == 0  # no weight differs
    x = np.zeros((2, 9, DIM), "float32")  # verify's inputs are its own: only the shape matters for n
    limit = bound(paths=2, **encoder_tolerance(other, x, causal=True))  # elu: conditioning 1
    assert report.rows[1].max_rel <= limit


# --------------------------------------------------------------- causal LM
@pytest.fixture(scope="module")
def lm_export():
    # tiny_lm() exported once per run for every file that reads it (tests/_shared_exports.py)
    model, version_dir, _ = _shared_exports.lm_export()
    return model, version_dir


def test_lm_signatures(lm_export):
    model, version_dir = lm_export
    with export.SavedModelRunner(version_dir) as runner:
        assert runner.signature_names == ["generate", "generate_sampled", "serving_default", "step"]
        step_inputs = runner.input_info("step")
        assert step_inputs["token_t"] == (np.int32, [-1])
        # every layer's S [B, H, C, M] and z [B, H, C] explicit, then the position
        expected_state = [tuple(np.asarray(s).shape[1:]) for s in model.get_initial_state(1)]
        assert len(step_inputs) == 1 + len(expected_state) == 1 + 2 * 2 + 1
        for i, shape in enumerate(expected_state):
            assert step_inputs[f"state_{i}"][1] == [-1, *shape]
        assert runner.input_info("generate") == {
            "prompt_ids": (np.int32, [-1, -1]),
            "padding_mask": (np.int32, [-1, -1]),
            "max_length": (np.int32, []),
        }
        sampled = runner.input_info("generate_sampled")
        assert sorted(sampled) == ["max_length", "padding_mask", "prompt_ids", "seed", "temperature", "top_k", "top_p"]


def test_lm_serving_default_matches_keras(lm_export, rng):
    model, version_dir = lm_export
    with export.SavedModelRunner(version_dir) as runner:
        for batch, length in SHAPES:
            ids = rng.integers(0, 40, size=(batch, length)).astype("int32")
            got = runner.run("serving_default", {"token_ids": ids})["logits"]
            assert_close(got, model(ids).numpy(), paths=2, what=f"{batch}x{length}", **lm_tolerance(model, ids))


def test_lm_greedy_decoding_matches_keras_generate(lm_export, rng):
    model, version_dir = lm_export
    prompt = rng.integers(0, 40, size=(3, 5)).astype("int32")
    max_length = 12
    expected = np.asarray(model.generate(prompt, max_length=max_length))  # Keras, XLA-compiled
    with export.SavedModelRunner(version_dir) as runner:
        # 1. the generate signature (tf.while_loop inside the SavedModel)
        feeds = {"prompt_ids": prompt, "padding_mask": np.ones_like(prompt), "max_length": np.int32(max_length)}
        got = runner.run("generate", feeds)["output_ids"]
        np.testing.assert_array_equal(got, expected)
        # 2. the step signature looped from Python, state explicit in and out
        state = [np.asarray(s) for s in model.get_initial_state(3)]
        tokens = list(prompt.T)
        logits = None
        for t in range(max_length - 1):
            token = tokens[t] if t < prompt.shape[1] else np.argmax(logits, axis=-1).astype("int32")
            if t >= prompt.shape[1]:
                tokens.append(token)
            out = runner.run("step", dict({"token_t": token}, **{f"state_{i}": s for i, s in enumerate(state)}))
            logits = out["logits"]
            state = [out[f"new_state_{i}"] for i in range(len(state))]
        tokens.append(np.argmax(logits, axis=-1).astype("int32"))
        np.testing.assert_array_equal(np.stack(tokens, axis=1), expected)


def test_lm_step_signature_matches_parallel_logits(lm_export, rng):
    model, version_dir = lm_export
    ids = rng.integers(0, 40, size=(2, 9)).astype("int32")
    expected = model(ids).numpy()  # parallel chunked path
    # Step t sums t + 1 <= S keys, as the chunked path does: n of the whole sequence bounds every step.
    tolerance = lm_tolerance(model, ids)
    with export.SavedModelRunner(version_dir) as runner:
        state = [np.asarray(s) for s in model.get_initial_state(2)]
        for t in range(ids.shape[1]):
            out = runner.run("step", dict({"token_t": ids[:, t]}, **{f"state_{i}": s for i, s in enumerate(state)}))
            state = [out[f"new_state_{i}"] for i in range(len(state))]
            assert_close(out["logits"], expected[:, t], paths=2, what=f"t={t}", **tolerance)
        np.testing.assert_array_equal(state[-1], [9, 9])  # position counter


def test_lm_sampled_generation_is_seeded(lm_export):
    _, version_dir = lm_export
    prompt = np.array([[1, 2, 3], [4, 5, 6]], "int32")

    def sample(seed, temperature=1.0):
        feeds = {
            "prompt_ids": prompt,
            "padding_mask": np.ones_like(prompt),
            "max_length": np.int32(10),
            "temperature": np.float32(temperature),
            "top_k": np.int32(0),
            "top_p": np.float32(1.0),
            "seed": np.int64(seed),
        }
        return runner.run("generate_sampled", feeds)["output_ids"]

    with export.SavedModelRunner(version_dir) as runner:
        a, b, c = sample(1), sample(1), sample(2)
        greedy = runner.run(
            "generate", {"prompt_ids": prompt, "padding_mask": np.ones_like(prompt), "max_length": np.int32(10)}
        )["output_ids"]
        cold = sample(5, temperature=1e-4)
        zero = sample(5, temperature=0.0)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (2, 10) and (a[:, :3] == prompt).all() and a.min() >= 0 and a.max() < 40
    assert (a != c).any()
    np.testing.assert_array_equal(cold, greedy)  # temperature -> 0 is greedy
    np.testing.assert_array_equal(zero, greedy)  # and temperature 0 is greedy exactly


def test_lm_warmup_replays_every_signature(lm_export):
    model, version_dir = lm_export
    requests = export.read_warmup_requests(os.path.join(version_dir, "assets.extra", "tf_serving_warmup_requests"))
    assert [name for name, _ in requests] == ["serving_default", "step", "generate", "generate_sampled"]
    with export.SavedModelRunner(version_dir) as runner:
        for name, inputs in requests:
            out = runner.run(name, inputs)
            if name == "serving_default":
                ids = inputs["token_ids"]
                assert_close(out["logits"], model(ids).numpy(), paths=2, **lm_tolerance(model, ids))
            if name == "generate":
                expected = model.generate(inputs["prompt_ids"], max_length=int(inputs["max_length"]))
                np.testing.assert_array_equal(out["output_ids"], expected)


def test_lm_description_file(lm_export):
    _, version_dir = lm_export
    with open(os.path.join(version_dir, "assets.extra", "keras_linattn.json")) as f:
        desc = json.load(f)
    assert desc["causal_lm"] is True and desc["vocabulary_size"] == 40
    assert desc["inputs"] == [{"name": "token_ids", "dtype": "int32", "shape": [None, None]}]
    assert [s["name"] for s in desc["state"]] == [f"state_{i}" for i in range(5)]
    assert desc["state"][-1]["dtype"] == "int32"


def test_lm_generate_without_new_tokens(lm_export):
    model, version_dir = lm_export
    prompt = np.array([[3, 1, 4, 1]], "int32")
    with export.SavedModelRunner(version_dir) as runner:
        got = runner.run(
            "generate", {"prompt_ids": prompt, "padding_mask": np.ones_like(prompt), "max_length": np.int32(4)}
        )["output_ids"]
    np.testing.assert_array_equal(got, model.generate(prompt, max_length=4))
    np.testing.assert_array_equal(got, prompt)
