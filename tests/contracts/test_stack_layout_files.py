"""Files written while `LinearBackbone` held its layers in one inner layer load with the same outputs.

The fixtures in tests/fixtures/stack_layout were saved by the code at commit
7262521 (see make_fixtures.py there): a `LinearCausalLM` as ``.keras`` and
``.weights.h5``, the same shape with LoRA adapters, and the backbone as a
preset, with the logits, hidden states and greedy tokens that code gave.
Their weights sit under ``layers/__decoder_stack/...``; the backbone now
files them under its own layers. A config without ``"layout"`` builds the
backbone with ``layout="stack"``, and ``load_weights`` reads an older weights
file into a new model.
"""

import os
import re
import warnings

import h5py
import keras
import numpy as np
import pytest

import keras_linattn  # noqa: F401  (registers the classes the files name)
from keras_linattn.feature_maps import HedgehogFeatureMap
from keras_linattn.models import LinearBackbone, LinearCausalLM
from keras_linattn.models._legacy import STACK_LAYER_PATH, holds_stack_layout
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric

HERE = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures", "stack_layout")
CONFIG = dict(
    vocabulary_size=20,
    num_layers=2,
    hidden_dim=8,
    num_heads=2,
    intermediate_dim=16,
    chunk_size=4,
    window_size=3,
    conv_size=2,
)


def _data():
    return np.load(os.path.join(HERE, "outputs.npz"))


def _quietly(load):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load()
    # A weight Keras could not place is reported as a warning: none may be.
    unplaced = [str(w.message) for w in caught if re.search("variable|weight", str(w.message), re.I)]
    assert not unplaced, unplaced
    return model


def _groups(path):
    """The groups of a weights file that hold variables."""
    found = set()

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and "/vars/" in f"/{name}":
            found.add(name.rsplit("/vars/", 1)[0])

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return found


def _new_lm():
    return LinearCausalLM(feature_map=HedgehogFeatureMap(feature_dim=4, seed=3), **CONFIG)


def test_older_lm_file_loads_with_the_same_logits_and_tokens():
    data = _data()
    lm = _quietly(lambda: keras.saving.load_model(os.path.join(HERE, "lm.keras")))
    assert lm.backbone.layout == "stack"
    assert_close(lm(data["ids"]), data["lm_logits"], n=256, paths=2, what="lm.keras")
    np.testing.assert_array_equal(lm.generate(data["ids"][:, :3], max_length=10), data["lm_tokens"])


def test_older_lm_file_with_lora_loads_with_its_adapters():
    data = _data()
    lm = _quietly(lambda: keras.saving.load_model(os.path.join(HERE, "lm_lora.keras")))
    assert (lm.backbone.lora_rank, lm.backbone.lora_alpha) == (2, 4)
    assert_close(lm(data["ids"]), data["lora_logits"], n=256, paths=2, what="lm_lora.keras")
    trainable = {v.path for v in lm.trainable_variables}
    assert trainable and all("lora_kernel" in p for p in trainable), sorted(trainable)


def test_older_backbone_preset_loads_with_the_same_hidden_states():
    data = _data()
    backbone = _quietly(lambda: LinearBackbone.from_preset(os.path.join(HERE, "backbone_preset")))
    assert backbone.layout == "stack"
    assert_close(backbone(data["ids"]), data["backbone_hidden"], n=256, paths=2, what="backbone preset")


def test_older_weights_file_loads_into_a_new_model():
    data = _data()
    lm = _new_lm()
    assert lm.backbone.layout == "blocks"
    assert holds_stack_layout(os.path.join(HERE, "lm.weights.h5"))
    _quietly(lambda: lm.load_weights(os.path.join(HERE, "lm.weights.h5")))
    assert lm.backbone.layout == "blocks"  # read through the older paths, the model keeps its own layout
    assert_close(lm(data["ids"]), data["lm_logits"], n=256, paths=2, what="lm.weights.h5")


def test_an_older_file_saves_back_in_its_layout_and_a_new_model_in_the_new_one(tmp_path):
    older = os.path.join(HERE, "lm.weights.h5")
    lm = keras.saving.load_model(os.path.join(HERE, "lm.keras"))
    lm.save_weights(str(tmp_path / "again.weights.h5"))
    assert _groups(str(tmp_path / "again.weights.h5")) == _groups(older)
    assert "layout" not in lm.backbone.get_config()  # the config older files hold
    new = _new_lm()
    new.save_weights(str(tmp_path / "new.weights.h5"))
    groups = _groups(str(tmp_path / "new.weights.h5"))
    assert len(groups) == len(_groups(older))
    assert not any(STACK_LAYER_PATH in g for g in groups), sorted(groups)
    assert "layers/linear_backbone/layers/linear_transformer_decoder_1/attention/query_dense" in groups
    assert not holds_stack_layout(str(tmp_path / "new.weights.h5"))
    assert new.backbone.get_config()["layout"] == "blocks"


def test_new_layout_round_trips_through_keras_files(tmp_path):
    data = _data()
    lm = _new_lm()
    lm.load_weights(os.path.join(HERE, "lm.weights.h5"))
    lm.save(str(tmp_path / "new.keras"))
    again = _quietly(lambda: keras.saving.load_model(str(tmp_path / "new.keras")))
    assert again.backbone.layout == "blocks"
    np.testing.assert_array_equal(np.asarray(again(data["ids"])), np.asarray(lm(data["ids"])))


def test_layout_must_be_known():
    with pytest.raises(ValueError, match="`layout` must be one of"):
        LinearBackbone(vocabulary_size=20, num_layers=1, hidden_dim=8, num_heads=2, intermediate_dim=16, layout="x")
