"""Signatures shared by the SavedModel and ONNX exporters.

Every exported function takes named tensors and returns a dict of named
tensors, so that TF Serving signatures and ONNX graphs carry the same names:

- ``serving_default``: the model's call, dynamic batch and length.
- ``step`` (causal LMs): ``token_t [B]`` and every state tensor
  ``state_<i>`` in, ``logits [B, V]`` and ``new_state_<i>`` out.
- ``generate`` / ``generate_sampled`` (causal LMs): the decode contract of
  `keras_linattn.generation` (parallel prefill, then the one decoding
  loop over ``step``), exactly what `LinearCausalLM.generate` runs. A row
  whose logits are not finite gets -1 from that position on (never a token
  id); `LinearCausalLM.generate` and `OnnxGenerator` raise there instead.
"""

import re

import numpy as np

from keras_linattn import _lazy, generation, samplers

# Loaded on first use: OnnxGenerator (numpy and onnxruntime only) reads this module's names.
keras = _lazy.module("keras")
tf = _lazy.module("tensorflow")
_compat = _lazy.module("keras_linattn._compat")

SERVING_DEFAULT = "serving_default"
STEP = "step"
GENERATE = "generate"
GENERATE_SAMPLED = "generate_sampled"

TOKEN_IDS = "token_ids"
TOKEN_T = "token_t"
LOGITS = "logits"
PROMPT_IDS = "prompt_ids"
PADDING_MASK = "padding_mask"
MAX_LENGTH = "max_length"
TEMPERATURE = "temperature"
TOP_K = "top_k"
TOP_P = "top_p"
SEED = "seed"
OUTPUT_IDS = "output_ids"


def state_name(i):
    return f"state_{i}"


def new_state_name(i):
    return f"new_state_{i}"


def require_tensorflow_backend():
    """Raises a one-line ValueError unless Keras runs on TensorFlow (the exporters trace `tf.function`s).

    Raises:
        ValueError: naming the backend received and the fix.
    """
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ValueError(
            f"export needs the TensorFlow backend: run without KERAS_BACKEND={backend} (the `keras-linattn export` "
            f"command switches to TensorFlow by itself). Received: backend={backend!r}"
        )


def _clean_name(name):
    name = re.sub(r"[^A-Za-z0-9_]", "_", str(name))
    if not name or not name[0].isalpha():
        name = "x_" + name
    return name


def is_causal_lm(model):
    """True for models with the recurrent LM API (`step`, `call_with_state`)."""
    return all(
        callable(getattr(model, attr, None)) for attr in ("step", "call_with_state", "get_initial_state", "generate")
    )


def check_exportable(model):
    """Raises a clear ValueError for objects that cannot be exported."""
    if not isinstance(model, keras.Model):
        raise ValueError(f"Only a `keras.Model` can be exported. Received: model={type(model).__name__}")
    if not model.built:
        raise ValueError(
            "The model is not built: call it on a batch of data (or build it) before "
            f"exporting, so that its weights exist. Received: model={model.name!r} (built=False)"
        )


