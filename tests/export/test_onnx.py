"""ONNX export (tf2onnx from_function) and onnxruntime inference vs Keras.

One small model per (feature map, causal) is exported once and checked on
several shapes not seen at export, including lengths that are not a multiple
of the chunk size. tf2onnx conversions take seconds each: elu, favor+
(random features) and ffn (trainable kernel) run by default, the other maps
with ``--runslow``.
"""

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

import keras_linattn as kla
from keras_linattn import export
from keras_linattn.export import _providers
from tests import _shared_exports
from tests._helpers import export_once
from tests.export.test_export import DIM, SHAPES, encoder, encoder_tolerance, lm_tolerance, map_params, tiny_lm
from tests.tolerance import assert_close


@pytest.mark.parametrize("feature_map,causal", map_params())
def test_onnx_matches_keras(tmp_path, rng, feature_map, causal):
    model = encoder(feature_map, causal)
    paths = export.export_onnx(model, tmp_path / "encoder.onnx")
    assert paths == {"model": str(tmp_path / "encoder.onnx")}
    proto = onnx.load(paths["model"])
    assert proto.opset_import[0].version == 17
    (inp,) = proto.graph.input
    assert inp.name == "features"
    dims = inp.type.tensor_type.shape.dim
    assert [d.dim_value if d.HasField("dim_value") else None for d in dims] == [None, None, DIM]
    assert [o.name for o in proto.graph.output] == ["head"]
    predictor = export.OnnxPredictor(paths["model"], device="cpu")
    for batch, length in SHAPES:
        x = rng.standard_normal((batch, length, DIM)).astype("float32")
        got = predictor({"features": x})["head"]
        assert got.shape == (batch, length, 5)
        expected = model(x, training=False).numpy()
        assert_close(got, expected, paths=2, what=f"{batch}x{length}", **encoder_tolerance(model, x, causal))


def test_onnx_export_is_deterministic(tmp_path):
    model = encoder("favor+", causal=True)  # random features are frozen weights
    export.export_onnx(model, tmp_path / "a.onnx")
    export.export_onnx(model, tmp_path / "b.onnx")
    a, b = onnx.load(tmp_path / "a.onnx"), onnx.load(tmp_path / "b.onnx")

    def weights(proto):  # node names carry a global counter: compare the values
        arrays = [onnx.numpy_helper.to_array(t) for t in proto.graph.initializer]
        return sorted((str(w.dtype), w.shape, w.tobytes()) for w in arrays)

    assert weights(a) == weights(b)
    x = np.random.default_rng(0).standard_normal((2, 9, DIM)).astype("float32")
    out_a = export.OnnxPredictor(tmp_path / "a.onnx", device="cpu")(x)["head"]
    out_b = export.OnnxPredictor(tmp_path / "b.onnx", device="cpu")(x)["head"]
    np.testing.assert_array_equal(out_a, out_b)
    assert_close(out_a, model(x).numpy(), paths=2, **encoder_tolerance(model, x, causal=True))


