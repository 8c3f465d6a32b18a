"""Attention distillation: train feature maps so linear attention mimics softmax attention.

For every `LinearAttention` layer of a model whose feature map has trainable
weights (``hedgehog``, ``ffn``, ``glu``, ``oglu``, ``aoglu``, ...), the
queries and keys the layer actually sees on real batches are projected with
the layer's own (frozen) projections, and the feature map alone is trained
to minimize the soft cross-entropy between the two attention distributions:

    loss_layer = - mean_{b, h, i} sum_j p_softmax[b, h, i, j] log p_linear[b, h, i, j]

    p_softmax = softmax(q_i . k_j / sqrt(D))   (exact, quadratic)
    p_linear  = phi(q_i) . phi(k_j) / sum_j' phi(q_i) . phi(k_j')

averaged over layers (the Hedgehog recipe, Zhang et al. 2024). The reported
figure is the KL divergence ``KL(p_softmax || p_linear)``, which differs from
the cross-entropy by the (constant) softmax entropy: it is 0 for a perfect
match. Both use the layer's padding and causal masks.

The layers are found and their inputs captured with public API
(`keras_linattn._capture`): while the model runs forward, a wrapper of each
`LinearAttention` layer's ``call`` records the arguments it is called with
(query, value, key, masks, ``use_causal_mask``). This works for functional,
Sequential and subclassed models and for layers nested in blocks or
sub-models, as long as the attention layer is invoked as ``layer(...)`` on
each forward pass (not from inside a ``while_loop`` / RNN cell, as the
recurrent ``step`` path does). Inputs are re-captured on every step from the
model itself, with gradients stopped, so each layer is trained on the inputs
produced by the already-updated layers before it.

Training runs through ``fit`` on the trainer shared with
`keras_linattn.attention_transfer` (`keras_linattn._trainer`): a
`keras.Model` whose ``train_step`` takes one step on the feature maps, so
Keras callbacks (`keras.callbacks.BackupAndRestore` included) work.

Distillation forms the ``[B, H, T, S]`` attention matrices: use it with
training-sized sequences, not with the long ones linear attention serves.

Shape legend: B batch, T query length, S key length, H heads, D key dim,
C feature dim.
"""

import dataclasses

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from keras_linattn._capture import CallHooks, layer_names, walk_layers
from keras_linattn._trainer import ObjectiveTrainer
from keras_linattn._trainer import as_dataset as _as_dataset
from keras_linattn._validation import check_bool, check_one_of, check_optional_positive_int, check_positive_int
from keras_linattn.layers.linear_attention import LinearAttention
from keras_linattn.ops import reference

__all__ = ["DistillationHistory", "attention_kl", "distill_attention", "find_attention_layers"]


# Floor of the linear attention weights inside the log (maps such as relu
# can give exact zeros where softmax is positive).
_LOG_FLOOR = 1e-12


@dataclasses.dataclass
class DistillationHistory:
    """What `distill_attention` did.

    Attributes:
        layers: names of the distilled layers, in model order (a name
            that repeats an earlier layer's gets ``_<index>`` appended).
        kl_before: per-layer ``KL(p_softmax || p_linear)`` before training,
            on the evaluation data.
        kl_after: the same after training.
        history: per-epoch training figures: ``"kl"`` (mean over layers),
            ``"loss"`` (cross-entropy plus feature-map regularization) and
            ``"kl/<layer name>"``.
    """

    layers: list
    kl_before: dict
    kl_after: dict
    history: dict

    @property
    def mean_kl_before(self):
        return float(np.mean(list(self.kl_before.values())))

    @property
    def mean_kl_after(self):
        return float(np.mean(list(self.kl_after.values())))


def find_attention_layers(model, trainable_only=True):
    """The `LinearAttention` layers of `model` (recursively), in model order.

    The order is `keras_linattn._capture.walk_layers`'s: a model's public
    ``layers`` (graph order for functional models), and the layers held in
    the attributes of any other layer, depth-first.

    Args:
        model: a Keras model or layer.
        trainable_only: keep only layers whose feature map has trainable
            weights (once built) or is not built yet.
    """
    found = []
    for layer in walk_layers(model):
        if not isinstance(layer, LinearAttention):
            continue
        fm = layer.feature_map
        if trainable_only and (fm is None or (fm.built and not fm.trainable_weights)):
            continue
        found.append(layer)
    return found


