"""The model family and the attention contenders of `benchmarks.bench_quality`, declared once.

Model (every contender, MQAR and the character LM alike)::

    token embedding + learned positions  ->  L x pre-LN block  ->  LayerNorm  ->  Dense(vocabulary) logits
    block:  x = x + Mixer(LN(x));   x = x + Dense(E)(gelu(Dense(4E)(LN(x))))

Only ``Mixer`` (causal self-attention) changes between contenders. A
contender is one line of `CONTENDERS` / `MECHANISM_CONTENDERS`: a name and
the keyword arguments of its attention:

- ``attention="softmax"``: `keras.layers.MultiHeadAttention(num_heads, key_dim)`
  called with ``use_causal_mask=True``;
- otherwise (the default, ``attention="linear"``):
  `keras_linattn.layers.LinearAttention(num_heads, key_dim, value_dim, **kwargs)`
  with ``use_causal_mask=True``; ``key_dim`` / ``value_dim`` default to
  ``E / num_heads``;
- ``input_conv=K``: a causal depthwise convolution of size K (left zero
  padding + `keras.layers.DepthwiseConv1D`) on the mixer's input, before the
  attention (the "softmax+conv4" reference row).

Shape legend: B batch, T sequence length, E model width.
"""

import inspect
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

from examples.common import TokenAndPositionEmbedding  # noqa: E402
from keras_linattn import feature_maps  # noqa: E402
from keras_linattn.layers import LinearAttention  # noqa: E402

SOFTMAX = "softmax"
LINEAR = "linear"

#: Softmax and every registered feature map (one row each). taylor's feature
#: dimension is 1 + D + D^2, so it runs at key_dim 16 (273 features) as in Based.
CONTENDERS = [
    ("softmax", dict(attention=SOFTMAX)),
    ("softmax+conv4", dict(attention=SOFTMAX, input_conv=4)),
] + [
    (name, dict(feature_map=name, key_dim=16) if name == "taylor" else dict(feature_map=name))
    for name in feature_maps.available()
]

#: Recurrence mechanisms of `LinearAttention` (decay, short convolution, sliding window).
#: Selected with ``--contenders``; the run fails up front if the installed
#: LinearAttention does not accept a row's arguments.
MECHANISM_CONTENDERS = [
    ("elu+conv4", dict(feature_map="elu", conv_size=4)),
    ("taylor+conv4", dict(feature_map="taylor", key_dim=16, conv_size=4)),
    ("elu+scalar decay", dict(feature_map="elu", decay="scalar")),
    ("elu+channel decay", dict(feature_map="elu", decay="channel")),
    ("elu+fixed decay", dict(feature_map="elu", decay="fixed")),
    ("taylor+conv4+window16", dict(feature_map="taylor", key_dim=16, conv_size=4, window_size=16)),  # Based
    ("elu+conv4+scalar decay", dict(feature_map="elu", conv_size=4, decay="scalar")),
    # The delta rule: DeltaNet (identity features, L2-normalized q/k) and Gated DeltaNet.
    ("delta+conv4", dict(feature_map=None, update="delta", normalize=False, conv_size=4)),
    ("gated delta+conv4", dict(feature_map=None, update="delta", normalize=False, decay="scalar", conv_size=4)),
]

ALL_CONTENDERS = dict(CONTENDERS + MECHANISM_CONTENDERS)


class UnsupportedContender(ValueError):
    """A contender's arguments are not accepted by the installed `LinearAttention`."""


def resolve(names):
    """``[(name, kwargs)]`` for a list of contender names (ValueError on an unknown name)."""
    unknown = [n for n in names if n not in ALL_CONTENDERS]
    if unknown:
        raise ValueError(f"Unknown contender(s) {unknown}. Known: {list(ALL_CONTENDERS)}")
    return [(n, dict(ALL_CONTENDERS[n])) for n in names]


def _feature_map(name, seed):
    """A fresh feature map; random maps (those taking a `seed`) get `seed`."""
    cls = type(feature_maps.get(name))
    if "seed" in inspect.signature(cls.__init__).parameters:
        return feature_maps.get(name, seed=seed)
    return feature_maps.get(name)


