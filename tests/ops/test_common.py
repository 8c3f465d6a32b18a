"""`keras_linattn.ops._common`: the helpers the ops share, imported from there, and still importable from `ops.core`."""

import ast
import pathlib

import numpy as np
import pytest

import keras_linattn
from keras_linattn import ops as la
from keras_linattn.ops import _common, core

PACKAGE = pathlib.Path(keras_linattn.__file__).parent

SHARED = [
    "_TINY",
    "KERNEL_FLOOR",
    "KernelUnderflowError",
    "_causal_chunked",
    "_check_state",
    "_chunk_prefix",
    "_divide_rows",
    "_fmt",
    "_guarded_denominator",
    "_has_keys",
    "_heads_first",
    "_is_eager",
    "_mark_underflow",
    "_mask_keys",
    "_matmul",
    "_normalize",
    "_step_has_keys",
    "_strict_lower",
    "_two_level_group",
    "_validate_inputs",
]


@pytest.mark.parametrize("name", SHARED)
def test_a_shared_helper_is_the_same_object_through_ops_core(name):
    assert getattr(core, name) is getattr(_common, name)


def test_the_public_names_of_ops_core_are_unchanged():
    assert core.__all__ == ["DEFAULT_EPSILON", "KernelUnderflowError", "linear_attention", "linear_attention_step"]
    assert la.KernelUnderflowError is core.KernelUnderflowError is _common.KernelUnderflowError
    assert issubclass(core.KernelUnderflowError, ValueError)
    assert la.DEFAULT_EPSILON == core.DEFAULT_EPSILON == 1e-6


def _private_imports_from_ops_core():
    """``(file, name)`` of every ``from keras_linattn.ops.core import _name`` in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "keras_linattn.ops.core":
                found += [(path.relative_to(PACKAGE).as_posix(), a.name) for a in node.names if a.name.startswith("_")]
    return found


def test_no_module_of_the_package_imports_a_private_name_of_ops_core():
    assert _private_imports_from_ops_core() == []


def test_mask_keys_zeroes_padded_keys_even_where_they_are_nan():
    x = np.array([[[[1.0, 2.0]], [[np.nan, np.inf]]]], "float32")  # [B=1, S=2, H=1, X=2]
    got = np.asarray(_common._mask_keys(x, np.array([[True, False]])))
    np.testing.assert_array_equal(got, [[[[1.0, 2.0]], [[0.0, 0.0]]]])
    assert _common._mask_keys(x, None) is x


def test_causal_chunked_matches_the_masked_quadratic_sums():
    rng = np.random.default_rng(0)
    q, k = (np.abs(rng.normal(size=(1, 2, 6, 3))).astype("float32") for _ in range(2))  # [B, H, T, C]
    v = rng.normal(size=(1, 2, 6, 4)).astype("float32")  # [B, H, T, M]
    num, den, (s, z) = _common._causal_chunked(q, k, v, 4, None, None)
    scores = np.tril(np.einsum("bhtc,bhsc->bhts", q, k))  # [B, H, T, T]
    np.testing.assert_allclose(np.asarray(num), scores @ v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(den), scores.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(s), np.einsum("bhtc,bhtm->bhcm", k, v), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(z), k.sum(2), rtol=1e-5, atol=1e-6)
