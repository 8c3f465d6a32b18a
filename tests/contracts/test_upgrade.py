"""Files written before keras_linattn 0.3: refused by the core classes, converted by `keras_linattn.upgrade`.

The fixtures were saved by the older code (see each folder's make_fixtures.py):

- tests/fixtures/round2: 0.1's layer files (plain, fixed/scalar/channel decay,
  unnormalized, conv, window, (gated) delta), which load as they are, and two
  flat `LinearCausalLM` files (taylor + conv + window; delta + conv);
- tests/fixtures/stack_layout: 0.2's `LinearCausalLM` in the stack layout as
  ``.keras`` and ``.weights.h5``, the same shape with LoRA adapters, and the
  backbone as a preset, with the logits, hidden states and greedy tokens that
  code gave.

Committed files rather than a subprocess running the old code: the old code
is not importable next to the new one. A converted file must load with no
weight left unplaced (Keras warns and leaves fresh weights otherwise, which
the output comparison would catch too) and give the older code's outputs up
to float32 rounding of the same sums.
"""

import os
import re
import subprocess
import sys
import warnings

import h5py
import keras
import numpy as np
import pytest

import keras_linattn  # noqa: F401  (registers the classes the files name)
from keras_linattn import upgrade
from keras_linattn.feature_maps import HedgehogFeatureMap
from keras_linattn.models import LinearBackbone, LinearCausalLM
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures")
ROUND2 = os.path.join(FIXTURES, "round2")
STACK = os.path.join(FIXTURES, "stack_layout")
LAYERS = ["plain", "fixed", "scalar_conv", "channel_unnormalized", "window", "gated_delta"]
FLAT_LMS = ["lm_based", "lm_delta_conv"]
STACK_CONFIG = dict(
    vocabulary_size=20, num_layers=2, hidden_dim=8, num_heads=2, intermediate_dim=16, chunk_size=4, window_size=3,
    conv_size=2,
)  # fmt: skip


def _quietly(load):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load()
    # A weight Keras could not place is reported as a warning: none may be.
    unplaced = [str(w.message) for w in caught if re.search("variable|weight", str(w.message), re.I)]
    assert not unplaced, unplaced
    return model


def _stack_data():
    return np.load(os.path.join(STACK, "outputs.npz"))


def _groups(path):
    """The groups of a weights file that hold variables."""
    found = set()

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and "/vars/" in f"/{name}":
            found.add(name.rsplit("/vars/", 1)[0])

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return found


@pytest.mark.parametrize("name", LAYERS)
def test_older_layer_file_loads_with_the_same_outputs(name):
    # Layer files never changed layout: they load as they are.
    data = np.load(os.path.join(ROUND2, f"{name}.npz"))
    model = _quietly(lambda: keras.models.load_model(os.path.join(ROUND2, f"{name}.keras")))
    # Same weights, same ops: float32 rounding of the attention sums (T keys, C features, H * M outputs).
    assert_close(model(data["x"]), data["y"], n=64, paths=2, what=name)


@pytest.mark.parametrize("path", [os.path.join(ROUND2, "lm_based.keras"), os.path.join(STACK, "lm.keras")])
def test_the_core_refuses_an_older_lm_file_and_names_the_converter(path):
    with pytest.raises(ValueError, match=r"python -m keras_linattn\.upgrade"):
        keras.saving.load_model(path)


def test_the_core_refuses_an_older_preset_and_names_the_converter():
    with pytest.raises(ValueError, match=r"keras_linattn < 0\.3.*python -m keras_linattn\.upgrade"):
        LinearBackbone.from_preset(os.path.join(STACK, "backbone_preset"))


@pytest.mark.parametrize("name", FLAT_LMS)
def test_a_flat_lm_file_upgrades_to_the_same_logits_and_tokens(tmp_path, name):
    data = np.load(os.path.join(ROUND2, f"{name}.npz"))
    upgrade.upgrade(os.path.join(ROUND2, f"{name}.keras"), tmp_path / "new.keras")
    lm = _quietly(lambda: keras.saving.load_model(str(tmp_path / "new.keras")))
    assert type(lm) is LinearCausalLM and lm.backbone.get_config()["layout"] == "blocks"
    assert_close(lm(data["x"]), data["y"], n=256, paths=2, what=name)
    np.testing.assert_array_equal(lm.generate(data["x"][:, :3], max_length=data["tokens"].shape[1]), data["tokens"])