class _CallRecorder:
    """Context manager recording the arguments of every call of some layers (`CallHooks`)."""

    def __init__(self, layers):
        self.layers = layers
        self.records = []
        self._hooks = CallHooks(layers, self._around)

    def _around(self, index, call, arguments):
        self.records.append((index, dict(arguments.arguments)))
        return call(*arguments.args, **arguments.kwargs)

    def __enter__(self):
        self.records = []
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._hooks.__exit__(*exc_info)


def _resolve_causal(arguments, causal):
    if causal is not None:
        return bool(causal)
    flag = arguments.get("use_causal_mask", False)
    if not isinstance(flag, (bool, np.bool_)):
        raise ValueError(
            "`use_causal_mask` of a LinearAttention call is a tensor, so distillation "
            "cannot tell whether the layer is causal. Pass `causal=True` or `causal=False`. "
            f"Received: use_causal_mask={flag!r}"
        )
    return bool(flag)


def _layer_terms(layer, arguments, causal):
    """Sums over valid query rows of one recorded call.

    Returns ``(cross_entropy_sum, kl_sum, row_count)`` float32 scalars.
    """
    query, value, key = arguments["query"], arguments["value"], arguments.get("key")
    key_mask = arguments.get("key_mask")
    if key_mask is None:
        key_mask = arguments.get("value_mask")
    causal = _resolve_causal(arguments, causal)
    # What the feature map sees: projections, GQA's repeated heads, the short
    # convolution and the rotary embeddings (not `project`, which stops before them).
    q, k, _ = layer.attention_inputs(query, value, key, key_mask=key_mask, use_causal_mask=causal)  # [B,T|S,H,D]
    q = ops.stop_gradient(q)
    k = ops.stop_gradient(k)
    fm = layer.feature_map
    qf = fm(q, is_query=True, causal=causal, training=False)  # [B, T, H, C]
    kf = fm(k, is_query=False, causal=causal, training=False)  # [B, S, H, C]
    p_soft = reference.softmax_attention_weights(q, k, causal=causal, key_mask=key_mask)  # [B, H, T, S]
    p_lin = reference.kernel_attention_weights(qf, kf, causal=causal, key_mask=key_mask)  # [B, H, T, S]
    log_lin = ops.log(ops.maximum(p_lin, _LOG_FLOOR))  # [B, H, T, S]
    positive = p_soft > 0
    log_soft = ops.log(ops.where(positive, p_soft, ops.ones_like(p_soft)))  # [B, H, T, S]
    cross = -ops.sum(p_soft * log_lin, axis=-1)  # [B, H, T]
    entropy = -ops.sum(p_soft * log_soft, axis=-1)  # [B, H, T]
    valid = ops.cast(ops.sum(p_soft, axis=-1) > 0.5, "float32")  # [B, H, T]
    return (
        ops.sum(cross * valid),
        ops.sum((cross - entropy) * valid),
        ops.sum(valid),
    )


def _per_layer_terms(layers, records, causal):
    """Per-layer ``(ce_sum, kl_sum, count)`` lists, summed over each layer's calls."""
    sums = [[0.0, 0.0, 0.0] for _ in layers]
    seen = [False] * len(layers)
    for index, arguments in records:
        terms = _layer_terms(layers[index], arguments, causal)
        sums[index] = [a + b for a, b in zip(sums[index], terms, strict=True)]
        seen[index] = True
    missing = [layers[i].name for i, s in enumerate(seen) if not s]
    if missing:
        raise ValueError(
            "These LinearAttention layers were not called during the forward pass, so "
            "their inputs could not be captured (a layer used only through `step`, or "
            f"inside a while_loop / RNN cell, is not supported). Received: layers={missing}"
        )
    return sums


def _inputs_of(batch):
    x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
    return x


def _select_layers(model, layers):
    if layers is None:
        chosen = find_attention_layers(model, trainable_only=True)
    else:
        everything = find_attention_layers(model, trainable_only=False)
        chosen = []
        for layer in layers:
            if isinstance(layer, str):
                match = [found for found in everything if found.name == layer]
                if not match:
                    raise ValueError(
                        "No LinearAttention layer of that name in the model. "
                        f"Received: layers=[..., {layer!r}, ...]; available: {[found.name for found in everything]}"
                    )
                layer = match[0]
            elif not any(layer is found for found in everything):
                raise ValueError(f"`layers` must name LinearAttention layers of the model. Received: {layer!r}")
            chosen.append(layer)
    if not chosen:
        raise ValueError(
            "The model has no LinearAttention layer with a trainable feature map to distill "
            "(e.g. feature_map='hedgehog'). "
            f"Received: model={model.name!r}"
        )
    return chosen