def test_conversion_without_optimizer_copies_gives_the_same_graph(rng, monkeypatch):
    """`_convert`'s default (tf2onnx's per-pass graph copies off) gives the careful conversion's graph.

    Same op types, same counts, same initializers, bit-equal outputs; the environment variable that turns
    the copies off is set only during the call; a value the user set is left alone; and a conversion that
    raises on the fast path is converted again the careful way.
    """
    import onnxruntime as ort

    from keras_linattn.export import onnx_export
    from keras_linattn.export._specs import ModelSpecs

    monkeypatch.delenv(onnx_export._CATCH_ERRORS_ENV, raising=False)
    model = encoder("favor+", causal=True)
    specs = ModelSpecs(model)

    def convert(fast):
        return onnx_export._convert(specs.serving_fn(), specs.input_specs, 17, None, fast=fast)

    def ops(proto):
        return sorted(n.op_type for n in proto.graph.node)

    def weights(proto):
        arrays = [onnx.numpy_helper.to_array(t) for t in proto.graph.initializer]
        return sorted((str(w.dtype), w.shape, w.tobytes()) for w in arrays)

    fast, careful = convert(True), convert(False)
    assert onnx_export._CATCH_ERRORS_ENV not in os.environ
    assert ops(fast) == ops(careful) and weights(fast) == weights(careful)
    x = rng.standard_normal((2, 9, DIM)).astype("float32")
    outs = [ort.InferenceSession(p.SerializeToString()).run(None, {"features": x})[0] for p in (fast, careful)]
    np.testing.assert_array_equal(outs[0], outs[1])

    seen = []
    real = onnx_export._from_function

    def flaky(tf_fn, input_signature, opset, fast=True):
        seen.append((fast, os.environ.get(onnx_export._CATCH_ERRORS_ENV)))
        if fast:
            raise RuntimeError("a tf2onnx pass failed")
        return real(tf_fn, input_signature, opset, fast=False)

    monkeypatch.setattr(onnx_export, "_from_function", flaky)
    assert ops(convert(True)) == ops(careful)
    assert seen == [(True, None), (False, None)]
    monkeypatch.setattr(onnx_export, "_from_function", real)
    monkeypatch.setenv(onnx_export._CATCH_ERRORS_ENV, "users-value")
    with onnx_export._without_optimizer_copies():
        assert os.environ[onnx_export._CATCH_ERRORS_ENV] == "users-value"
    assert os.environ[onnx_export._CATCH_ERRORS_ENV] == "users-value"


def test_causal_onnx_never_sees_the_future(tmp_path, rng):
    model = encoder("elu", causal=True)
    predictor = export.OnnxPredictor(export.export_onnx(model, tmp_path / "m.onnx")["model"], device="cpu")
    x = rng.standard_normal((2, 11, DIM)).astype("float32")
    y = x.copy()
    y[:, 6:] += 1.0
    a, b = predictor(x)["head"], predictor(y)["head"]
    np.testing.assert_array_equal(a[:, :6], b[:, :6])
    # Not a rounding bound: the later outputs move (a shift of 1 moves them by O(1), not by 1e-3).
    assert np.abs(a[:, 6:] - b[:, 6:]).max() > 1e-3


# ------------------------------------------------------------- causal LM
@pytest.fixture(scope="module")
def lm_onnx():
    # tiny_lm() exported once per run for every file that reads it (tests/_shared_exports.py)
    model, _, paths = _shared_exports.lm_export()
    return model, paths


def test_lm_onnx_graphs(lm_onnx, rng):
    model, paths = lm_onnx
    assert sorted(paths) == ["generate", "model", "step"] and paths["step"].endswith("lm_step.onnx")
    assert paths["generate"].endswith("lm_generate.onnx")
    predictor = export.OnnxPredictor(paths["model"], device="cpu")
    for batch, length in SHAPES:
        ids = rng.integers(0, 40, size=(batch, length)).astype("int32")
        got = predictor({"token_ids": ids})["logits"]
        assert_close(got, model(ids).numpy(), paths=2, what=f"{batch}x{length}", **lm_tolerance(model, ids))
    step = export.OnnxPredictor(paths["step"], device="cpu")
    assert step.input_names == ["token_t"] + [f"state_{i}" for i in range(5)]
    assert step.output_names[0] == "logits"
    assert sorted(step.output_names[1:]) == [f"new_state_{i}" for i in range(5)]


@pytest.mark.parametrize("io_binding", [False, True], ids=["numpy", "io_binding"])
def test_lm_onnx_greedy_generation_matches_keras(lm_onnx, rng, io_binding):
    model, paths = lm_onnx
    prompt = rng.integers(0, 40, size=(3, 5)).astype("int32")
    expected = np.asarray(model.generate(prompt, max_length=12))
    generator = export.OnnxGenerator(paths["step"], device="cpu", use_io_binding=io_binding)
    assert generator.provider == "CPUExecutionProvider"
    assert generator.predictor.use_io_binding is io_binding
    np.testing.assert_array_equal(generator.generate(prompt, max_length=12), expected)