def test_a_stack_layout_lm_file_upgrades_to_the_same_logits_and_tokens(tmp_path):
    data = _stack_data()
    upgrade.upgrade(os.path.join(STACK, "lm.keras"), tmp_path / "new.keras")
    lm = _quietly(lambda: keras.saving.load_model(str(tmp_path / "new.keras")))
    assert_close(lm(data["ids"]), data["lm_logits"], n=256, paths=2, what="lm.keras")
    np.testing.assert_array_equal(lm.generate(data["ids"][:, :3], max_length=10), data["lm_tokens"])
    # The converted file names the current paths: the former inner layer is gone.
    lm.save_weights(str(tmp_path / "new.weights.h5"))
    groups = _groups(str(tmp_path / "new.weights.h5"))
    assert len(groups) == len(_groups(os.path.join(STACK, "lm.weights.h5")))
    assert not any(upgrade.STACK_LAYER_PATH in g for g in groups), sorted(groups)


def test_a_stack_layout_lm_with_lora_upgrades_with_its_adapters(tmp_path):
    data = _stack_data()
    upgrade.upgrade(os.path.join(STACK, "lm_lora.keras"), tmp_path / "new.keras")
    lm = _quietly(lambda: keras.saving.load_model(str(tmp_path / "new.keras")))
    assert (lm.backbone.lora_rank, lm.backbone.lora_alpha) == (2, 4)
    assert_close(lm(data["ids"]), data["lora_logits"], n=256, paths=2, what="lm_lora.keras")
    trainable = {v.path for v in lm.trainable_variables}
    assert trainable and all("lora_kernel" in p for p in trainable), sorted(trainable)


def test_a_stack_layout_preset_upgrades_to_the_same_hidden_states(tmp_path):
    data = _stack_data()
    upgrade.upgrade(os.path.join(STACK, "backbone_preset"), tmp_path / "preset")
    backbone = _quietly(lambda: LinearBackbone.from_preset(str(tmp_path / "preset")))
    assert_close(backbone(data["ids"]), data["backbone_hidden"], n=256, paths=2, what="backbone preset")


def test_an_older_weights_file_loads_into_a_new_model_through_the_converter():
    data = _stack_data()
    lm = LinearCausalLM(feature_map=HedgehogFeatureMap(feature_dim=4, seed=3), **STACK_CONFIG)
    _quietly(lambda: upgrade.load_older_weights(lm, os.path.join(STACK, "lm.weights.h5")))
    assert_close(lm(data["ids"]), data["lm_logits"], n=256, paths=2, what="lm.weights.h5")


def test_upgrade_refuses_to_overwrite_and_a_weights_file_alone(tmp_path):
    (tmp_path / "x.keras").write_bytes(b"")
    with pytest.raises(FileExistsError, match="overwrite"):
        upgrade.upgrade(os.path.join(STACK, "lm.keras"), tmp_path / "x.keras")
    with pytest.raises(ValueError, match="load_older_weights"):
        upgrade.upgrade(os.path.join(STACK, "lm.weights.h5"), tmp_path / "y.weights.h5")


def test_the_command_line_converts_and_the_core_never_imports_the_converter(tmp_path):
    out = tmp_path / "cli.keras"
    code = (
        "import sys; from keras_linattn import upgrade; "
        f"sys.exit(upgrade.main([{os.path.join(STACK, 'lm.keras')!r}, {str(out)!r}]))"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wrote" in done.stdout and out.exists()
    loaded = [m for m in sys.modules if m.startswith("keras_linattn.upgrade")]
    # In this process the package has loaded every core module the tests use; the converter only by this file.
    assert loaded == ["keras_linattn.upgrade"]
    core = os.path.join(os.path.dirname(keras_linattn.__file__))
    importers = [
        os.path.join(root, f)
        for root, _, files in os.walk(core)
        for f in files
        if f.endswith(".py")
        and f != "upgrade.py"
        and "keras_linattn.upgrade" in open(os.path.join(root, f)).read()
        and "import" in open(os.path.join(root, f)).read().split("keras_linattn.upgrade")[0][-40:]
    ]
    assert not importers, importers


def test_the_constructor_takes_the_backbone_arguments_by_keyword_only():
    with pytest.raises((TypeError, ValueError)):
        LinearCausalLM(20, 2, 8, 2, 16)
    with pytest.raises(TypeError, match="layout"):
        LinearBackbone(layout="blocks", **{k: v for k, v in STACK_CONFIG.items() if k != "window_size"})