class ModelSpecs:
    """Names, dtypes and dynamic shapes of one model's exported signatures.

    Args:
        model: a built `keras.Model`.
        input_signature: optional list of `tf.TensorSpec` (named) for models
            whose inputs cannot be read from ``model.inputs`` (subclassed
            models other than causal LMs). Give ``None`` dims to make them
            dynamic.
    """

    def __init__(self, model, input_signature=None):
        check_exportable(model)
        self.model = model
        self.causal_lm = is_causal_lm(model)
        self._input_structure = None
        if input_signature is not None:
            specs = list(input_signature) if isinstance(input_signature, (list, tuple)) else [input_signature]
            for i, spec in enumerate(specs):
                if not isinstance(spec, tf.TensorSpec):
                    raise ValueError(
                        f"`input_signature` must be a list of `tf.TensorSpec`. Received: input_signature[{i}]={spec!r}"
                    )
            self.input_specs = [
                tf.TensorSpec(s.shape, s.dtype, name=_clean_name(s.name or f"input_{i}")) for i, s in enumerate(specs)
            ]
        elif self.causal_lm:
            self.input_specs = [tf.TensorSpec((None, None), tf.int32, name=TOKEN_IDS)]
        else:
            self.input_specs = self._specs_from_model_inputs(model)
        names = [s.name for s in self.input_specs]
        if len(set(names)) != len(names):
            raise ValueError(f"Input names must be unique. Received: input names={names}")
        self.output_names = self._output_names(model)
        self.vocabulary_size = self._vocabulary_size(model)
        self.state_specs = self._state_specs(model) if self.causal_lm else []

    # ------------------------------------------------------------ inputs
    def _specs_from_model_inputs(self, model):
        try:
            inputs = model.inputs
        except AttributeError:
            inputs = None
        if not inputs:
            raise ValueError(
                "Cannot read the input shapes of this model (it has no `inputs`: a subclassed "
                "model). Pass `input_signature=[tf.TensorSpec(shape, dtype, name=...)]`. "
                f"Received: model={type(model).__name__}"
            )
        self._input_structure = _compat.functional_inputs_struct(model)
        specs = []
        for i, x in enumerate(inputs):
            shape = list(x.shape)
            dtype = tf.as_dtype(keras.backend.standardize_dtype(x.dtype))
            if dtype.is_integer:
                # Token ids: every dim is dynamic.
                shape = [None] * len(shape)
            else:
                # Batch and every length dim are dynamic; the feature dim is kept.
                shape = [None] * (len(shape) - 1) + shape[-1:] if len(shape) > 1 else [None]
            name = _clean_name(getattr(x, "name", None) or f"input_{i}")
            specs.append(tf.TensorSpec(shape, dtype, name=name))
        return specs

    def pack_inputs(self, tensors):
        """Puts flat input tensors back into the structure the model expects."""
        tensors = list(tensors)
        if self._input_structure is not None:
            return keras.tree.pack_sequence_as(self._input_structure, tensors)
        return tensors[0] if len(tensors) == 1 else tensors

    # ----------------------------------------------------------- outputs
    def _output_names(self, model):
        if self.causal_lm:
            return [LOGITS]
        names = list(getattr(model, "output_names", None) or [])
        names = [_clean_name(n) for n in names]
        if not names or len(set(names)) != len(names):
            names = None
        return names

    def name_outputs(self, outputs):
        flat = keras.tree.flatten(outputs)
        names = self.output_names
        if names is None or len(names) != len(flat):
            names = ["output_0"] if len(flat) == 1 else [f"output_{i}" for i in range(len(flat))]
            self.output_names = names
        return dict(zip(names, flat, strict=True))

    @staticmethod
    def _vocabulary_size(model):
        size = getattr(model, "vocabulary_size", None)
        if isinstance(size, int):
            return size
        layers = _compat.flatten_layers(model)
        dims = [layer.input_dim for layer in layers if isinstance(layer, keras.layers.Embedding)]
        return min(dims) if dims else None

    # ------------------------------------------------------------- state
    @staticmethod
    def _state_specs(model):
        spec = getattr(model, "state_spec", None)
        if callable(spec):  # the model's decode contract (`keras_linattn.generation`)
            return [
                tf.TensorSpec((None,) + tuple(s.shape), tf.as_dtype(s.dtype), name=state_name(i))
                for i, s in enumerate(spec())
            ]
        state = model.get_initial_state(1)
        specs = []
        for i, s in enumerate(keras.tree.flatten(state)):
            s = tf.convert_to_tensor(s)
            specs.append(tf.TensorSpec((None,) + tuple(s.shape[1:]), s.dtype, name=state_name(i)))
        return specs

    def initial_state(self, batch_size):
        """Flat list of numpy arrays: the model's initial decoding state."""
        state = self.model.get_initial_state(batch_size)
        return [np.asarray(keras.ops.convert_to_numpy(s)) for s in keras.tree.flatten(state)]

    def _pack_state(self, flat):
        template = self.model.get_initial_state(1)
        return keras.tree.pack_sequence_as(template, list(flat))

    # --------------------------------------------------------- functions
    def serving_fn(self):
        def serve(*args):
            outputs = self.model(self.pack_inputs(args), training=False)
            return self.name_outputs(outputs)

        return serve

    def step_fn(self):
        def step(token_t, *state):
            logits, new_state = self.model.step(token_t, self._pack_state(state))
            out = {LOGITS: logits}
            for i, s in enumerate(keras.tree.flatten(new_state)):
                out[new_state_name(i)] = s
            return out

        return step

    def step_signature(self):
        return [tf.TensorSpec((None,), tf.int32, name=TOKEN_T)] + list(self.state_specs)

    def generate_fn(self, sampled, check_lengths=True):
        """The ``generate`` (greedy) or ``generate_sampled`` function.

        Both run `generation.generate_tokens`, the loop of
        `LinearCausalLM.generate`. ``generate_sampled`` draws with
        `samplers.sample` (``temperature``, ``top_k`` (0: all),
        ``top_p`` (1: all)) and the stateless seed ``[seed, t]`` for token
        t, so it gives Keras' tokens for the sampler with those settings and
        the same seed.

        A request is checked against the rules of
        `generation.check_generate_arguments` (`request_rules`) and, for
        ``generate_sampled``, the sampler settings' rule table
        (`samplers.settings_rules`: NaN, +-inf or negative ``temperature``,
        negative ``top_k``, ``top_p`` outside ``[2^-126, 1]``, negative
        ``seed``; a temperature below ``2^-126``, 0 included, is greedy). With
        `check_lengths` (the SavedModel) each broken rule is a run-time
        assertion naming the argument (``InvalidArgumentError``). A graph
        without assertions (ONNX) returns ``output_ids [B, max(max_length,
        0)]`` filled with -1 instead: no token id is negative.

        Non-finite logits (a row whose logits hold a NaN or +inf, or are all
        -inf: `samplers.nonfinite_rows`) are not a request error: both
        graphs return -1 (`generation.INVALID_TOKEN`) at the first position
        of that row that has no token and at every later position of the
        row; the other rows are decoded as usual. No output id is ever
        ``>= vocabulary_size``.
        """
        model = self.model
        limit = getattr(model, "max_sequence_length", None)
        vocabulary_size = self.vocabulary_size

        def generate(prompt_ids, padding_mask, max_length, sampler, seed, settings=()):
            rules = request_rules(prompt_ids, padding_mask, max_length, vocabulary_size, limit)
            checks = []
            if check_lengths:
                checks = [tf.debugging.Assert(ok, [message]) for ok, message in rules]
                checks += [tf.debugging.Assert(ok, [message, "Received:", value]) for ok, message, value in settings]
            rules = rules + [(ok, message) for ok, message, _ in settings]
            with tf.control_dependencies(checks):
                ok = tf.reduce_all(tf.stack([ok for ok, _ in rules]))
                length = tf.shape(prompt_ids)[1]
                # A broken request still runs, on safe inputs and without decoding (the loop
                # ends at the prompt), so that a graph without assertions gets to the -1 output.
                pad = [[0, 0], [tf.maximum(1 - length, 0), 0]]  # an empty prompt gets one token
                ids = tf.pad(tf.where(ok, prompt_ids, tf.zeros_like(prompt_ids)), pad)  # [B, P']
                real = tf.logical_or(tf.logical_not(ok), _prompt_shaped_mask(prompt_ids, padding_mask))
                mask = tf.pad(tf.cast(real, tf.int32), pad, constant_values=1)  # [B, P']
                run_length = tf.where(ok, max_length, tf.shape(ids)[1])
                seed_pair = tf.stack([tf.cast(tf.math.floormod(seed, 2**31 - 1), tf.int32), 0])  # [2]
                out = generation.generate_tokens(model, sampler, ids, mask, run_length, seed_pair)
                width = tf.maximum(max_length, 0)
                out = tf.pad(out, [[0, 0], [0, tf.maximum(width - tf.shape(out)[1], 0)]])[:, :width]
                out = tf.where(ok, out, -tf.ones_like(out))  # [B, max(max_length, 0)]
            return {OUTPUT_IDS: tf.identity(out)}

        if sampled:

            def sampled_fn(prompt_ids, padding_mask, max_length, temperature, top_k, top_p, seed):
                def sampler(logits, step_seed):
                    return samplers.sample(logits, step_seed, temperature, top_k, top_p)

                # The sampler settings' rule table (docs/decoding.md, "Sampler settings"): refused like the
                # request rules above (an assertion in the SavedModel, output_ids of -1 in ONNX).
                settings = samplers.settings_rules(temperature, top_k, top_p, seed=seed)
                return generate(prompt_ids, padding_mask, max_length, sampler, seed, settings)

            return sampled_fn
        greedy = samplers.get("greedy")
        return lambda prompt_ids, padding_mask, max_length: generate(
            prompt_ids, padding_mask, max_length, greedy, tf.constant(0, tf.int64)
        )

    @staticmethod
    def generate_signature(sampled):
        sig = [
            tf.TensorSpec((None, None), tf.int32, name=PROMPT_IDS),
            tf.TensorSpec((None, None), tf.int32, name=PADDING_MASK),
            tf.TensorSpec((), tf.int32, name=MAX_LENGTH),
        ]
        if sampled:
            sig += [
                tf.TensorSpec((), tf.float32, name=TEMPERATURE),
                tf.TensorSpec((), tf.int32, name=TOP_K),
                tf.TensorSpec((), tf.float32, name=TOP_P),
                tf.TensorSpec((), tf.int64, name=SEED),
            ]
        return sig

    # ------------------------------------------------------ description
    def describe(self):
        """JSON-able description (written next to the exports)."""

        def spec(s):
            return {"name": s.name, "dtype": s.dtype.name, "shape": [None if d is None else int(d) for d in s.shape]}

        desc = {
            "causal_lm": self.causal_lm,
            "vocabulary_size": self.vocabulary_size,
            "max_sequence_length": getattr(self.model, "max_sequence_length", None) if self.causal_lm else None,
            "inputs": [spec(s) for s in self.input_specs],
            "outputs": list(self.output_names or []),
        }
        if self.causal_lm:
            desc["state"] = [spec(s) for s in self.state_specs]
            if callable(getattr(self.model, "state_spec", None)):
                for entry, s in zip(desc["state"], self.model.state_spec(), strict=True):
                    entry["role"] = s.name
            initial = self.initial_state(1)
            if any(np.any(s != 0) for s in initial):
                desc["initial_state"] = [s.tolist() for s in initial]
        return desc


