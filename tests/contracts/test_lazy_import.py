"""Loading on first use: ONNX serving without TensorFlow; Keras files and presets after `import keras_linattn`."""

import importlib
import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import keras_linattn
from keras_linattn import export
from keras_linattn.layers import LinearAttention
from keras_linattn.models import LinearCausalLM

ROOT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)

# A meta-path finder that refuses TensorFlow, Keras and the rest of the training stack: as in a venv without them.
BLOCK = textwrap.dedent(
    """
    import importlib.abc, sys
    class _Absent(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("tensorflow", "keras", "keras_hub", "tf2onnx", "jax", "tensorflow_text"):
                raise ImportError(f"No module named {name!r} (blocked)")
    sys.meta_path.insert(0, _Absent())
    """
)


def _python(code, timeout=300):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("KERAS_BACKEND", None)
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def exported_lm(tmp_path_factory):
    keras.utils.set_random_seed(0)
    lm = LinearCausalLM(vocabulary_size=32, num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=32)
    tmp = tmp_path_factory.mktemp("lazy")
    paths = export.export_onnx(lm, str(tmp / "lm.onnx"))
    prompt = np.array([[1, 2, 3], [4, 5, 6]], "int32")
    return lm, paths, prompt, tmp


def test_onnx_generator_runs_without_tensorflow_or_keras(exported_lm):
    lm, paths, prompt, _ = exported_lm
    code = BLOCK + textwrap.dedent(
        f"""
        import json
        import numpy as np
        from keras_linattn.serving import OnnxGenerator, OnnxPredictor
        from keras_linattn.export import OnnxGenerator as Same
        assert Same is OnnxGenerator
        gen = OnnxGenerator({paths["step"]!r}, device="cpu")
        greedy = gen.generate(np.array({prompt.tolist()!r}, "int32"), max_length=9)
        logits = OnnxPredictor({paths["model"]!r}, device="cpu")(np.array({prompt.tolist()!r}, "int32"))
        heavy = sorted(m for m in ("tensorflow", "keras", "keras_hub", "tf2onnx") if m in sys.modules)
        print(json.dumps({{"greedy": greedy.tolist(), "heavy": heavy, "outputs": sorted(logits)}}))
        """
    )
    report = _python(code)
    assert report["heavy"] == []
    np.testing.assert_array_equal(report["greedy"], np.asarray(lm.generate(prompt, max_length=9)))
    assert report["outputs"] == ["logits"]


def test_the_keras_class_table_lists_every_registered_class():
    for name in ("callbacks", "feature_maps", "layers", "models", "recurrences", "regularizers", "samplers"):
        importlib.import_module(f"keras_linattn.{name}")
    importlib.import_module("keras_linattn.models.causal_lm")
    registered = {
        key.split(">", 1)[1]: value.__module__
        for key, value in keras.saving.get_custom_objects().items()
        if key.startswith("keras_linattn>")
        and not value.__name__.startswith("_Load")
        and value.__module__.startswith("keras_linattn.")  # not the test suite's own plug-ins
    }
    table = {name: module for module, names in keras_linattn._KERAS_CLASSES.items() for name in names}
    assert registered == table


@pytest.mark.parametrize("first", ["keras_linattn", pytest.param("keras_hub", marks=pytest.mark.slow)])
def test_keras_files_and_presets_load_after_only_import_keras_linattn(exported_lm, tmp_path, first):
    lm, _, prompt, _ = exported_lm
    lm.save_to_preset(str(tmp_path / "preset"))
    inputs = keras.Input((None, 8))
    model = keras.Model(inputs, LinearAttention(2, 4, feature_map="hedgehog")(inputs, inputs))
    model.save(tmp_path / "layer.keras")
    expected = np.asarray(lm.generate(prompt, max_length=9)).tolist()
    # `first`: either import order
    code = textwrap.dedent(
        f"""
        import json
        import {first}
        import keras_hub, keras_linattn, keras
        layer_model = keras.saving.load_model({str(tmp_path / "layer.keras")!r})
        lm = keras_hub.models.CausalLM.from_preset({str(tmp_path / "preset")!r})
        tokens = lm.generate({prompt.tolist()!r}, max_length=9)
        print(json.dumps({{"lm": type(lm).__name__, "layer": type(layer_model.layers[-1]).__name__,
                           "tokens": [[int(t) for t in row] for row in tokens]}}))
        """
    )
    report = _python(code)
    assert report == {"lm": "LinearCausalLM", "layer": "LinearAttention", "tokens": expected}
