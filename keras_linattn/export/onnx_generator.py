"""OnnxGenerator: autoregressive decoding with the exported ONNX step graph."""

import numpy as np

from keras_linattn.export import _specs
from keras_linattn.export import onnx_export
from keras_linattn.export.onnx_predictor import OnnxPredictor


class OnnxGenerator:
    """Greedy or sampled decoding of a causal LM exported with `export_onnx`.

    Drives the step graph (``token_t`` + ``state_<i>`` -> ``logits`` +
    ``new_state_<i>``) from Python: the prompt is fed token by token, then
    each chosen token is fed back. The state never leaves the session's
    device when I/O binding is on (the default on GPU): the ``new_state_<i>``
    outputs of one step are bound as the ``state_<i>`` inputs of the next,
    and only the logits are copied to the host.

    Args:
        step_path: the step ``.onnx`` file (``<model>_step.onnx``).
        **predictor_options: the session options of `OnnxPredictor`
            (`device`, `use_tensorrt`, `use_io_binding`,
            `intra_op_num_threads`, `allow_spinning`, `session_options`),
            passed through unchanged.

    Call arguments (`generate`):
        prompt_ids: ``[B, P]`` integer token ids, ``P >= 1``.
        max_length: total length of the returned sequences (prompt
            included).
        temperature: 0 (default) for greedy decoding; > 0 samples from
            ``softmax(logits / temperature)`` with a numpy generator seeded
            by `seed`.
        seed: integer seed of the sampler.

    Returns:
        ``[B, max_length]`` int32 token ids.

    Example:

    >>> gen = OnnxGenerator("lm_step.onnx")
    >>> gen.generate(np.array([[1, 2, 3]]), max_length=16).shape
    (1, 16)
    """

    def __init__(self, step_path, **predictor_options):
        self.predictor = OnnxPredictor(step_path, **predictor_options)
        names = self.predictor.input_names
        if _specs.TOKEN_T not in names or _specs.LOGITS not in self.predictor.output_names:
            raise ValueError(
                "Not a step graph: expected inputs `token_t`, `state_<i>` and outputs `logits`, "
                f"`new_state_<i>`. Received: inputs={names}, outputs={self.predictor.output_names}"
            )
        self.num_states = sum(1 for n in names if n.startswith("state_"))
        self.metadata = onnx_export.read_metadata(step_path)
        self._initial = self.metadata.get("initial_state")

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

    def generate(self, prompt_ids, max_length, temperature=0.0, seed=None):
        prompt = np.asarray(prompt_ids)
        if prompt.ndim != 2 or _kind(prompt.dtype) != "integer":
            raise ValueError(
                "`prompt_ids` must be a rank-2 integer array [batch, prompt_length]. "
                f"Received: prompt_ids.shape={prompt.shape}, dtype={prompt.dtype}"
            )
        if prompt.shape[1] < 1:
            raise ValueError(f"`prompt_ids` needs at least one token. Received: prompt_ids.shape={prompt.shape}")
        if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) or max_length < 1:
            raise ValueError(f"`max_length` must be a positive integer. Received: max_length={max_length!r}")
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, (int, float, np.floating))
            or not 0 <= temperature < float("inf")
        ):
            raise ValueError(f"`temperature` must be a finite number >= 0. Received: temperature={temperature!r}")
        batch, prompt_len = prompt.shape
        if max_length <= prompt_len:
            return prompt[:, :max_length].astype(np.int32)
        rng = np.random.default_rng(seed)
        state = self.initial_state(batch)
        logits = None
        for t in range(prompt_len):
            logits, state = self.step(prompt[:, t], state)
        tokens = [prompt.astype(np.int32)]
        for t in range(max_length - prompt_len):
            token = self._pick(logits, temperature, rng)  # [B]
            tokens.append(token[:, None])
            if t + 1 < max_length - prompt_len:
                logits, state = self.step(token, state)
        return np.concatenate(tokens, axis=1)

    @staticmethod
    def _pick(logits, temperature, rng):
        logits = np.asarray(logits, dtype=np.float64)
        if temperature == 0:
            return np.argmax(logits, axis=-1).astype(np.int32)
        scaled = logits / temperature
        scaled -= scaled.max(axis=-1, keepdims=True)
        probs = np.exp(scaled)
        probs /= probs.sum(axis=-1, keepdims=True)
        return np.array([rng.choice(probs.shape[-1], p=p) for p in probs], dtype=np.int32)


def _kind(dtype):
    return "integer" if np.dtype(dtype).kind in "iu" else np.dtype(dtype).kind