def _same_shape(prompt_ids, padding_mask):
    prompt_shape, mask_shape = tf.shape(prompt_ids), tf.shape(padding_mask)
    return tf.logical_and(tf.equal(mask_shape[0], prompt_shape[0]), tf.equal(mask_shape[1], prompt_shape[1]))


def _prompt_shaped_mask(prompt_ids, padding_mask):
    """``padding_mask != 0`` as bool, or all True where its shape is not the prompt's."""
    return tf.cond(
        _same_shape(prompt_ids, padding_mask),
        lambda: tf.not_equal(padding_mask, 0),
        lambda: tf.ones_like(prompt_ids, tf.bool),
    )


def request_rules(prompt_ids, padding_mask, max_length, vocabulary_size=None, max_sequence_length=None):
    """The rules of a generate request as graph conditions: a list of ``(ok, message)``.

    The same rules as `generation.check_generate_arguments` (which checks
    them in NumPy for Keras and `OnnxGenerator`), each a scalar bool tensor
    with the message of its run-time assertion, naming the argument.
    """
    batch, length = tf.shape(prompt_ids)[0], tf.shape(prompt_ids)[1]
    same_shape = _same_shape(prompt_ids, padding_mask)
    real = _prompt_shaped_mask(prompt_ids, padding_mask)
    left_padded = tf.reduce_all(tf.logical_or(real[:, 1:], tf.logical_not(real[:, :-1])))
    rules = [
        (tf.logical_and(batch > 0, length > 0), "`prompt_ids` must be a non-empty [batch, length] array (length >= 1)"),
        (same_shape, "`padding_mask` must have the shape of `prompt_ids`"),
        (
            tf.logical_and(left_padded, tf.reduce_all(tf.reduce_any(real, axis=1))),
            "`padding_mask` rows must be left-padded (zeros then ones) with at least one real token",
        ),
        (max_length >= length, "`max_length` must be >= the prompt length"),
    ]
    if max_sequence_length is not None:
        rules.append(
            (max_length <= max_sequence_length, f"`max_length` must be <= max_sequence_length={max_sequence_length}")
        )
    if vocabulary_size is not None:
        in_range = tf.logical_and(tf.reduce_all(prompt_ids >= 0), tf.reduce_all(prompt_ids < vocabulary_size))
        rules.append((in_range, f"`prompt_ids` must be in [0, {vocabulary_size})"))
    return rules


def example_inputs(specs_desc, batch_size, length, vocabulary_size=None, seed=0):
    """Random numpy inputs for described input specs, with dynamic dims set.

    Integer inputs draw ids in ``[0, vocabulary_size)`` (``[0, 2)`` when the
    size is unknown); float inputs draw from a standard normal.
    """
    rng = np.random.default_rng(seed)
    feeds = {}
    for s in specs_desc:
        shape = []
        for axis, d in enumerate(s["shape"]):
            shape.append(d if d is not None else (batch_size if axis == 0 else length))
        dtype = np.dtype(s["dtype"])
        if np.issubdtype(dtype, np.integer):
            feeds[s["name"]] = rng.integers(0, vocabulary_size or 2, size=shape).astype(dtype)
        else:
            feeds[s["name"]] = rng.standard_normal(shape).astype(dtype)
    return feeds