def make_attention(kwargs, width, num_heads, seed=None, name="attention"):
    """The attention layer of a contender (without the optional input convolution).

    Args:
        kwargs: the contender's keyword arguments (see the module docstring).
        width: model width E.
        num_heads: attention heads H.
        seed: seed of random feature maps.

    Raises:
        UnsupportedContender: if `LinearAttention` rejects the arguments.
    """
    kwargs = dict(kwargs)
    attention = kwargs.pop("attention", LINEAR)
    kwargs.pop("input_conv", None)
    if width % num_heads:
        raise ValueError(f"`width` must be divisible by `num_heads`. Received: width={width}, num_heads={num_heads}")
    head_dim = width // num_heads
    key_dim = kwargs.pop("key_dim", head_dim)
    value_dim = kwargs.pop("value_dim", head_dim)
    if attention == SOFTMAX:
        if kwargs:
            raise ValueError(f"Softmax contenders take no other arguments. Received: {kwargs}")
        return keras.layers.MultiHeadAttention(num_heads, key_dim, value_dim=value_dim, name=name)
    if attention != LINEAR:
        raise ValueError(f"`attention` must be {SOFTMAX!r} or {LINEAR!r}. Received: attention={attention!r}")
    if isinstance(kwargs.get("feature_map"), str):
        kwargs["feature_map"] = _feature_map(kwargs["feature_map"], seed)
    kwargs.setdefault("conv_size", None)  # a contender's convolution is named in its arguments
    try:
        return LinearAttention(num_heads, key_dim, value_dim=value_dim, name=name, **kwargs)
    except (TypeError, ValueError) as e:
        import keras_linattn

        raise UnsupportedContender(
            f"The installed LinearAttention ({keras_linattn.__file__}) does not accept "
            f"{ {k: v for k, v in kwargs.items() if k != 'feature_map'} } ({type(e).__name__}: {e})"
        ) from e


def check_supported(contenders, width=64, num_heads=1):
    """Builds every contender's attention once; raises `UnsupportedContender` naming each that fails."""
    failures = []
    for name, kwargs in contenders:
        try:
            make_attention(kwargs, width, num_heads, seed=0)
        except UnsupportedContender as e:
            failures.append(f"  {name}: {e}")
    if failures:
        raise UnsupportedContender(
            "These contenders need LinearAttention arguments the installed keras_linattn does not support "
            "(install the version that has them, or leave these rows out of --contenders):\n" + "\n".join(failures)
        )


