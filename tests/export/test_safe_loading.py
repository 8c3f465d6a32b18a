"""`.keras` files load with ``safe_mode=True``; tampered configs fail cleanly and run nothing.

Every layer, feature map and model of the package is saved in a `.keras`
zip and loaded back with ``keras.saving.load_model(path, safe_mode=True)``
(which refuses lambdas and unregistered classes), and must give the same
outputs. Then the ``config.json`` inside a saved zip is edited the way an
attacker would — an unknown feature-map class, a ``module`` pointing to
``os`` / ``subprocess`` with a shell command as config — and loading must
raise a clear error without executing anything: a marker file the command
would create must not appear.
"""

import json
import os
import warnings
import zipfile

import keras
import numpy as np
import pytest

from keras_linattn import feature_maps
from keras_linattn.layers import (
    EfficientAttention,
    LinearAttention,
    LinearAttentionCell,
    LinearTransformerDecoder,
    LinearTransformerEncoder,
)
from keras_linattn.models import LinearCausalLM
from tests._helpers import layer_conditioning
from tests.tolerance import assert_close, bound, rel_err

DIM = 8


def _map(name):
    if name == "favor+":
        return feature_maps.get(name, num_features=8, seed=3)
    if name == "favor_trig":
        # A small input scale keeps the signed kernel positive on these inputs:
        # at the default scale a negative denominator is floored, its ~1e8
        # output overflowed the rest of the stack and the model output was NaN.
        return feature_maps.get(name, num_features=8, seed=3, scale=0.25)
    return feature_maps.get(name)


def _all_layers_model():
    """One functional model holding every feature map and every layer."""
    inp = keras.Input((None, DIM), name="x")
    h = inp
    for i, name in enumerate(feature_maps.available()):
        att = LinearAttention(2, 4, feature_map=_map(name), chunk_size=4, name=f"att_{i}")
        h = h + att(h, h, use_causal_mask=bool(i % 2))
    h = h + EfficientAttention(2, 4, projection="random", projection_dim=4, max_length=16, seed=0)(h, h)
    h = LinearTransformerEncoder(2, 16, feature_map="oglu")(h)
    h = LinearTransformerDecoder(2, 16, feature_map="hedgehog")(h)
    cell = LinearAttentionCell(LinearAttention(2, 4, feature_map=_map("favor+")))
    # Normalized: the residual stack grows to |h| ~ 100, where favor+'s
    # exp(w.x - |x|^2 / 2) underflows and the cell's output is 0.
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.RNN(cell, return_sequences=True)(h)
    return keras.Model(inp, h)


def _n_attention(att, length):
    """DIM (q/k/v projections) + D (the map's own projection) + S keys + C
    features + H*M (output projection)."""
    return DIM + att.key_dim + length + att.feature_dim + att.num_heads * att.value_dim


def _n_all_layers(model, length):
    """Reduction length of the all-layers model's output: the residual stack
    runs every layer in sequence, so their reduction lengths add."""
    n = 0
    for layer in model.layers:
        if isinstance(layer, LinearAttention):
            n += _n_attention(layer, length)
        elif isinstance(layer, EfficientAttention):
            # DIM (projections) + S (random projection of the keys over the
            # sequence) + K (softmax) + K (context) + D (query softmax) + D
            # (query times context) + H*M (output projection)
            n += DIM + length + 2 * layer.projection_dim + 2 * layer.key_dim + layer.num_heads * layer.value_dim
        elif isinstance(layer, (LinearTransformerEncoder, LinearTransformerDecoder)):
            # DIM (layer norm) + attention + DIM (layer norm) + DIM (feed-forward input) + intermediate
            n += 3 * DIM + _n_attention(layer.attention, length) + layer.intermediate_dim
        elif isinstance(layer, keras.layers.LayerNormalization):
            n += DIM
        elif isinstance(layer, keras.layers.RNN):
            n += _n_attention(layer.cell.attention, length)
    return n


def _all_layers_conditioning(model, x):
    """Worst normalizer conditioning of the model's LinearAttention layers on
    the inputs that reach them (1 for positive maps)."""
    worst = 1.0
    for i in range(len(feature_maps.available())):
        att = model.get_layer(f"att_{i}")
        h = keras.Model(model.input, att.input[0])(x)  # what reaches the layer
        worst = max(worst, layer_conditioning(att, h, h, causal=bool(i % 2)))
    return worst


