"""The mechanism arguments of `LinearAttention`, the blocks and the LM, documented once.

`keras_linattn._docstrings.fill` puts `MECHANISM_ARGS_DOC` into each of their docstrings.
"""

__all__ = ["MECHANISM_ARGS_DOC"]

# The mechanism arguments of `LinearAttention`, the blocks and the LM,
# documented once (see `keras_linattn._docstrings.fill`).
MECHANISM_ARGS_DOC = """\
        spec: an `keras_linattn.layers.AttentionSpec` holding every
            attention argument below (and `feature_map`, `chunk_size`,
            `epsilon`), validated once. With `spec`, leave those arguments
            at their defaults: a different value raises. Keyword-only.
        decay, normalize, window_size, update: the shorthand spelling of the
            recurrence (not with `recurrence`). `decay`: None, ``"fixed"``
            (RetNet), ``"scalar"`` (Mamba2) or ``"channel"`` (GLA) gates,
            `keras_linattn.recurrences.DecayRecurrence`. `normalize`: True
            (default) divides by ``phi(q) . z``; False puts an RMSNorm on
            each head's output instead. `window_size`: softmax over the last
            W tokens plus linear attention over older ones
            (`WindowRecurrence`; not with `decay` or ``normalize=False``).
            `update`: ``"add"`` (default) or ``"delta"`` (DeltaNet,
            `DeltaRecurrence`; needs ``normalize=False``, gates ``"fixed"``
            or ``"scalar"`` only, no window). `decay`, `window_size` and the
            delta rule are causal. Keyword-only.
        window_gamma: None (default) or a number in (0, 1), with
            `window_size` only: the window's softmax terms are weighted by a
            learned per-head ``gamma = sigmoid(g)`` (g initialized so that
            gamma starts at `window_gamma`; LoLCATs uses 0.1) and the linear
            terms by 1, under the one shared normalizer. With a window at
            least as long as the sequence the gamma cancels (exact softmax
            attention). With `recurrence`, pass ``gamma=`` in the window
            recurrence's config instead. With `cache_size`, it weighs the
            cache's softmax terms too. Keyword-only.
        linear_weight: None (default: 1) or a number in (0, 2**63], with
            `window_size` only: the initial value of a learned per-head
            weight ``exp(l)`` of the linear terms (numerator and
            normalizer). Each softmax term is at most 1, while the linear
            terms of a long past add up; a small value (0.001 on the recall benchmark) keeps a
            linearized student's sharp window (and cache) matches from
            being averaged away. Attention transfer trains it. With
            `recurrence`, pass ``linear_weight=`` in the window
            recurrence's config instead. Keyword-only.
        linear_rope, linear_mean: None (default: True and False), with
            `window_size` (and `cache_size`, if given): for length past the
            training length. ``linear_rope=False`` gives the linear part
            the features of the queries and keys before the rotary
            embedding (the window's softmax keeps it), so no absolute
            position reaches it. ``linear_mean=True`` makes the linear terms
            a mean over the older keys instead of a sum, so their share of
            the normalizer does not grow with the length of the past. See
            `keras_linattn.recurrences.WindowRecurrence` and
            `keras_linattn.recurrences.SparseCacheRecurrence`. Keyword-only.
        cache_size: None (default) or an int N >= 0, with `window_size`
            only: LoLA's sparse global cache
            (`keras_linattn.recurrences.SparseCacheRecurrence`). Besides the
            window, each head keeps the N older key-value pairs that the
            linear state recalls worst (self-recall error
            ``||v - phi(k)^T S / phi(k)^T z||^2``, scored when a pair leaves
            the window) and attends to them with exact softmax under the
            window's normalizer; the other older pairs go into the linear
            state. N = 0 is the window alone; with ``window_size +
            cache_size >= T`` exact softmax attention. The cache
            (``cache_k [N, H, D]``, ``cache_v [N, H, M]``,
            ``cache_valid [N, H]``) is part of the decode state.
            Keyword-only.
        cache_distance: None (default) or an int d >= 0, with `cache_size`
            and ``linear_rope=False``: the cache's softmax scores every
            cached pair as if it sat d tokens before its query (rotary
            embeddings), so a pair far back is not scored at a distance the
            model never saw. Keyword-only.
        cache_max_distance: None (default) or an int L >= 0, with
            `cache_size` and ``linear_rope=False`` (not with
            `cache_distance`): a cached pair is scored at its real distance
            up to L and at L beyond (``min(d, L)``). Keyword-only.
        recurrence: the state update and readout for any recurrence,
            built-in or registered: a registered name
            (`keras_linattn.recurrences.available()`: ``"additive"``,
            ``"decay"``, ``"delta"``, ``"sparse_cache"``, ``"window"``), a
            serialized config or a `Recurrence` instance (each attention
            layer builds its own copy). Default: the additive recurrence,
            or the one the shorthand arguments describe. Keyword-only.
        conv_size: an int K >= 2 (default 4) or None: a causal depthwise
            convolution of size K over time on the projected q, k and v,
            before the feature map (Based, "short convolution"). Padded
            positions enter it as zeros. Its last ``K - 1`` inputs are part
            of the decode state. None turns it off (the seed mechanisms:
            ``feature_map="elu", conv_size=None`` is plain linear attention;
            a random convolution would also break a linearized model's
            exactness). Keyword-only.
        num_key_value_heads: None (default: `num_heads`) or a divisor of
            `num_heads` (grouped-query attention, as in Llama): the key and
            value projections have that many heads (kernels
            ``[dim, kv_heads, D]``), each shared by ``num_heads /
            num_key_value_heads`` consecutive query heads. The state keeps
            `num_heads` heads. Keyword-only.
        rope_max_wavelength: None (default: no rotary embedding) or the base
            of rotary position embeddings (10000 in Llama 2, 500000 in
            Llama 3), applied to the queries and keys after the short
            convolution and before the feature map (and the window's
            softmax), in keras-hub's rotate-half layout. Positions count the
            real tokens before a token (padded tokens take no position, so a
            left-padded sequence gets the positions of the unpadded one);
            the decode state carries the count (``position [B]``, float32).
            Non-causal attention numbers queries and keys by their index.
            Needs an even `key_dim`. Keyword-only.
        rope_scaling_factor: positive number, default 1.0: positions are
            divided by it (keras-hub's linear RoPE scaling). Keyword-only.
        rope_frequency_adjustment: None (default), or Llama 3.1-3.3's
            ``(factor, low_freq_factor, high_freq_factor,
            pretraining_length)`` (a checkpoint's ``rope_scaling`` of type
            "llama3"; keras-hub's ``rope_frequency_adjustment_factor``,
            ``rope_low_freq_factor``, ``rope_high_freq_factor``,
            ``rope_pretraining_sequence_length``): the rotary frequencies
            are adjusted as keras-hub's Llama rotary embedding does
            (`keras_linattn.ops.rotary`). Needs `rope_max_wavelength` and
            ``rope_scaling_factor=1``. Keyword-only.
        qk_norm_epsilon: None (default) or the epsilon of an RMSNorm over
            each query and key head vector (``x / sqrt(mean(x^2) + eps) *
            scale``, one learned scale ``[D]`` each for queries and keys,
            weights ``query_norm`` and ``key_norm``), applied after the
            projections and before the rotary embedding, as Qwen 3 and
            Gemma 3 do. Keyword-only.
        rope_rotary_dim: None (default: the whole head) or an even number
            of leading entries of each query/key head vector that the
            rotary embedding rotates (partial rotary, GPT-NeoX's
            ``rotary_percentage``); the rest pass unchanged. Keyword-only.
        logit_soft_cap: None (default) or ``c > 0``: the softmax window's
            scores are capped, ``c * tanh(s / c)``, as Gemma 2 caps its
            attention logits. Needs a recurrence with a softmax window
            (`WindowRecurrence`, i.e. `window_size`; the sparse cache takes
            none). The linear terms are a kernel of the query and key, not
            of a score, and cannot be capped: the attention is the capped
            softmax exactly where the window covers the sequence.
            Keyword-only."""