class CausalMixer(keras.layers.Layer):
    """Causal self-attention of one contender, with an optional causal depthwise conv on its input.

    Args:
        contender: the contender's keyword arguments (see the module docstring).
        width: model width E.
        num_heads: attention heads H.
        seed: seed of random feature maps.

    Call arguments:
        x: ``[B, T, E]``.

    Returns:
        ``[B, T, E]``.
    """

    def __init__(self, contender, width, num_heads, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.contender = dict(contender)
        self.width = width
        self.num_heads = num_heads
        self.seed = seed
        self.is_softmax = self.contender.get("attention", LINEAR) == SOFTMAX
        conv = self.contender.get("input_conv")
        self.conv = None
        if conv:
            self.pad = keras.layers.ZeroPadding1D((conv - 1, 0))
            self.conv = keras.layers.DepthwiseConv1D(conv, padding="valid", name="input_conv")
        self.attention = make_attention(self.contender, width, num_heads, seed=seed)

    def build(self, input_shape):
        if self.conv is not None:
            self.conv.build((input_shape[0], None, input_shape[-1]))
        self.attention.build(input_shape, input_shape)
        self.built = True

    def call(self, x, training=None):
        if self.conv is not None:
            x = self.conv(self.pad(x))  # [B, T, E]: position t sees t-K+1 .. t
        return self.attention(x, x, use_causal_mask=True, training=training)  # [B, T, E]

    def get_config(self):
        return {
            **super().get_config(),
            "contender": self.contender,
            "width": self.width,
            "num_heads": self.num_heads,
            "seed": self.seed,
        }


class Block(keras.layers.Layer):
    """Pre-LN block: ``x + Mixer(LN(x))``, then ``x + MLP(LN(x))`` (MLP width 4E, gelu).

    Args:
        contender, width, num_heads, seed: as in `CausalMixer`.
        mlp_ratio: MLP hidden width over E. Default 4.
    """

    def __init__(self, contender, width, num_heads, seed=None, mlp_ratio=4, **kwargs):
        super().__init__(**kwargs)
        self.contender = dict(contender)
        self.width = width
        self.num_heads = num_heads
        self.seed = seed
        self.mlp_ratio = mlp_ratio
        self.norm1 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.mixer = CausalMixer(contender, width, num_heads, seed=seed, name="mixer")
        self.norm2 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.mlp_in = keras.layers.Dense(mlp_ratio * width, activation="gelu")
        self.mlp_out = keras.layers.Dense(width)

    def build(self, input_shape):
        self.norm1.build(input_shape)
        self.mixer.build(input_shape)
        self.norm2.build(input_shape)
        self.mlp_in.build(input_shape)
        self.mlp_out.build(tuple(input_shape[:-1]) + (self.mlp_ratio * self.width,))
        self.built = True

    def call(self, x, training=None):
        x = x + self.mixer(self.norm1(x), training=training)  # [B, T, E]
        return x + self.mlp_out(self.mlp_in(self.norm2(x)))  # [B, T, E]

    def get_config(self):
        return {
            **super().get_config(),
            "contender": self.contender,
            "width": self.width,
            "num_heads": self.num_heads,
            "seed": self.seed,
            "mlp_ratio": self.mlp_ratio,
        }


def build_model(contender, vocabulary_size, sequence_length, width, num_heads=1, num_layers=2, seed=0, name=None):
    """The benchmark's causal sequence model for one contender.

    Args:
        contender: the contender's keyword arguments (a value of `ALL_CONTENDERS`).
        vocabulary_size: V, input tokens and output classes.
        sequence_length: T (learned positions).
        width: E.
        num_heads: H. Default 1 (Zoology's MQAR setting).
        num_layers: blocks. Default 2.
        seed: seed of random feature maps (layer i gets ``seed * 1000 + i``).

    Returns:
        An uncompiled `keras.Model` mapping ``[B, T]`` int32 ids to ``[B, T, V]`` float32 logits.
    """
    token_ids = keras.Input((sequence_length,), dtype="int32", name="token_ids")
    x = TokenAndPositionEmbedding(vocabulary_size, sequence_length, width, name="embedding")(token_ids)
    for i in range(num_layers):
        x = Block(contender, width, num_heads, seed=seed * 1000 + i, name=f"block_{i}")(x)  # [B, T, E]
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm")(x)
    logits = keras.layers.Dense(vocabulary_size, dtype="float32", name="logits")(x)  # [B, T, V]
    return keras.Model(token_ids, logits, name=name)


def state_floats(contender, width, num_heads, sequence_length):
    """Decode state per layer, in floats, for one sequence: what a step must carry.

    Softmax keeps a key and a value cache that grows with the context
    (``T * H * (D + M)`` at length T); linear attention keeps ``S [H, C, M]``
    and ``z [H, C]``, independent of T (the mechanism rows may add fixed-size
    buffers, counted by their layer's ``state_spec``).
    """
    kwargs = dict(contender)
    head_dim = width // num_heads
    key_dim = kwargs.get("key_dim", head_dim)
    value_dim = kwargs.get("value_dim", head_dim)
    conv = kwargs.get("input_conv") or 0
    if kwargs.get("attention", LINEAR) == SOFTMAX:
        return sequence_length * num_heads * (key_dim + value_dim) + max(0, conv - 1) * width
    layer = make_attention(kwargs, width, num_heads, seed=0)
    total = 0
    for spec in layer.state_spec():
        n = 1
        for d in spec.shape:
            n *= d
        total += n
    return total