def _config_text(path):
    with zipfile.ZipFile(path) as zf:
        return zf.read("config.json").decode()


def _rewrite_config(src, dst, edit):
    """Copies the .keras zip `src` to `dst` with ``config.json`` replaced by ``edit(config)``."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == "config.json":
                data = json.dumps(edit(json.loads(data))).encode()
            zout.writestr(item, data)


def _walk(obj, fn):
    """Applies fn to every dict in a nested config (depth-first), in place."""
    if isinstance(obj, dict):
        fn(obj)
        for value in list(obj.values()):
            _walk(value, fn)
    elif isinstance(obj, list):
        for value in obj:
            _walk(value, fn)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(path, model, inputs, outputs at save time) of the all-layers model saved once."""
    keras.utils.set_random_seed(0)
    model = _all_layers_model()
    x = np.random.default_rng(0).normal(size=(2, 9, DIM)).astype("float32")
    y = np.asarray(model(x))
    path = str(tmp_path_factory.mktemp("safe") / "all_layers.keras")
    model.save(path)
    return path, model, x, y


def test_every_layer_and_feature_map_loads_in_safe_mode(saved):
    path, model, x, y = saved
    config = _config_text(path)
    # No Python code inside: no Lambda layers, no serialized functions.
    assert "__lambda__" not in config and '"Lambda"' not in config
    for name in feature_maps.available():
        cls = type(feature_maps.get(name))
        assert f'"{cls.__name__}"' in config, name
    loaded = keras.saving.load_model(path, safe_mode=True)
    # Every weight comes back bit for bit, in the same order.
    assert len(loaded.weights) == len(model.weights)
    differ = [
        (w.path, v.path)
        for w, v in zip(model.weights, loaded.weights, strict=True)
        if w.shape != v.shape or not np.array_equal(np.asarray(w), np.asarray(v))
    ]
    assert not differ, f"weights that did not load back (original, loaded): {differ}"
    assert np.isfinite(y).all() and np.abs(y).max() > 0.1  # a comparison that can fail
    # The original and the loaded model, run now (two float32 runs of the same weights: paths=2).
    now = np.asarray(model(x))
    n = _n_all_layers(loaded, x.shape[1])
    conditioning = _all_layers_conditioning(loaded, x)
    assert_close(np.asarray(loaded(x)), now, n=n, conditioning=conditioning, paths=2, what="loaded vs original")
    # The original now against its output when it was saved (same weights and inputs, one process). One CI
    # run saw the loaded model 3.4e-2 away from the output at save time, not reproduced in a sequential run
    # of the suite nor under other hash seeds, dtype policies, name counters or RNG states. A drift of the
    # process's state is reported here, apart from the loading checks above, with its size.
    drift = rel_err(now, y)
    if drift > bound("float32", n, conditioning, 2):
        warnings.warn(f"the all-layers model's output moved by {drift:.3g} (rel) within this process", stacklevel=1)


def test_causal_lm_loads_in_safe_mode(tmp_path):
    keras.utils.set_random_seed(1)
    lm = LinearCausalLM(
        vocabulary_size=20,
        num_layers=2,
        hidden_dim=8,
        num_heads=2,
        intermediate_dim=16,
        feature_map=_map("favor+"),
        max_sequence_length=12,
    )
    ids = np.random.default_rng(1).integers(0, 20, (2, 7)).astype("int32")
    logits = np.asarray(lm(ids))
    path = str(tmp_path / "lm.keras")
    lm.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)

    def n_logits(length):
        # Per block: 8 (layer norm) + 8 (projections) + attention's D + S + C
        # + H*M + 8 (layer norm) + 8 (feed-forward input) + 16 (intermediate);
        # then 8 (final layer norm) + 8 (logits). favor+ is positive: conditioning 1.
        att = lm.decoder_blocks[0].attention
        per_block = 4 * 8 + att.key_dim + length + att.feature_dim + att.num_heads * att.value_dim + 16
        return 2 * per_block + 2 * 8

    # Two float32 runs of the same weights (paths=2).
    assert_close(np.asarray(loaded(ids)), logits, n=n_logits(ids.shape[1]), paths=2, what="logits")
    # The recurrent path of the reloaded model matches too.
    a, _ = loaded.step(ids[:, 0], loaded.get_initial_state(2))
    b, _ = lm.step(ids[:, 0], lm.get_initial_state(2))
    assert_close(np.asarray(a), np.asarray(b), n=n_logits(1), paths=2, what="step")


