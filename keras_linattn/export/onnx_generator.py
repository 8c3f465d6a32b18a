"""OnnxGenerator: autoregressive decoding with the exported ONNX graphs."""

import os
import threading

import numpy as np

from keras_linattn import _sampler_settings, generation
from keras_linattn import samplers as samplers_lib
from keras_linattn.export import _onnx_files, _onnx_text, _specs
from keras_linattn.export.onnx_predictor import OnnxPredictor

__all__ = ["OnnxGenerator"]


class OnnxGenerator:
    """Generation with a causal LM exported by `export_onnx`.

    `generate` runs the exported generate graph (``<model>_generate.onnx``,
    found through the step graph's metadata): the decode contract of
    `keras_linattn.generation` -- parallel prefill, then the one
    decoding loop and sampling kernel of `LinearCausalLM.generate` -- as an
    ONNX Loop, so it returns Keras' tokens for the same sampler and seed.
    The whole loop runs inside onnxruntime; the state never leaves the
    session's device.

    `step` drives the step graph (``token_t`` + ``state_<i>`` -> ``logits``
    + ``new_state_<i>``) one token at a time, for callers that run their
    own loop (streaming, custom stopping). With I/O binding (the default on
    GPU) the ``new_state_<i>`` outputs of one step are bound as the
    ``state_<i>`` inputs of the next, and only the logits are copied to the
    host.

    Args:
        step_path: the step ``.onnx`` file (``<model>_step.onnx``).
        generate_path: the generate graph; default: the ``generate_file``
            named in the step graph's metadata.
        **predictor_options: the session options of `OnnxPredictor`
            (`device`, `use_tensorrt`, `use_io_binding`,
            `intra_op_num_threads`, `allow_spinning`, `session_options`,
            `verify`, `prepacking`), passed through unchanged, except that
            ``prepacking`` defaults to False here for float weights: the
            step and generate sessions each hold the weights, and
            onnxruntime's repacked copies would double that (a 1B model: past
            17 GB instead of about 11 GiB, at the same decode speed). For an
            export with int8 weights (its metadata's ``int8_weight_bytes``)
            it defaults to True: onnxruntime's integer products without
            their repacked weights repack each weight at every call (several
            times slower), and the copies are int8-sized. At load (and when the
            generate graph's session is created) the generate graph must
            carry the step graph's export id; ``verify="full"`` also
            compares its sha256 with the one the step graph recorded.

    Call arguments (`generate`):
        prompt_ids: ``[B, P]`` integer token ids, ``P >= 1``; or a string
            or a list of strings when the export carries the model's
            tokenizer (``<model>_tokenizer/``, written for a model with a
            preprocessor): then `generate` returns text (prompt and
            completion, up to the end token), as Keras' `generate` does.
        max_length: total length of the returned sequences, prompt
            included, ``>= P``.
        sampler: a `keras_linattn.samplers` name or built-in `Sampler`
            (greedy, random, top_k, top_p); default greedy.
        seed: integer seed of random samplers (None: a fresh one).
        padding_mask: optional ``[B, P]``, 1 for real tokens, each row
            left-padded with at least one real token.
        temperature: shorthand kept for older callers: below ``2^-126``
            (0 included) is greedy, above samples from
            ``softmax(logits / temperature)``; cannot be combined with
            `sampler`.

    Returns:
        ``[B, max_length]`` int32 token ids.

    Raises:
        ValueError: for a sampler setting or seed the rule table refuses
            (docs/decoding.md, "Sampler settings"), naming the value.
        keras_linattn.generation.NonFiniteLogitsError: where the
            logits that predict a position hold a NaN or +inf or are all
            -inf: the generate graph returned -1 there (no token); the
            message names the row and position.

    Example:

    >>> import os, tempfile
    >>> import keras
    >>> from keras_linattn import export
    >>> from keras_linattn.models import LinearCausalLM
    >>> keras.utils.set_random_seed(0)
    >>> lm = LinearCausalLM(vocabulary_size=32, num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=32)
    >>> paths = export.export_onnx(lm, os.path.join(tempfile.mkdtemp(), "lm.onnx"))
    >>> gen = OnnxGenerator(paths["step"], device="cpu")
    >>> prompt = np.array([[1, 2, 3]], "int32")
    >>> tokens = gen.generate(prompt, max_length=8)  # greedy
    >>> tokens.shape, bool(np.array_equal(tokens, np.asarray(lm.generate(prompt, max_length=8))))  # Keras' tokens
    ((1, 8), True)
    """

    def __init__(self, step_path, generate_path=None, **predictor_options):
        metadata = _onnx_files.read_metadata(step_path)
        _onnx_text.check_step_graph(step_path, metadata)  # names the file to pass
        # Two sessions hold the weights (step, generate): no repacked third and fourth copy of float weights
        # unless asked for. int8 weights are repacked: without its packed copy, onnxruntime's integer product
        # packs the whole weight again at every call, and that copy is a quarter of float32's size.
        predictor_options.setdefault("prepacking", bool(metadata.get("int8_weight_bytes")))
        self.predictor = OnnxPredictor(step_path, **predictor_options)
        self._predictor_options = predictor_options
        names = self.predictor.input_names
        if _specs.TOKEN_T not in names or _specs.LOGITS not in self.predictor.output_names:
            raise ValueError(
                "Not a step graph: expected inputs `token_t`, `state_<i>` and outputs `logits`, "
                f"`new_state_<i>`. Received: inputs={names}, outputs={self.predictor.output_names}"
            )
        self.num_states = sum(1 for n in names if n.startswith("state_"))
        self.metadata = self.predictor.metadata
        self._step_path, self._verify = self.predictor.path, self.predictor.verify  # kept if `predictor` is freed
        self._initial = self.metadata.get("initial_state")
        if generate_path is None and self.metadata.get("generate_file"):
            generate_path = os.path.join(
                os.path.dirname(os.path.abspath(step_path)), *self.metadata["generate_file"].split("/")
            )
        self.generate_path = generate_path
        self._generate_predictor = None
        # `generate` may be called from several threads: the generate graph's
        # session is created once, by the first caller, under this lock.
        self._generate_lock = threading.Lock()
        self._check_generate_graph()

    @property
    def provider(self):
        return self.predictor.provider

    def initial_state(self, batch_size):
        """The decoding state before the first token, as numpy arrays."""
        state = []
        for i in range(self.num_states):
            name = _specs.state_name(i)
            dtype, shape = self.predictor.inputs[name]
            if self._initial is not None:
                row = np.asarray(self._initial[i], dtype=dtype)  # [1, ...]
                state.append(np.repeat(row, batch_size, axis=0))
            else:
                state.append(np.zeros([batch_size] + [int(d) for d in shape[1:]], dtype=dtype))
        return state

    def step(self, token_t, state):
        """One step; returns ``(logits [B, V] numpy, new state)``.

        With I/O binding the returned state is a list of device `OrtValue`s
        that can be passed back as is.
        """
        feeds = {_specs.TOKEN_T: np.asarray(token_t, dtype=np.int32)}
        for i, s in enumerate(state):
            feeds[_specs.state_name(i)] = s
        if self.predictor.use_io_binding:
            out = self.predictor.run_bound(feeds)
            logits = out[_specs.LOGITS].numpy()
        else:
            out = self.predictor.predict(feeds)
            logits = out[_specs.LOGITS]
        new_state = [out[_specs.new_state_name(i)] for i in range(self.num_states)]
        return logits, new_state

    def generate(self, prompt_ids, max_length, sampler=None, seed=None, padding_mask=None, temperature=None):
        if _onnx_text.is_text(prompt_ids):  # strings: through the tokenizer exported beside the graphs, and back
            options = dict(sampler=sampler, seed=seed, padding_mask=padding_mask, temperature=temperature)
            return _onnx_text.generate_text(self, prompt_ids, max_length, **options)
        if temperature is not None:
            if sampler is not None:
                raise ValueError(
                    "Pass `sampler` or the shorthand `temperature`, not both. "
                    f"Received: sampler={sampler!r}, temperature={temperature!r}"
                )
            temperature = _sampler_settings.check_temperature(temperature)
            greedy = _sampler_settings.is_greedy_temperature(temperature)
            sampler = "greedy" if greedy else samplers_lib.get("random", temperature=temperature)
        sampler = samplers_lib.get(sampler or "greedy")
        if isinstance(sampler, samplers_lib.GreedySampler):
            params = (0.0, 0, 1.0)
        else:
            params = sampler.sampling_params()
            if params is None:
                raise ValueError(
                    "The exported generate graph runs the built-in samplers (greedy, random, top_k, top_p); "
                    f"a custom sampler runs in Keras' `generate` only. Received: sampler={sampler!r}"
                )
        vocab = self.metadata.get("vocabulary_size")
        prompt, mask, max_length = generation.check_generate_arguments(
            prompt_ids,
            max_length,
            padding_mask,
            vocab if vocab else np.iinfo(np.int32).max,
            self.metadata.get("max_sequence_length"),
        )
        seed = _sampler_settings.check_seed(seed)
        if seed is None:
            seed = int(np.random.randint(0, 2**31 - 1))
        # The rule table of docs/decoding.md, "Sampler settings", checked before the graph sees the settings
        # (the graph would answer a refused setting with output_ids of -1).
        temperature, top_k, top_p = _sampler_settings.check_settings(*params)
        feeds = {
            _specs.PROMPT_IDS: prompt.astype(np.int32),
            _specs.PADDING_MASK: (np.ones(prompt.shape, np.int32) if mask is None else mask.astype(np.int32)),
            _specs.MAX_LENGTH: np.array(max_length, np.int32),
            _specs.TEMPERATURE: np.array(temperature, np.float32),
            _specs.TOP_K: np.array(top_k, np.int32),
            _specs.TOP_P: np.array(top_p, np.float32),
            _specs.SEED: np.array(int(seed), np.int64),
        }
        out = self._generate_graph().predict(feeds)[_specs.OUTPUT_IDS].astype(np.int32)
        # The graph writes -1 from the first position whose logits were not finite.
        return generation.check_output_tokens(out, "OnnxGenerator.generate", vocabulary_size=vocab or None)

    def _generate_graph(self):
        predictor = self._generate_predictor
        if predictor is not None:
            return predictor
        with self._generate_lock:
            if self._generate_predictor is not None:  # another thread created it while this one waited
                return self._generate_predictor
            if self.generate_path is None or not os.path.isfile(self.generate_path):
                raise ValueError(
                    "This export has no ONNX generate graph (exported by an older version, or the file is "
                    "missing): export the model again, or drive `step` yourself. "
                    f"Received: generate_path={self.generate_path!r}"
                )
            self._check_generate_graph()
            options = dict(self._predictor_options, use_io_binding=False)
            predictor = OnnxPredictor(self.generate_path, **options)
            found, own = predictor.metadata.get("export_id"), self.metadata.get("export_id")
            if own is not None and found != own:  # replaced since `__init__` checked it
                raise ValueError(
                    f"The ONNX generate graph {self.generate_path!r} comes from another export than the step graph "
                    f"{self._step_path!r} (export ids {found} and {own}): another export replaced it; load "
                    f"again. Received: generate_path={self.generate_path!r}"
                )
            self._generate_predictor = predictor
        return self._generate_predictor

    def _check_generate_graph(self):
        """The generate graph, when present, comes from the step graph's export (a mixed pair is refused)."""
        if self.generate_path is None or not os.path.isfile(self.generate_path) or "export_id" not in self.metadata:
            return
        _onnx_files.check_companion(self._step_path, self.metadata, "generate", self.generate_path, self._verify)
