"""The optional hooks of `FeatureMap`: their defaults on the base class, the maps that override them, and their use."""

import inspect

import numpy as np
import pytest

from keras_linattn import feature_maps
from keras_linattn.feature_maps import FavorPlusFeatureMap, FavorTrigFeatureMap, FeatureMap
from keras_linattn.layers import LinearAttention

B, T, H, D = 2, 5, 2, 4


def _maps():
    return [feature_maps.get(name) for name in feature_maps.available()]


def test_the_base_class_declares_every_hook_with_its_default():
    assert FeatureMap.float16_safe is True
    assert FeatureMap.noncausal_pair is None
    assert FeatureMap.call_signature_parameters == ()
    assert FeatureMap.seed is None
    assert FeatureMap.causal_key_out_of_range is None


@pytest.mark.parametrize("fm", _maps(), ids=lambda fm: fm.registry_name)
def test_every_map_lists_the_parameters_of_its_call(fm):
    assert list(fm.call_signature_parameters) == list(inspect.signature(fm.call).parameters)
    assert ("key_mask" in fm.call_signature_parameters) == isinstance(fm, FavorPlusFeatureMap)


@pytest.mark.parametrize("fm", _maps(), ids=lambda fm: fm.registry_name)
def test_only_the_maps_that_need_a_hook_override_it(fm):
    is_favor, is_trig = isinstance(fm, FavorPlusFeatureMap), isinstance(fm, FavorTrigFeatureMap)
    assert fm.float16_safe is not is_trig
    assert (fm.noncausal_pair is not None) == is_favor
    if is_favor:
        assert inspect.ismethod(fm.noncausal_pair)
    assert (fm.causal_key_out_of_range is not None) == is_trig
    assert fm.seed == fm.get_config().get("seed")


def test_a_seeded_map_keeps_its_seed():
    assert feature_maps.get("favor+", seed=3).seed == 3
    assert feature_maps.get("hedgehog", seed=4).seed == 4
    assert feature_maps.get("elu").seed is None


class _Recording(FeatureMap):
    """elu + 1 features that count how the recurrence reaches them."""

    def __init__(self, pair=False, **kwargs):
        super().__init__(**kwargs)
        self.calls, self.masks, self.pairs = 0, 0, 0
        if pair:
            self.noncausal_pair = self._pair

    def feature_dim(self, input_dim):
        return input_dim

    def call(self, inputs, is_query=True, causal=False, key_mask=None):
        self.calls += 1
        self.masks += key_mask is not None
        return np.float32(1.0) + inputs * inputs

    def _pair(self, queries, keys, key_mask=None):
        self.pairs += 1
        return self.call(queries, True), self.call(keys, False)


def _attend(fm, causal, key_mask=None):
    layer = LinearAttention(num_heads=H, key_dim=D, feature_map=fm)
    x = np.random.default_rng(0).normal(size=(B, T, 8)).astype("float32")
    return layer(x, x, use_causal_mask=causal, key_mask=key_mask)


def test_the_key_mask_reaches_a_map_whose_call_takes_it():
    fm = _Recording()
    assert "key_mask" in fm.call_signature_parameters
    _attend(fm, causal=False, key_mask=np.ones((B, T), bool))
    assert fm.masks == 1 and fm.calls == 2
    fm = _Recording()
    _attend(fm, causal=False)
    assert fm.masks == 0


def test_noncausal_pair_is_used_for_non_causal_calls_only():
    fm = _Recording(pair=True)
    _attend(fm, causal=False)
    assert fm.pairs == 1
    _attend(fm, causal=True)
    assert fm.pairs == 1
    plain = _Recording()
    _attend(plain, causal=False)
    assert plain.pairs == 0 and plain.calls == 2