def _set_feature_map_class(config, class_name, module=None):
    """Renames the class of every serialized feature map in a model config."""
    known = {type(feature_maps.get(n)).__name__ for n in feature_maps.available()}

    def fn(d):
        if d.get("class_name") in known:
            d["class_name"] = class_name
            d["registered_name"] = class_name if module is None else None
            if module is not None:
                d["module"] = module

    _walk(config, fn)
    return config


def test_unknown_feature_map_class_gives_a_clear_error(saved, tmp_path):
    path, _, _, _ = saved
    bad = str(tmp_path / "unknown_map.keras")
    _rewrite_config(path, bad, lambda c: _set_feature_map_class(c, "SuperFastFeatureMap"))
    with pytest.raises((ValueError, TypeError)) as info:
        keras.saving.load_model(bad, safe_mode=True)
    message = str(info.value)
    assert "Unknown feature map in config. Received: class_name='SuperFastFeatureMap'" in message
    assert "EluFeatureMap" in message  # lists what is known


@pytest.mark.parametrize(
    "module, class_name",
    [("os", "system"), ("subprocess", "getoutput"), ("builtins", "exec")],
)
def test_feature_map_config_pointing_at_a_shell_function_executes_nothing(saved, tmp_path, module, class_name):
    path, _, _, _ = saved
    marker = tmp_path / f"pwned_{class_name}"
    command = f"touch {marker}"
    code = f"open({str(marker)!r}, 'w').close()"

    def edit(config):
        known = {type(feature_maps.get(n)).__name__ for n in feature_maps.available()}

        def fn(d):
            if d.get("class_name") in known:
                d.clear()
                d.update(
                    {
                        "module": module,
                        "class_name": class_name,
                        "config": {"command": command, "source": code},
                        "registered_name": None,
                    }
                )

        _walk(config, fn)
        return config

    # Control: the payload is live (run directly, it creates a marker).
    control = tmp_path / "control"
    os.system(f"touch {control}")
    assert control.exists()
    bad = str(tmp_path / f"{class_name}.keras")
    _rewrite_config(path, bad, edit)
    with pytest.raises((ValueError, TypeError)) as info:
        keras.saving.load_model(bad, safe_mode=True)
    assert f"Unknown feature map in config. Received: class_name={class_name!r}" in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("safe_mode", [True, False])
def test_function_config_in_place_of_a_feature_map_is_refused_even_outside_safe_mode(saved, tmp_path, safe_mode):
    """Keras' own function form ``{"class_name": "function", "module": "os", "config": "system"}``."""
    path, _, _, _ = saved
    marker = tmp_path / "pwned_function"

    def edit(config):
        known = {type(feature_maps.get(n)).__name__ for n in feature_maps.available()}

        def fn(d):
            if d.get("class_name") in known:
                d.clear()
                d.update({"module": "os", "class_name": "function", "config": "system", "registered_name": "function"})

        _walk(config, fn)
        return config

    bad = str(tmp_path / f"function_{safe_mode}.keras")
    _rewrite_config(path, bad, edit)
    # The feature-map registry accepts registered FeatureMap classes only, so
    # even safe_mode=False does not hand `os.system` to the layer.
    with pytest.raises((ValueError, TypeError)) as info:
        keras.saving.load_model(bad, safe_mode=safe_mode)
    assert "function" in str(info.value)
    assert not marker.exists()


def test_layer_config_pointing_at_os_system_executes_nothing(saved, tmp_path):
    """The attention layer itself (not its map) replaced by ``os.system``."""
    path, _, _, _ = saved
    marker = tmp_path / "pwned_layer"

    def edit(config):
        def fn(d):
            if d.get("class_name") == "LinearAttention":
                d["module"] = "os"
                d["class_name"] = "system"
                d["registered_name"] = None
                d["config"] = {"command": f"touch {marker}"}

        _walk(config, fn)
        return config

    bad = str(tmp_path / "layer_os.keras")
    _rewrite_config(path, bad, edit)
    with pytest.raises((ValueError, TypeError)) as info:
        keras.saving.load_model(bad, safe_mode=True)
    assert "Could not locate class 'system'" in str(info.value)
    assert not marker.exists()
