"""MixtureOfExperts: a sparse gated feed-forward (router, top-k experts, optional shared expert)."""

import keras
from keras import ops

from keras_linattn._validation import check_bool, check_positive_int
from keras_linattn.layers import _quantized_experts

__all__ = ["MixtureOfExperts"]

# The keys of the `moe` dict a `LinearBackbone` / block takes: this layer's constructor arguments.
MOE_ARGUMENTS = ("num_experts", "top_k", "expert_dim", "normalize_top_k", "shared_expert_dim")


@keras.saving.register_keras_serializable(package="keras_linattn")
class MixtureOfExperts(keras.layers.Layer):
    """Mixture-of-experts feed-forward: a softmax router picks `top_k` gated experts per token (Mixtral, Qwen MoE).

    For each token ``x [dim]``::

        p = softmax(x @ router)                       # [E]
        (w, i) = top_k(p, top_k)                      # w renormalized to sum 1 if `normalize_top_k`
        y = sum_j w_j * down_i_j(activation(gate_i_j(x)) * up_i_j(x))
        y += sigmoid(x @ shared_gate) * shared(x)     # with `shared_expert_dim` (Qwen MoE's shared expert)

    The sequence form (``step=False``) computes every expert for every
    token and weights them by the routing (zero for the experts not picked),
    as keras-hub's MoE blocks do; the one-token form (``step=True``) gathers
    the `top_k` picked experts' kernels per row, so that a decode step reads
    only the experts it uses. Both give the same function.

    ``quantize("int8")`` (what `keras.Model.quantize` calls) makes every
    expert kernel, the shared expert's included, an int8 weight with one
    scale per expert and output channel, and multiplies in int8 in both
    forms (`_quantized_experts`); the router stays float.

    Training-time extras of keras-hub's blocks are not part of it: the
    router's load-balancing auxiliary loss and its jitter noise (a
    linearized student trains its attention, LoRA adapters or feature maps,
    not the router), and the router logits as a second output.

    Args:
        num_experts: number of experts E.
        top_k: experts per token (``1 <= top_k <= num_experts``).
        expert_dim: each expert's intermediate width.
        normalize_top_k: True (Mixtral, Qwen 3 MoE) renormalizes the
            picked probabilities to sum to 1; False (Qwen1.5-MoE) keeps them.
        shared_expert_dim: None (default), or the intermediate width of a
            gated expert every token goes through, scaled by a sigmoid gate
            (Qwen MoE).
        activation: the experts' gate activation. Default ``"silu"``.
        quantization_config: None, or the `keras.quantizers.QuantizationConfig`
            of an int8 layer (set by `quantize`; kept by the config so that a
            loaded layer quantizes its inputs as the saved one did).
        **kwargs: `keras.layers.Layer` arguments (`name`, `dtype`).

    Call arguments:
        inputs: ``[..., dim]``.
        step: False (default: any number of tokens) or True (the one-token
            decode form for ``[B, dim]``).

    Returns:
        ``[..., dim]``.

    Raises:
        ValueError: for a size that is not a positive int, or `top_k` above
            `num_experts`.

    Example:

    >>> import numpy as np
    >>> moe = MixtureOfExperts(num_experts=4, top_k=2, expert_dim=32)
    >>> moe(np.ones((2, 5, 16), "float32")).shape
    TensorShape([2, 5, 16])
    """

    def __init__(
        self,
        num_experts,
        top_k,
        expert_dim,
        normalize_top_k=True,
        shared_expert_dim=None,
        activation="silu",
        quantization_config=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.quantization_config = quantization_config
        self.num_experts = check_positive_int("num_experts", num_experts)
        self.top_k = check_positive_int("top_k", top_k)
        if self.top_k > self.num_experts:
            raise ValueError(f"`top_k` must be at most `num_experts` ({num_experts}). Received: top_k={top_k}")
        self.expert_dim = check_positive_int("expert_dim", expert_dim)
        self.normalize_top_k = check_bool("normalize_top_k", normalize_top_k)
        self.shared_expert_dim = (
            None if shared_expert_dim is None else check_positive_int("shared_expert_dim", shared_expert_dim)
        )
        self.activation = keras.activations.get(activation)

    def build(self, inputs_shape):
        dim = inputs_shape[-1]
        if dim is None:
            raise ValueError(
                f"The last dim of the inputs of MixtureOfExperts must be defined. Received: inputs.shape={inputs_shape}"
            )
        self.hidden_dim = int(dim)
        experts, inter = self.num_experts, self.expert_dim

        def weight(name, shape):
            return self.add_weight(name=name, shape=shape, initializer="glorot_uniform", dtype=self.variable_dtype)

        self.router_kernel = weight("router_kernel", (dim, experts))
        shapes = {
            "gate_kernel": (experts, dim, inter),  # [E, dim, I]
            "up_kernel": (experts, dim, inter),  # [E, dim, I]
            "down_kernel": (experts, inter, dim),  # [E, I, dim]
        }
        if self.shared_expert_dim is not None:
            shared = self.shared_expert_dim
            shapes.update(
                {
                    "shared_gate_kernel": (dim, shared),
                    "shared_up_kernel": (dim, shared),
                    "shared_down_kernel": (shared, dim),
                    "shared_weight_kernel": (dim, 1),
                }
            )
        if self.quantization_mode == "int8":  # a quantized layer loaded from its config: int8 kernels and scales
            _quantized_experts.int8_build(self, shapes, self.quantization_config)
        else:
            for attribute, name, _ in _quantized_experts.kernels(self):
                setattr(self, attribute, weight(name, shapes[attribute]))
        self.built = True

    def quantize(self, mode=None, type_check=True, config=None):
        """Quantizes the expert kernels to int8 with Keras' `Dense` scheme; the router stays float.

        Each expert kernel (and the shared expert's) becomes an int8 weight
        with one float scale per expert and output channel; the call then
        quantizes its inputs per row and multiplies in int8
        (`_quantized_experts`). The router is kept float: a rounding error
        in a router logit would swap the experts a token is sent to.

        Args:
            mode: ``"int8"``.
            type_check: Keras' subclass check; not applied here.
            config: optional `keras.quantizers.QuantizationConfig`.

        Raises:
            NotImplementedError: for any other mode (`keras.Model.quantize`
                turns it into a warning and leaves the layer float).
        """
        del type_check
        if mode != "int8":
            raise NotImplementedError(
                f"Layer MixtureOfExperts quantizes its expert kernels to 'int8' only; they stay float. "
                f"Received: mode={mode!r}"
            )
        _quantized_experts.quantize_int8(self, config)
        self.quantization_config = config
        self.dtype_policy = keras.dtype_policies.get(f"int8_from_{self.dtype_policy.name}")

    def _int8_call(self, inputs, step=False):
        return self.call(inputs, step=step)

    def quantized_reductions(self):
        """The contracted lengths of the int8 products one token's output goes through (the verify bounds).

        ``top_k`` experts of ``dim`` (gate, up) and ``expert_dim`` (down),
        and the shared expert's ``dim`` (gate, up, weight) and its width.
        """
        lengths = [self.hidden_dim, self.hidden_dim, self.expert_dim] * self.top_k
        if self.shared_expert_dim is not None:
            lengths += [self.hidden_dim, self.hidden_dim, self.shared_expert_dim, self.hidden_dim]
        return lengths

    def _routing(self, h):
        """``(weights [N, k], experts [N, k])``: the picked experts of each token ``h [N, dim]`` and their weights."""
        probabilities = ops.softmax(ops.matmul(h, self.router_kernel), axis=-1)  # [N, E]
        weights, experts = ops.top_k(probabilities, k=self.top_k)  # [N, k] each
        if self.normalize_top_k:
            weights = weights / ops.sum(weights, axis=-1, keepdims=True)
        return weights, experts

    def _shared(self, h):
        """The shared expert's contribution for ``h [N, dim]``, gated by a sigmoid of ``h @ shared_weight``."""
        if self.quantization_mode == "int8":
            return _quantized_experts.shared(self, h)
        g = self.activation(ops.matmul(h, self.shared_gate_kernel)) * ops.matmul(h, self.shared_up_kernel)
        return ops.matmul(g, self.shared_down_kernel) * ops.sigmoid(ops.matmul(h, self.shared_weight_kernel))

    def _all_experts(self, h, weights, experts):
        """Every expert on every token ``h [N, dim]``, weighted by the routing (0 where not picked): ``[N, dim]``."""
        one_hot = ops.one_hot(experts, self.num_experts, dtype=weights.dtype)  # [N, k, E]
        routing = ops.transpose(ops.sum(one_hot * weights[..., None], axis=1))  # [E, N]
        if self.quantization_mode == "int8":
            return _quantized_experts.all_experts(self, h, routing)
        g = self.activation(ops.einsum("nd,edi->eni", h, self.gate_kernel))  # [E, N, I]
        u = ops.einsum("nd,edi->eni", h, self.up_kernel)  # [E, N, I]
        out = ops.einsum("eni,eid->end", g * u, self.down_kernel)  # [E, N, dim]
        return ops.sum(out * ops.cast(routing, out.dtype)[:, :, None], axis=0)  # [N, dim]

    def _picked_experts(self, h, weights, experts):
        """Only the `top_k` picked experts of each row ``h [B, dim]``, their kernels gathered: ``[B, dim]``."""
        if self.quantization_mode == "int8":
            return _quantized_experts.picked_experts(self, h, weights, experts)
        gate = ops.take(self.gate_kernel, experts, axis=0)  # [B, k, dim, I]
        up = ops.take(self.up_kernel, experts, axis=0)  # [B, k, dim, I]
        down = ops.take(self.down_kernel, experts, axis=0)  # [B, k, I, dim]
        g = self.activation(ops.einsum("bd,bkdi->bki", h, gate)) * ops.einsum("bd,bkdi->bki", h, up)  # [B, k, I]
        out = ops.einsum("bki,bkid->bkd", g, down)  # [B, k, dim]
        return ops.sum(out * ops.cast(weights, out.dtype)[..., None], axis=1)  # [B, dim]

    def call(self, inputs, step=False):
        shape = ops.shape(inputs)
        h = ops.reshape(inputs, (-1, self.hidden_dim))  # [N, dim]
        weights, experts = self._routing(h)
        experts_out = (self._picked_experts if step else self._all_experts)(h, weights, experts)  # [N, dim]
        if self.shared_expert_dim is not None:
            experts_out = experts_out + self._shared(h)
        return ops.reshape(experts_out, shape)

    def compute_output_shape(self, inputs_shape):
        return inputs_shape

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_experts": self.num_experts,
                "top_k": self.top_k,
                "expert_dim": self.expert_dim,
                "normalize_top_k": self.normalize_top_k,
                "shared_expert_dim": self.shared_expert_dim,
                "activation": keras.activations.serialize(self.activation),
                "quantization_config": keras.saving.serialize_keras_object(self.quantization_config),
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["quantization_config"] = keras.saving.deserialize_keras_object(config.get("quantization_config"))
        return super().from_config(config)
