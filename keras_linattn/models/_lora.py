"""LoRA on a `LinearBackbone` (`LoraBackbone`, where keras-hub keeps `enable_lora`) and the adapter mechanics.

Keras' own LoRA (`keras.layers.EinsumDense.enable_lora`) does the work on
the query, key, value and output projections of each `LinearAttention`;
everything else is frozen. A `LinearBackbone` records its adapters in its
config (``"lora": {"rank", "alpha"}``), so `.keras` files, presets and
``save_weights`` keep them; `keras_linattn.linearization.enable_lora` calls
`LoraBackbone.enable_lora` for each backbone of a model and puts unrecorded
adapters on any other `LinearAttention`. This module imports neither
keras_hub nor `keras_linattn.linearization`.
"""

import keras

from keras_linattn import _compat
from keras_linattn._capture import walk_layers
from keras_linattn._validation import check_positive_int
from keras_linattn.layers.linear_attention import LinearAttention

__all__ = [
    "PROJECTIONS",
    "LoraBackbone",
    "adapter_variables",
    "add_adapters",
    "attention_layers",
    "check_not_enabled",
    "check_rank_alpha",
    "freeze",
    "lora_hosts",
    "merge_adapters",
    "projections",
    "unfreeze",
]

# The projections of a `LinearAttention` layer that take adapters (their layer names).
PROJECTIONS = ("query", "key", "value", "attention_output")


def attention_layers(model):
    """The `LinearAttention` layers of `model`.

    Raises:
        ValueError: for a model without one.
    """
    layers = [layer for layer in walk_layers(model) if isinstance(layer, LinearAttention)]
    if not layers:
        raise ValueError(f"The model has no LinearAttention layer to put LoRA on. Received: {type(model).__name__}")
    return layers


def projections(layer, targets=PROJECTIONS):
    """The projections of the `LinearAttention` `layer` named in `targets`, in `PROJECTIONS`' order."""
    denses = (layer.query_dense, layer.key_dense, layer.value_dense, layer.output_dense)
    return [dense for name, dense in zip(PROJECTIONS, denses, strict=True) if name in targets]


def freeze(layers):
    """Freezes every layer of `layers` that holds weights.

    Layers without weights are left alone: a feature-map template (an
    untracked attribute of a backbone or block, serialized into its config)
    would otherwise carry ``trainable=False`` into every map built from it.
    """
    for layer in layers:
        if layer.weights:
            layer.trainable = False  # Keras trains by variable flag


def unfreeze(model):
    """Every layer of `model` trainable, with the variables it created trainable.

    Keras' ``trainable`` setter, called on each layer: on the TensorFlow
    backend ``layer.trainable = True`` is skipped (attribute tracking's
    ``self.x = self.x`` short cut) when the layer already is trainable,
    which would leave variables frozen one by one (a LoRA kernel and its
    bias) frozen, and the setter does not reach sublayers that already are.
    """
    for layer in walk_layers(model):
        keras.layers.Layer.trainable.fset(layer, True)


def check_rank_alpha(rank, alpha):
    """Raises ValueError unless `rank` is a positive int and `alpha` a positive number."""
    check_positive_int("rank", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"`alpha` must be a positive number. Received: alpha={alpha!r}")


def check_not_enabled(attention, rank, targets=PROJECTIONS):
    """Raises ValueError if a projection of the `attention` layers already has adapters."""
    for layer in attention:
        for dense in projections(layer, targets):
            if dense.lora_enabled:
                raise ValueError(f"LoRA is already enabled on {dense.path}. Received: rank={rank}")


def add_adapters(attention, rank, alpha, in_config, targets=PROJECTIONS):
    """Adapters on the `targets` projections of the `attention` layers, their kernels and biases frozen."""
    for layer in attention:
        for dense in projections(layer, targets):
            dense.trainable = True  # Keras creates the adapters trainable only in a trainable layer
            dense.enable_lora(rank, lora_alpha=alpha)  # new A, B; the kernel is frozen by Keras
            if dense.bias is not None:
                dense.bias.trainable = False
            dense.lora_in_config = in_config


def adapter_variables(model):
    """The LoRA adapter variables (``lora_kernel_a``, ``lora_kernel_b``) of the model's attention projections."""
    out = []
    for layer in attention_layers(model):
        for dense in projections(layer):
            if dense.lora_enabled:
                out += [dense.lora_kernel_a, dense.lora_kernel_b]
    return out


def merge_adapters(attention):
    """Each adapted projection of the `attention` layers: kernel ``W + (alpha / r) A B``, adapters deleted."""
    for layer in attention:
        for dense in projections(layer):
            if not dense.lora_enabled:
                continue
            _compat.unmerged_kernel(dense).assign(dense.kernel)  # Keras' `kernel`: W + (alpha / r) A B
            del dense.lora_kernel_a  # a Layer's `__delattr__` untracks the variable
            del dense.lora_kernel_b
            dense.lora_enabled = False
            dense.lora_rank = dense.lora_alpha = None
            dense.lora_in_config = False


def lora_hosts(model):
    """The layers of `model` whose config records their adapters (`LoraBackbone`s, e.g. `LinearBackbone`)."""
    return [layer for layer in walk_layers(model) if isinstance(layer, LoraBackbone)]


def _check_targets(target_layer_names):
    names = tuple(target_layer_names) if isinstance(target_layer_names, (list, tuple)) else None
    if not names or any(name not in PROJECTIONS for name in names) or len(set(names)) != len(names):
        raise ValueError(
            f"`target_layer_names` must name distinct projections among {list(PROJECTIONS)}. "
            f"Received: target_layer_names={target_layer_names!r}"
        )
    return tuple(name for name in PROJECTIONS if name in names)


