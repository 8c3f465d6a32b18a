"""LinearCausalLM on JAX under `keras.distribution`, its resume there, and `LinearBackbone.get_layout_map`.

One JAX subprocess with two host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=2``; a start imports
TensorFlow, keras-hub and JAX and compiles anew, so it combines the checks):
`DataParallel` and `ModelParallel` with `LinearBackbone.get_layout_map`
train like one device from the same initial weights (error model, two
float32 runs: ``paths=2``), and `keras_linattn.callbacks.BackupAndRestore`
interrupted inside an epoch resumes to the uninterrupted weights, with and
without `DataParallel`. The TensorFlow side (`MirroredStrategy`: LM fit,
evaluate and resume) runs in the MirroredStrategy subprocess of
tests/training/test_training.py; the shared pieces are in
tests/training/_lm_runs.py.
"""

import re

import keras
import pytest

from keras_linattn.models import LinearBackbone, LinearCausalLM
from keras_linattn.models._layout_map import _layout_patterns
from tests.conftest import TEST_SEED
from tests.training import _lm_runs


# ---------------------------------------------------------------- JAX
def test_jax_data_parallel_model_parallel_and_resume(tmp_path):
    """JAX on 2 host devices: DataParallel and ModelParallel (`get_layout_map`) train like one
    device; the package's BackupAndRestore resumes inside an epoch, with and without DataParallel."""
    pytest.importorskip("jax", reason="the `jax` extra (make test installs it)")
    env = {
        "KERAS_BACKEND": "jax",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        # Each run builds a new model, which JAX compiles anew; the same program under the same
        # distribution compiles once with a (fresh, per-test) compilation cache.
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    out = _lm_runs.run_script(_lm_runs.JAX_LM_SCRIPT, str(tmp_path), TEST_SEED, env)["lm"]
    weights = _lm_runs.load_weights(str(tmp_path))
    initial = weights["init"]
    for tag in ("data_parallel", "model_parallel"):
        _lm_runs.assert_same_losses(out[tag]["losses"], out["single"]["losses"], f"{tag} fit losses")
        _lm_runs.assert_same_weights(weights[tag], weights["single"], initial, tag)
    # The layout map took: the kernels are sharded over the model axis.
    specs = out["model_parallel"]["specs"]
    sharded = {path for path, spec in specs.items() if "'model'" in spec}
    assert any(p.endswith("query/kernel") for p in sharded), specs
    assert any(p.endswith("feedforward_output_dense/kernel") for p in sharded), specs
    assert any(p.endswith("token_embedding/embeddings") for p in sharded), specs
    for tag in ("resumed", "resumed_data_parallel"):
        assert out[tag + "_point"] == [0, 3]
        _lm_runs.assert_same_weights(weights[tag], weights["single"], initial, tag)


# ---------------------------------------------------------------- layout map
def _backbones():
    common = dict(vocabulary_size=32, num_layers=2, hidden_dim=16, num_heads=2, intermediate_dim=24)
    return {
        "default": LinearBackbone(**common),
        # untied output matrix, learned positions, gated feed-forward: the optional kernels.
        "llama-like": LinearBackbone(
            **common,
            feedforward="gated",
            activation="silu",
            normalization="rms_norm",
            tie_embeddings=False,
            max_sequence_length=16,
            use_bias=False,
        ),
    }


def _mesh():
    return keras.distribution.DeviceMesh((1, 2), ("batch", "model"), ["cpu:0", "cpu:1"])


def test_layout_map_patterns_each_match_a_variable():
    """Every pattern of `get_layout_map` matches a variable of a built backbone (a renamed weight
    fails here instead of being replicated silently), with as many axes as the variable has
    dimensions; every projection, feed-forward and embedding kernel is matched by one pattern."""
    layout_map = LinearBackbone.get_layout_map(_mesh())
    patterns = _layout_patterns("model", "batch")
    assert sorted(layout_map.keys()) == sorted(patterns)
    variables = {f"{name}:{v.path}": v for name, b in _backbones().items() for v in b.weights}
    for pattern in patterns:
        # LayoutMap matches with re.fullmatch: a pattern without a leading ".*" matches nothing.
        assert pattern.startswith(".*"), pattern
        matched = [v for v in variables.values() if re.fullmatch(pattern, v.path)]
        assert matched, f"{pattern!r} matches no variable of a built LinearBackbone"
        for v in matched:
            assert len(layout_map[v.path].axes) == len(v.shape), (pattern, v.path, v.shape)
    kernel = re.compile(r".*/(query|key|value|attention_output|feedforward_\w+_dense)/kernel|.*embeddings")
    for key, v in variables.items():
        hits = [p for p in patterns if re.fullmatch(p, v.path)]
        if kernel.fullmatch(v.path):
            assert len(hits) == 1, (key, hits)
            assert any(axis is not None for axis in layout_map[v.path].axes), key  # sharded somewhere
        else:
            assert hits == [] and layout_map[v.path] is None, (key, hits)  # norms, biases: replicated


def test_layout_map_paths_inside_a_causal_lm():
    """The task's variables keep the backbone's paths: the same patterns reach them."""
    lm = LinearCausalLM(vocabulary_size=32, num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=24)
    layout_map = LinearBackbone.get_layout_map(_mesh())
    sharded = [v.path for v in lm.weights if layout_map[v.path] is not None]
    assert len(sharded) == 1 + 4 + 2, sharded  # embedding, q/k/v/o, two feed-forward kernels


def test_layout_map_rejects_a_wrong_mesh():
    with pytest.raises(ValueError, match="DeviceMesh"):
        LinearBackbone.get_layout_map("mesh")
    with pytest.raises(ValueError, match="model_parallel_dim_name='heads'"):
        LinearBackbone.get_layout_map(_mesh(), model_parallel_dim_name="heads")
    with pytest.raises(ValueError, match="data_parallel_dim_name='data'"):
        LinearBackbone.get_layout_map(_mesh(), data_parallel_dim_name="data")