def test_lm_onnx_step_matches_parallel_logits(lm_onnx, rng):
    model, paths = lm_onnx
    ids = rng.integers(0, 40, size=(2, 9)).astype("int32")
    expected = model(ids).numpy()
    tolerance = lm_tolerance(model, ids)  # step t sums t + 1 <= S keys: n of the whole sequence bounds it
    generator = export.OnnxGenerator(paths["step"], device="cpu", use_io_binding=True)
    state = generator.initial_state(2)
    for t in range(9):
        logits, state = generator.step(ids[:, t], state)
        assert_close(logits, expected[:, t], paths=2, what=f"t={t}", **tolerance)
    np.testing.assert_array_equal(state[-1].numpy(), [9, 9])  # position, still an OrtValue


def test_lm_onnx_sampling_is_seeded(lm_onnx):
    _, paths = lm_onnx
    generator = export.OnnxGenerator(paths["step"], device="cpu")
    prompt = np.array([[1, 2], [3, 4]], "int32")
    a = generator.generate(prompt, 9, temperature=1.0, seed=3)
    b = generator.generate(prompt, 9, temperature=1.0, seed=3)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (2, 9) and a.min() >= 0 and a.max() < 40


# ------------------------------------------------------- predictor checks
@pytest.fixture(scope="module")
def encoder_onnx(tmp_path_factory):
    model, paths = export_once(tmp_path_factory, lambda: encoder("elu", causal=False), export.export_onnx, "enc.onnx")
    return model, paths["model"]


def test_predictor_rejects_bad_inputs(encoder_onnx):
    _, path = encoder_onnx
    predictor = export.OnnxPredictor(path, device="cpu")
    with pytest.raises(ValueError, match=r"must have rank 3 .*Received: features.shape=\(4, 16\)"):
        predictor(np.zeros((4, DIM), "float32"))
    with pytest.raises(ValueError, match=r"axis 2 must be 16. Received: features.shape=\(1, 4, 8\)"):
        predictor(np.zeros((1, 4, 8), "float32"))
    with pytest.raises(ValueError, match=r"must be floating \(float32\). Received: features.dtype=int64"):
        predictor(np.zeros((1, 4, DIM), "int64"))
    with pytest.raises(ValueError, match=r"missing=\['features'\], unexpected=\['x'\]"):
        predictor({"x": np.zeros((1, 4, DIM), "float32")})
    with pytest.raises(ValueError, match="existing .onnx file"):
        export.OnnxPredictor(os.path.dirname(path))
    with pytest.raises(ValueError, match="`device` must be"):
        export.OnnxPredictor(path, device="tpu")
    with pytest.raises(ValueError, match="intra_op_num_threads"):
        export.OnnxPredictor(path, intra_op_num_threads=-1)


def test_predictor_thread_options_do_not_change_results(encoder_onnx, rng):
    model, path = encoder_onnx
    x = rng.standard_normal((2, 6, DIM)).astype("float32")
    expected = model(x).numpy()
    tolerance = encoder_tolerance(model, x, causal=False)
    for kwargs in ({}, {"allow_spinning": True}, {"intra_op_num_threads": 1}, {"prepacking": False}):
        predictor = export.OnnxPredictor(path, device="cpu", **kwargs)
        assert_close(predictor(x)["head"], expected, paths=2, what=str(kwargs), **tolerance)
        options = predictor.session.get_session_options()
        try:
            disabled = options.get_session_config_entry("session.disable_prepacking") == "1"
        except RuntimeError:  # onnxruntime: no entry with that key
            disabled = False
        assert disabled == (kwargs == {"prepacking": False})  # the option reaches the session
    with pytest.raises(ValueError, match="prepacking"):
        export.OnnxPredictor(path, device="cpu", prepacking="no")