def _evaluate(model, layers, dataset, steps, causal):
    if steps is None and dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise ValueError("The evaluation data is infinite: pass a number of steps. Received: steps=None")
    recorder = _CallRecorder(layers)

    @tf.function(reduce_retracing=True)
    def batch_terms(x):
        with recorder:
            model(x, training=False)
        sums = _per_layer_terms(layers, recorder.records, causal)
        return [ops.stack([ops.convert_to_tensor(v, "float32") for v in s]) for s in sums]

    totals = np.zeros((len(layers), 3))
    for step, batch in enumerate(dataset):
        if steps is not None and step >= steps:
            break
        totals += np.stack([np.asarray(t) for t in batch_terms(_inputs_of(batch))])
    if not totals[:, 2].all():
        raise ValueError("No attention rows to evaluate: `data` is empty or every key is masked.")
    return totals[:, 1] / totals[:, 2]


def attention_kl(model, data, steps=None, batch_size=32, causal=None, layers=None):
    """Mean ``KL(p_softmax || p_linear)`` per `LinearAttention` layer.

    Args:
        model: a built Keras model containing `LinearAttention` layers.
        data: a `tf.data.Dataset` of batches (``x`` or ``(x, y[, w])``) or
            arrays / a tuple ``(x, y)`` / a dict of arrays, batched with
            `batch_size`.
        steps: number of batches to use; None means the whole data.
        batch_size: batch size for array data.
        causal: None reads ``use_causal_mask`` from each layer call; a bool
            overrides it for every layer.
        layers: None for every `LinearAttention` layer with a trainable
            feature map; or a list of layers / layer names (any feature map).

    Returns:
        A dict ``{layer name: KL}`` (nats per query row, averaged over
        batch, heads and unpadded query rows). A layer whose name repeats
        an earlier layer's is keyed ``<name>_<index>``.
    """
    steps = check_optional_positive_int("steps", steps)
    chosen = _select_layers(model, layers)
    values = _evaluate(model, chosen, _as_dataset(data, batch_size), steps, causal)
    return dict(zip(layer_names(chosen), (float(v) for v in values), strict=True))


