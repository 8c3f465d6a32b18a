"""The sparse global cache (LoLA): a softmax window, a softmax cache of the pairs the linear state recalls worst, and
linear attention for every other older pair.

Wraps `keras_linattn.ops.sparse_cache_attention` (the buffered window keys in
front of the piece, the cache carried through a loop over the tokens),
`sparse_cache_attention_step` and `sparse_cache_attention_reference`. The
rule, the readout and the costs are in `keras_linattn.ops.sparse_cache`.
"""

from keras import ops

from keras_linattn import _state, _validation
from keras_linattn.ops import _sparse_cache_distance as _distance
from keras_linattn.ops import rotary as rotary_ops
from keras_linattn.ops import sparse_cache as sparse_cache_ops
from keras_linattn.ops._common import _mask_keys
from keras_linattn.recurrences.registry import register
from keras_linattn.recurrences.window import WindowRecurrence

__all__ = ["SparseCacheRecurrence"]


@register("sparse_cache")
class SparseCacheRecurrence(WindowRecurrence):
    """Softmax over the last `window_size` tokens and `cache_size` cached pairs; linear attention over the rest.

    A `WindowRecurrence` (its window, gamma, weight and state) with a cache
    beside the window.

    LoLA (McDermott, Heath and Parhi 2025, arXiv 2505.23666). When a pair
    leaves the window, it and the cached pairs are scored by their
    self-recall error against the linear state,
    ``||v - phi(k)^T S / phi(k)^T z||^2``; the N highest stay in the cache
    and the lowest is written into ``(S, z)`` (ties: the older pair goes).
    The window's and the cache's softmax terms and the linear terms share
    one max and one normalizer, as in `WindowRecurrence`: with
    ``cache_size=0`` this is `WindowRecurrence`, and with
    ``window_size + cache_size >= T`` exact softmax attention.

    Decode state: ``S``, ``z``, the window ring (``window_k [W, H, D]``,
    ``window_v [W, H, M]``, ``window_valid [W]``; under grouped-query
    attention the key/value heads, as `WindowRecurrence`'s) and the cache
    (``cache_k [N, H, D]``, ``cache_v [N, H, M]``, ``cache_valid [N, H]``,
    1 = a pair, per head, oldest first): a fixed size at any length.

    Args:
        window_size: W, a positive int (the query's own token included).
        cache_size: N, an int >= 0: the cache's slots per head.
        gamma: None (default) or the initial value, in (0, 1), of a learned
            per-head weight ``sigmoid(g)`` of the softmax terms (window and
            cache), as `WindowRecurrence`'s (weight ``window_gamma_logit [H]``).
        linear_weight: None (default) or the initial value, in (0, 2**63], of a learned
            per-head weight of the linear terms, as `WindowRecurrence`'s
            (weight ``window_linear_weight_log [H]``). The self-recall error
            that picks the cached pairs does not depend on it.
        linear_rope: True (default), or False: the linear part (its
            readout and the self-recall error that picks the cached pairs)
            reads the features of the queries and keys before the rotary
            embedding, as `WindowRecurrence`'s; the window's and the cache's
            softmax keep it. The state then also keeps the window's
            unrotated keys (``window_k_plain``) and the cached pairs'
            features (``cache_f [N, H, C]``), since the cached rotated keys
            cannot give them back.
        linear_mean: False (default), or True: the linear terms are a mean
            over the pairs in the linear state, as `WindowRecurrence`'s. The
            cache takes the first N older pairs and then gives one to the
            state for each pair that leaves the window, so the state holds
            ``max(n - N, 0)`` of the n older real pairs (``linear_count []``
            counts n).
        cache_distance: None (default), or an int d >= 0 (needs
            ``linear_rope=False``): the cache's softmax scores every cached
            pair as if it sat d tokens before its query, whatever its real
            distance: the query before the rotary embedding, rotated to
            position d, against the key before it (RoPE's score depends on
            the distance alone). A cached pair can sit at any distance, so
            with the real one a query past the training length meets
            distances the model never saw (the teacher's own failure); a
            fixed one does not depend on position. The window keeps the
            real distances. ``cache_k`` then holds the unrotated keys.
            Without rotary embeddings it changes nothing.
        cache_max_distance: None (default), or an int L >= 0 (needs
            ``linear_rope=False``; not with `cache_distance`): the cache
            scores a pair d tokens before its query at its real distance
            while d <= L and at L beyond (RoPE distance ``min(d, L)``;
            `keras_linattn.ops._sparse_cache_distance`). With L the training
            length the cache recalls as the real-distance one within it and
            never meets a distance the model did not see past it. The state
            keeps each cached pair's unrotated key (``cache_k_plain``) and
            its age (``cache_age [N, H]``, clamped at L + 1) beside the
            rotated ``cache_k``.
    """

    contract_configs = (
        {"window_size": 3, "cache_size": 2},
        {"window_size": 2, "cache_size": 3, "gamma": 0.25},
        {"window_size": 2, "cache_size": 2, "gamma": 0.5, "linear_weight": 0.3},
        {"window_size": 2, "cache_size": 2, "linear_weight": 0.5, "linear_rope": False, "linear_mean": True},
        {"window_size": 2, "cache_size": 2, "linear_rope": False, "cache_distance": 2},
        {"window_size": 2, "cache_size": 2, "gamma": 0.5, "linear_rope": False, "cache_max_distance": 5},
    )

    # The cache's scores (and its self-recall scoring) take no logit soft cap: the spec refuses one.
    caps_logits = False

    def __init__(
        self,
        window_size,
        cache_size,
        gamma=None,
        linear_weight=None,
        linear_rope=True,
        linear_mean=False,
        cache_distance=None,
        cache_max_distance=None,
    ):
        # the window's checks, its gamma, linear weight and length options, and their weights
        super().__init__(
            window_size, gamma=gamma, linear_weight=linear_weight, linear_rope=linear_rope, linear_mean=linear_mean
        )
        self.cache_size = _validation.check_non_negative_int("cache_size", cache_size)
        self.cache_distance = (
            None if cache_distance is None else _validation.check_non_negative_int("cache_distance", cache_distance)
        )
        if self.cache_distance is not None and self.linear_rope:
            raise ValueError(
                "`cache_distance` needs `linear_rope=False`: the cache then scores the unrotated keys, "
                "which the state keeps for the linear part (`window_k_plain`). "
                f"Received: cache_distance={cache_distance!r}, linear_rope={linear_rope!r}"
            )
        self.cache_max_distance = (
            None
            if cache_max_distance is None
            else _validation.check_non_negative_int("cache_max_distance", cache_max_distance)
        )
        if self.cache_max_distance is not None and (self.linear_rope or self.cache_distance is not None):
            raise ValueError(
                "`cache_max_distance` needs `linear_rope=False` (the state then keeps the unrotated keys it scores "
                "beyond the bound) and no `cache_distance` (one distance rule). "
                f"Received: cache_max_distance={cache_max_distance!r}, linear_rope={linear_rope!r}, "
                f"cache_distance={cache_distance!r}"
            )

    def get_config(self):
        config = super().get_config()
        config = {"window_size": config.pop("window_size"), "cache_size": self.cache_size, **config}
        if self.cache_distance is not None:  # configs with the default stay as they were
            config["cache_distance"] = self.cache_distance
        if self.cache_max_distance is not None:
            config["cache_max_distance"] = self.cache_max_distance
        return config

    def _cache_queries(self, q_plain):
        """The queries the cache scores with `cache_distance` d (or `cache_max_distance`): ``q_plain`` rotated to d.

        Against keys before the rotary embedding (position 0), RoPE's score
        is that of a key d tokens before the query. ``q_plain [B, T, H, D]``
        or ``[B, H, D]``; unchanged without rotary embeddings.
        """
        wavelength = getattr(self.layer, "rope_max_wavelength", None)
        if wavelength is None:
            return q_plain
        distance = self.cache_distance if self.cache_max_distance is None else self.cache_max_distance
        positions = ops.full(ops.shape(q_plain)[:-2], float(distance), "float32")  # [B, T] or [B]
        adjustment = getattr(self.layer, "rope_frequency_adjustment", None)
        rotary_dim = getattr(self.layer, "rope_rotary_dim", None)
        return rotary_ops.rotary_embedding(
            q_plain, positions, wavelength, self.layer.rope_scaling_factor, adjustment, rotary_dim
        )

    def buffer_spec(self):
        n, h, d, m = self.cache_size, self.num_heads, self.key_dim, self.value_dim
        spec = super().buffer_spec() + [
            _state.StateSpec("cache_k", (n, h, d), "float32"),
            _state.StateSpec("cache_v", (n, h, m), "float32"),
            _state.StateSpec("cache_valid", (n, h), "float32"),
        ]
        if not self.linear_rope:
            spec.append(_state.StateSpec("cache_f", (n, h, self.feature_dim), "float32"))
        if self.cache_max_distance is not None:
            spec.append(_state.StateSpec("cache_k_plain", (n, h, d), "float32"))
            spec.append(_state.StateSpec("cache_age", (n, h), "float32"))
        return spec

    def _cache(self, state, dtype, training):
        """``(keys, features, values, valid)`` of the state's cache; the features recomputed from the keys.

        With ``linear_rope=False`` the features are the state's ``cache_f``
        (those of the unrotated keys, which the cache does not keep).
        """
        keys = state["cache_k"]  # [B, N, H, D]
        if self.cache_max_distance is not None:  # both forms and the age, packed as the op reads them
            keys = _distance.pack_keys(keys, state["cache_k_plain"], state["cache_age"])  # [B, N, H, 2D + 1]
        if self.linear_rope:
            features = self.features(ops.cast(keys, dtype), False, True, training)  # [B, N, H, C]
        else:
            features = ops.cast(state["cache_f"], dtype)  # [B, N, H, C]
        return keys, features, state["cache_v"], state["cache_valid"]

    def _older_scale(self, older, dtype):
        """``1 / max(n - N, 1)``: the mean over the pairs in the state, ``n`` older real pairs ``[B, T]``."""
        return self._mean_scale(older - float(self.cache_size), dtype)

    def call(self, q, k, v, gate_keys, key_mask, state, causal=True, training=None, unrotated=None):
        """The parallel form; ``unrotated=(q, k)`` before the rotary embedding when `reads_unrotated`."""
        w = self.window_size
        if state is None:
            state = self.zeros_like_spec(self.buffer_spec(), ops.shape(k)[0])
            s0 = None
        else:
            s0 = (state["S"], state["z"])
        real = ops.ones(ops.shape(k)[:2], "float32") if key_mask is None else ops.cast(key_mask, "float32")
        k_all = ops.concatenate([self._expand(ops.cast(state["window_k"], k.dtype)), k], axis=1)  # [B, W + S, H, D]
        v_all = ops.concatenate([self._expand(ops.cast(state["window_v"], v.dtype)), v], axis=1)  # [B, W + S, H, M]
        ok_all = ops.concatenate([ops.cast(state["window_valid"], "float32"), real], axis=1)  # [B, W + S]
        qf, kf_all, new = self._piece_features(q, k, k_all, ok_all, state, training, unrotated)
        scored = {}
        if self.cache_distance is not None or self.cache_max_distance is not None:
            q_plain, k_plain = (q, k) if unrotated is None else unrotated
            plain = self._expand(ops.cast(state["window_k_plain"], k.dtype))  # [B, W, H, D]
            scored = {
                "cache_q": self._cache_queries(q_plain),  # [B, T, H, D]
                "cache_k_all": ops.concatenate([plain, k_plain], axis=1),  # [B, W + S, H, D]
                "cache_max_distance": self.cache_max_distance,
            }
        out, (s, z), (ck, cf, cv, cok) = sparse_cache_ops.sparse_cache_attention(
            q,
            qf,
            k_all,
            kf_all,
            v_all,
            w,
            self.cache_size,
            ok_all > 0,
            initial_state=s0,
            initial_cache=self._cache(state, k.dtype, training),
            return_state=True,
            chunk_size=self.layer.chunk_size,
            eps=self.layer.epsilon,
            gamma=self._gamma(),
            **scored,
        )  # [B, T, H, M]
        return out, {
            "S": s,
            "z": z,
            "window_k": self._shrink(ops.cast(k_all[:, -w:], "float32")),
            "window_v": self._shrink(ops.cast(_mask_keys(v_all, ok_all > 0)[:, -w:], "float32")),
            "window_valid": ok_all[:, -w:],
            **self._cache_keys(ck),
            "cache_v": cv,
            "cache_valid": cok,
            **self._cache_features(cf),
            **new,
        }

    def _cache_keys(self, keys):
        """The state's ``cache_k`` (with `cache_max_distance`: and ``cache_k_plain``, ``cache_age``, unpacked)."""
        if self.cache_max_distance is None:
            return {"cache_k": keys}
        k, k_plain, age = _distance.unpack_keys(keys)
        return {"cache_k": k, "cache_k_plain": k_plain, "cache_age": age}

    def _cache_features(self, features):
        """The state's ``cache_f`` with ``linear_rope=False`` (else nothing)."""
        return {} if self.linear_rope else {"cache_f": ops.cast(features, "float32")}

    def step(self, q, k, v, gate_keys, state, training=None, unrotated=None):
        """One step; ``unrotated=(q, k) [B, H, D]`` before the rotary embedding when `reads_unrotated`."""
        # The oldest buffered key leaves the window now: its features and the cached keys' are scored.
        oldest_k = self._expand(state["window_k"][:, :1])  # [B, 1, H, D]
        qf, kf_old, new = self._step_features(q, k, oldest_k, state, training, unrotated)
        scored = {}
        if self.cache_distance is not None or self.cache_max_distance is not None:
            # the leaving pair's unrotated key is the oldest of window_k_plain
            scored = {
                "q_cache_t": self._cache_queries(q if unrotated is None else unrotated[0]),  # [B, H, D]
                "k_cache_evicted": self._expand(state["window_k_plain"][:, :1])[:, 0],  # [B, H, D]
                "cache_max_distance": self.cache_max_distance,
            }
        # The window's buffers stay at their buffer_heads: the op reads them per group (never repeated to H).
        out, (s, z), (wk, wv, wok), (ck, cf, cv, cok) = sparse_cache_ops.sparse_cache_attention_step(
            q,
            qf[:, 0],
            self._shrink(k, axis=1),  # [B, buffer_heads, D]
            self._shrink(v, axis=1),  # [B, buffer_heads, M]
            kf_old[:, 0],
            (state["window_k"], state["window_v"], state["window_valid"]),
            self._cache(state, q.dtype, training),
            (state["S"], state["z"]),
            eps=self.layer.epsilon,
            gamma=self._gamma(),
            **scored,
        )  # [B, H, M]
        return out, {
            "S": s,
            "z": z,
            "window_k": wk,
            "window_v": wv,
            "window_valid": wok,
            **self._cache_keys(ck),
            "cache_v": cv,
            "cache_valid": cok,
            **self._cache_features(cf),
            **new,
        }

    def oracle(self, q, k, v, gate_keys, key_mask, training=None, unrotated=None):
        q_lin, k_lin = (q, k) if self.linear_rope or unrotated is None else unrotated
        qf = self.features(q_lin, True, True, training)
        kf = self.features(k_lin, False, True, training)
        scored = {}
        if self.cache_distance is not None or self.cache_max_distance is not None:
            scored = {"cache_q": self._cache_queries(q_lin), "cache_k": k_lin}
            scored["cache_max_distance"] = self.cache_max_distance
        return sparse_cache_ops.sparse_cache_attention_reference(
            q,
            qf,
            k,
            kf,
            v,
            self.window_size,
            self.cache_size,
            key_mask,
            eps=self.layer.epsilon,
            gamma=self._gamma(),
            mean=self.linear_mean,
            **scored,
        )