def test_predictor_casts_within_kind(encoder_onnx, rng):
    model, path = encoder_onnx
    predictor = export.OnnxPredictor(path, device="cpu")
    x = rng.standard_normal((2, 5, DIM))  # float64
    x32 = x.astype("float32")  # the predictor's cast: both sides see the same float32 inputs
    assert_close(predictor(x)["head"], model(x32).numpy(), paths=2, **encoder_tolerance(model, x32, causal=False))


def test_generator_rejects_bad_prompts(lm_onnx):
    _, paths = lm_onnx
    generator = export.OnnxGenerator(paths["step"], device="cpu")
    with pytest.raises(ValueError, match="prompt_ids"):
        generator.generate(np.zeros((2, 3), "float32"), 5)
    with pytest.raises(ValueError, match="prompt_ids"):
        generator.generate(np.zeros((3,), "int32"), 5)
    with pytest.raises(ValueError, match="max_length"):
        generator.generate(np.zeros((1, 3), "int32"), 0)
    with pytest.raises(ValueError, match="Not a step graph"):
        export.OnnxGenerator(paths["model"], device="cpu")


def test_onnx_path_errors_leave_nothing(tmp_path):
    model = encoder("elu", causal=False)
    with pytest.raises(ValueError, match="not a directory"):
        export.export_onnx(model, tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="parent of `path` is a file"):
        export.export_onnx(model, tmp_path / "file" / "m.onnx")
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_auto_device_on_cpu_machine_logs_no_error(encoder_onnx):
    """On a CPU-only machine `auto` picks the CPU provider without ERROR logs."""
    if _providers.gpu_present():
        pytest.skip("a GPU is visible: the CPU-only path is not what runs here")
    _, path = encoder_onnx
    code = (
        "import numpy as np\n"
        "from keras_linattn.export.onnx_predictor import OnnxPredictor\n"
        f"p = OnnxPredictor({path!r})\n"
        "p(np.zeros((1, 3, 16), 'float32'))\n"
        "print('PROVIDER', p.provider, p.use_io_binding)\n"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "PROVIDER CPUExecutionProvider False" in result.stdout
    assert "[E:onnxruntime" not in result.stderr
    assert "CUDAExecutionProvider" not in result.stderr
    assert _providers.select_providers("auto") == ["CPUExecutionProvider"]
    with pytest.raises(ValueError, match="no usable GPU provider"):
        _providers.select_providers("gpu")


@pytest.mark.slow
@pytest.mark.parametrize("feature_map", [m for m in kla.feature_maps.available() if m != "elu"])
def test_lm_step_exports_every_feature_map(tmp_path, rng, feature_map):
    """SavedModel `step` and the ONNX step graph follow Keras' parallel logits."""
    model = tiny_lm(feature_map)
    ids = rng.integers(0, 40, size=(2, 7)).astype("int32")
    expected = model(ids).numpy()  # [B, T, V], chunked parallel path
    tolerance = lm_tolerance(model, ids)  # step t sums t + 1 <= S keys: n of the whole sequence bounds it
    version_dir = export.export_saved_model(model, tmp_path / "lm", warmup=False, include_generate=False)
    generator = export.OnnxGenerator(export.export_onnx(model, tmp_path / "lm.onnx")["step"], device="cpu")
    onnx_state = generator.initial_state(2)
    with export.SavedModelRunner(version_dir) as runner:
        sm_state = [np.asarray(s) for s in model.get_initial_state(2)]
        for t in range(ids.shape[1]):
            out = runner.run("step", dict({"token_t": ids[:, t]}, **{f"state_{i}": s for i, s in enumerate(sm_state)}))
            sm_state = [out[f"new_state_{i}"] for i in range(len(sm_state))]
            logits, onnx_state = generator.step(ids[:, t], onnx_state)
            assert_close(out["logits"], expected[:, t], paths=2, what=f"SavedModel t={t}", **tolerance)
            assert_close(logits, expected[:, t], paths=2, what=f"ONNX t={t}", **tolerance)