def distill_attention(
    model,
    data,
    epochs=1,
    steps_per_epoch=None,
    learning_rate=1e-2,
    optimizer=None,
    batch_size=32,
    causal=None,
    layers=None,
    validation_data=None,
    validation_steps=None,
    jit_compile=False,
    verbose=1,
    callbacks=None,
):
    """Trains only the feature maps so linear attention matches softmax attention.

    Nothing else of the model is updated, and no ``trainable`` flag is
    changed. Training runs through ``fit`` on a `keras.Model` whose
    ``train_step`` takes one step on the feature maps (the trainer shared
    with `keras_linattn.attention_transfer`), so Keras callbacks work,
    `keras.callbacks.BackupAndRestore` included (it saves the model's
    weights and the optimizer's state). Weight regularizers of the feature maps (e.g. an
    orthogonality penalty) are added to the loss.

    Args:
        model: a Keras model (functional, Sequential or subclassed) containing
            `LinearAttention` layers with trainable feature maps.
        data: a `tf.data.Dataset` of batches (``x`` or ``(x, y[, w])``; labels
            are ignored) or arrays / a tuple ``(x, y)`` / a dict of arrays.
        epochs: number of epochs.
        steps_per_epoch: batches per epoch; None means one pass over `data`
            (which must then be finite). With a number, `data` is repeated.
        learning_rate: learning rate of the default Adam optimizer.
        optimizer: optional Keras optimizer instance (overrides `learning_rate`).
        batch_size: batch size for array data.
        causal: None reads ``use_causal_mask`` from each layer call; a bool
            overrides it.
        layers: None for every `LinearAttention` layer with a trainable
            feature map, or a list of such layers / names.
        validation_data: data for the before/after KL; defaults to `data`.
        validation_steps: batches for the before/after KL; defaults to
            `steps_per_epoch` (None: the whole validation data).
        jit_compile: compile the distillation step with XLA.
        verbose: 0 silent, 1 progress bar, 2 one line per epoch.
        callbacks: optional list of `keras.callbacks.Callback` for ``fit``
            (their ``model`` is the trainer, whose ``model`` attribute is
            `model`).

    Returns:
        A `DistillationHistory` with per-layer KL before and after.

    Raises:
        NonFiniteLossError: a step's loss or gradient was NaN or inf (e.g. a
            NaN in `data`, a learning rate far too high); that step's update
            was not applied and training stopped.

    Warns:
        DivergenceWarning: the last epoch's mean loss is above the first
            step's (the message names the learning rate).

    Example:

    >>> import keras
    >>> import numpy as np
    >>> from keras_linattn import layers
    >>> keras.utils.set_random_seed(0)
    >>> inputs = keras.Input((16, 32))
    >>> attention = layers.LinearAttention(2, 16, feature_map="hedgehog")
    >>> model = keras.Model(inputs, attention(inputs, inputs))
    >>> x_train = np.random.default_rng(0).normal(size=(8, 16, 32)).astype("float32")
    >>> history = distill_attention(model, x_train, epochs=3, batch_size=4, learning_rate=1e-2, verbose=0)
    >>> history.kl_after[attention.name] < history.kl_before[attention.name]
    True
    """
    epochs = check_positive_int("epochs", epochs)
    steps_per_epoch = check_optional_positive_int("steps_per_epoch", steps_per_epoch)
    validation_steps = check_optional_positive_int("validation_steps", validation_steps)
    check_one_of("verbose", verbose, (0, 1, 2))
    if causal is not None:
        check_bool("causal", causal)
    dataset = _as_dataset(data, batch_size)
    eval_dataset = dataset if validation_data is None else _as_dataset(validation_data, batch_size)
    eval_steps = validation_steps if validation_steps is not None else steps_per_epoch
    if steps_per_epoch is None and dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise ValueError("`data` is infinite: pass `steps_per_epoch`. Received: steps_per_epoch=None")

    chosen = _select_layers(model, layers)
    names = layer_names(chosen)
    if next(iter(dataset), None) is None:
        raise ValueError("`data` yielded no batch.")
    before = _evaluate(model, chosen, eval_dataset, eval_steps, causal)  # also builds the model
    feature_maps = []
    for layer in chosen:
        if not any(layer.feature_map is fm for fm in feature_maps):
            feature_maps.append(layer.feature_map)
    variables, seen = [], set()
    for fm in feature_maps:
        for v in fm.trainable_weights:
            if id(v) not in seen:
                seen.add(id(v))
                variables.append(v)
    if not variables:
        raise ValueError(
            "The selected feature maps have no trainable weights. "
            f"Received: layers={names}, feature maps={[type(fm).__name__ for fm in feature_maps]}"
        )
    if optimizer is None:
        optimizer = keras.optimizers.Adam(learning_rate)
    recorder = _CallRecorder(chosen)

    def objective(x):
        with recorder:
            model(x, training=False)
        sums = _per_layer_terms(chosen, recorder.records, causal)
        ce = [s[0] / ops.maximum(s[2], 1.0) for s in sums]
        penalty = sum((ops.sum(ops.stack(fm.losses)) for fm in feature_maps if fm.losses), 0.0)
        kls = [s[1] / ops.maximum(s[2], 1.0) for s in sums]
        logs = {"loss": ops.mean(ops.stack(ce)) + penalty, "kl": ops.mean(ops.stack(kls))}
        logs.update({f"kl/{name}": kl for name, kl in zip(names, kls, strict=True)})
        return logs

    log_names = ["loss", "kl"] + [f"kl/{name}" for name in names]
    trainer = ObjectiveTrainer(objective, variables, {"model": model}, log_names, name="distill")
    trainer.compile(optimizer=optimizer, jit_compile=jit_compile)
    fit = trainer.fit(
        dataset if steps_per_epoch is None else dataset.repeat(),
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        verbose=verbose,
        callbacks=callbacks,
        shuffle=False,
    )
    history = {key: [float(v) for v in fit.history[key]] for key in log_names}

    after = _evaluate(model, chosen, eval_dataset, eval_steps, causal)
    return DistillationHistory(
        layers=names,
        kl_before=dict(zip(names, (float(v) for v in before), strict=True)),
        kl_after=dict(zip(names, (float(v) for v in after), strict=True)),
        history=history,
    )