class LoraBackbone:
    """LoRA on a backbone's attention projections, recorded in its config: keras-hub's `Backbone.enable_lora`.

    `LinearBackbone` inherits it (before keras-hub's `Backbone`, whose
    `enable_lora` it replaces): the backbone sets ``lora_rank``,
    ``lora_alpha`` and ``lora_targets`` (None without adapters) and its
    `get_config` records them with `_lora_entry`.
    """

    def default_lora_layer_names(self):
        """The projections `enable_lora` adapts by default: every `LinearAttention`'s q, k, v and output."""
        return list(PROJECTIONS)

    def enable_lora(self, rank, target_layer_names=None, *, alpha=None):
        """Freezes the backbone and puts LoRA adapters on its attention projections (keras-hub's signature).

        As keras-hub's `Backbone.enable_lora`: the backbone stays trainable,
        every layer with weights in it is frozen, and the adapters are the
        trainable variables. Unlike keras-hub's, the config records the
        adapters (``"lora"``), so `.keras` files, presets and
        ``save_weights`` keep them; `merge_lora` folds them into the kernels.

        Args:
            rank: the adapters' rank r, a positive int.
            target_layer_names: the projections to adapt, among ``"query"``,
                ``"key"``, ``"value"``, ``"attention_output"``; None:
                `default_lora_layer_names` (all four).
            alpha: the scale numerator (updates are ``(alpha / r) A B``);
                None: ``alpha = rank``, keras-hub's and Keras' default.
                `keras_linattn.linearization.enable_lora` passes LoLCATs' 16.

        Returns:
            The list of the adapters' variables.

        Raises:
            ValueError: for a rank that is not a positive int, an `alpha`
                that is not a positive number, unknown `target_layer_names`,
                or projections that already have adapters.
        """
        alpha = rank if alpha is None else alpha
        check_rank_alpha(rank, alpha)
        targets = _check_targets(self.default_lora_layer_names() if target_layer_names is None else target_layer_names)
        attention = attention_layers(self)
        check_not_enabled(attention, rank)
        self.trainable = True
        freeze(walk_layers(self)[1:])
        add_adapters(attention, rank, alpha, in_config=True, targets=targets)
        self.lora_rank, self.lora_alpha = rank, alpha
        self.lora_targets = None if targets == PROJECTIONS else targets
        self._record_for_keras_hub(attention, targets)
        return adapter_variables(self)

    def _record_for_keras_hub(self, attention, targets):
        """What keras-hub's `save_lora_weights` / `load_lora_weights` read: the rank and the adapted layers.

        keras-hub finds the adapted layers by their index among the layers
        with weights (``_lora_enabled_layers``); its ``.lora.h5`` file keeps
        the rank only, and its loader enables the adapters with alpha = rank.
        """
        adapted = {id(dense) for layer in attention for dense in projections(layer, targets)}
        weighted = [layer for layer in _compat.flatten_layers(self, include_self=False) if layer.weights]
        self._lora_enabled_layers = [i for i, layer in enumerate(weighted) if id(layer) in adapted]
        self._lora_rank = self.lora_rank

    def merge_lora(self):
        """Folds the adapters into the kernels, in place: each becomes ``W + (alpha / r) A B``.

        The adapters are deleted, every weight is trainable again and the
        config records no adapters. For a model that holds this backbone,
        `keras_linattn.linearization.merge_lora` (a new model or in place)
        also carries the compile settings over.

        Raises:
            ValueError: for a backbone without adapters.
        """
        if self.lora_rank is None:
            raise ValueError("The backbone has no LoRA adapters to merge; call `enable_lora` first.")
        merge_adapters(attention_layers(self))
        self.lora_rank = self.lora_alpha = self.lora_targets = self._lora_rank = None
        self._lora_enabled_layers = []
        unfreeze(self)

    def _restore_lora(self, lora):
        """`enable_lora` again, on a backbone built from a config with ``"lora": {"rank", "alpha"}``."""
        keys = set(lora) if isinstance(lora, dict) else None
        if keys not in ({"rank", "alpha"}, {"rank", "alpha", "target_layer_names"}):
            raise ValueError(f'`lora` must be None or {{"rank": r, "alpha": a}}. Received: lora={lora!r}')
        frozen = not self.trainable
        self.enable_lora(lora["rank"], lora.get("target_layer_names"), alpha=lora["alpha"])
        if frozen:  # `enable_lora` makes the model trainable (its adapters); a frozen backbone stays frozen
            self.trainable = False

    def _lora_entry(self):
        """The config's ``"lora"`` entry: None, or ``{"rank", "alpha"}`` after `enable_lora`.

        ``"target_layer_names"`` joins it only when `enable_lora` adapted
        fewer than all four projections (configs with all four unchanged).

        Raises:
            ValueError: if variables other than the adapters were made
                trainable after `enable_lora` (the config records only its
                layout).
        """
        if self.lora_rank is None:
            return None
        adapters = {id(v) for v in adapter_variables(self)}
        extra = [v.path for v in self.variables if v.trainable and id(v) not in adapters]
        if extra:
            raise ValueError(
                "The model has LoRA adapters and other trainable variables; its config records only "
                "`enable_lora`'s layout (the adapters trainable, everything else frozen), so a saved copy would "
                f"reload with these frozen. Freeze them again, or merge first (`merge_lora`). Received: {extra}"
            )
        entry = {"rank": self.lora_rank, "alpha": self.lora_alpha}
        if getattr(self, "lora_targets", None) is not None:
            entry["target_layer_names"] = list(self.lora_targets)
        return entry
