"""Attention transfer: train a linearized model's feature maps to reproduce its teacher's attention outputs.

The LoLCATs recipe (Zhang et al. 2024, arXiv 2410.10254): for each pair
(teacher attention layer i, student attention layer i), with the student
teacher-forced,

    loss = mean_i  mean_{b, t, d} (student_i(x_i) - teacher_i(x_i))^2

where ``x_i`` is what the TEACHER's attention layer i receives on the batch
(its query, value and key) and both outputs are the layers' outputs
``[B, T, dim]`` (after the output projection). The mean is over unpadded
queries: those of the student call's ``query_mask`` (Keras' mask of the
query) or, in causal self-attention, of its key padding. Only `transfer_variables` of
each student layer are trained: its feature map's trainable weights and the
window's learnable gamma where the layer has one. Since every student layer
sees the teacher's inputs, the layers are trained side by side, each
against its own target; the loss is their mean.

The loss is the plain mean square error, not LoLCATs' ``1000 x MSE``: Adam's
updates do not change when the loss is multiplied by a constant (up to its
epsilon, 1e-7, far below these gradients), and the logged figure stays the
MSE itself.

How the inputs and outputs are captured (public Python and Keras API only,
`keras_linattn._capture`): during one forward pass of the teacher, each of
its attention layers' ``call`` is wrapped to record its arguments and
output; then during one forward pass of the student, each student attention
layer's ``call`` is wrapped to replace its query, value and key by the
recorded teacher's (the student's own masks and ``use_causal_mask`` are
kept) and to record its output. This works for functional, Sequential and
subclassed models (e.g. keras-hub decoders), whatever layers feed the
attention. Both passes run with ``training=False`` (no dropout).

Shape legend: B batch, T query length, S key length.
"""

import keras
import numpy as np
from keras import ops

from keras_linattn._capture import CallHooks, layer_names, walk_layers
from keras_linattn._trainer import DivergenceWarning, NonFiniteLossError, ObjectiveTrainer
from keras_linattn._trainer import as_dataset as _as_dataset
from keras_linattn._validation import check_one_of, check_positive_int
from keras_linattn.layers.linear_attention import LinearAttention
from keras_linattn.linearization import _attention_objective, families
from keras_linattn.linearization._generic import is_softmax_attention

__all__ = ["DivergenceWarning", "NonFiniteLossError", "attention_pairs", "attention_transfer", "transfer_variables"]

# Names of the window's learnable weights on a LinearAttention layer: its gamma, and its linear weight.
_WINDOW_WEIGHT_NAMES = ("window_gamma_logit", "window_gamma", "gamma", "window_linear_weight_log")


def transfer_variables(layer):
    """The variables attention transfer trains in one `LinearAttention` layer.

    The trainable weights of its feature map, and the window's learnable
    per-head gamma and linear weight if the layer has them (trainable
    weights of the layer itself named ``window_gamma_logit`` and
    ``window_linear_weight_log``, as `WindowRecurrence` names them, or
    ``window_gamma`` or ``gamma``; not one of its projections',
    convolution's or output norm's). The projections, the short convolution
    and everything outside the attention stay as they are.

    Args:
        layer: a built `LinearAttention`.

    Returns:
        A list of variables (possibly empty: e.g. ``elu`` has no weights).
    """
    if not isinstance(layer, LinearAttention):
        raise ValueError(f"`layer` must be a LinearAttention. Received: layer={layer!r}")
    chosen = [] if layer.feature_map is None else list(layer.feature_map.trainable_weights)
    inner = {id(v) for sub in walk_layers(layer)[1:] for v in sub.weights}
    for v in layer.trainable_weights:
        if id(v) not in inner and v.name in _WINDOW_WEIGHT_NAMES and all(v is not c for c in chosen):
            chosen.append(v)
    return chosen


def attention_pairs(teacher, student):
    """The (teacher attention layer, student attention layer) pairs attention transfer trains.

    The teacher's softmax attention layers (`keras.layers.MultiHeadAttention`,
    subclasses such as keras-hub's ``CachedMultiHeadAttention`` included) and
    the student's `LinearAttention` layers, each in the order of
    `keras_linattn._capture.walk_layers` (a model's public ``layers``, graph
    order for functional models; the layers held in the attributes of any
    other layer, depth-first), paired by position: the i-th with the i-th.
    `linearize` keeps that order. Pass your own pairs to `attention_transfer`
    for other layouts.

    Args:
        teacher: the softmax model.
        student: its linearized copy.

    Returns:
        A list of ``(teacher_layer, student_layer)``.

    Raises:
        ValueError: if either has no attention layer or their counts differ.
    """
    teacher_layers = [layer for layer in walk_layers(teacher) if is_softmax_attention(layer)]
    if not teacher_layers:  # a keras-hub family whose attention is its own layer class (Llama, Gemma, ...)
        teacher_layers = families.attention_layers(teacher)
    student_layers = [layer for layer in walk_layers(student) if isinstance(layer, LinearAttention)]
    if not teacher_layers or not student_layers or len(teacher_layers) != len(student_layers):
        raise ValueError(
            "The teacher's MultiHeadAttention layers and the student's LinearAttention layers must "
            "pair one to one (in model order). Received: "
            f"teacher layers {[layer.name for layer in teacher_layers]}, "
            f"student layers {[layer.name for layer in student_layers]}"
        )
    return list(zip(teacher_layers, student_layers, strict=True))


def _check_pairs(pairs, teacher, student):
    pairs = [tuple(pair) for pair in pairs]
    if not pairs or any(len(pair) != 2 for pair in pairs):
        raise ValueError(f"`pairs` must be a non-empty list of (teacher_layer, student_layer). Received: {pairs!r}")
    teacher_layers, student_layers = walk_layers(teacher), walk_layers(student)
    for t, s in pairs:
        if not isinstance(s, LinearAttention) or not any(s is layer for layer in student_layers):
            raise ValueError(f"Each pair's second layer must be a LinearAttention of the student. Received: {s!r}")
        if not any(t is layer for layer in teacher_layers):
            raise ValueError(f"Each pair's first layer must be a layer of the teacher. Received: {t!r}")
    for position, side in ((0, "teacher"), (1, "student")):
        ids = [id(pair[position]) for pair in pairs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"A {side} layer appears in two pairs. Received: {[p[position].name for p in pairs]}")
    return pairs


def _attention_inputs(arguments):
    """``(query, value, key)`` of a recorded attention call (MultiHeadAttention's argument names)."""
    named = arguments.arguments
    query = named["query"] if "query" in named else arguments.args[0]
    value = named.get("value", query)
    value = query if value is None else value
    return query, value, named.get("key")


def _query_mask(named):
    """The padding of a student attention call's queries ``[B, T]``, or None.

    Its ``query_mask`` (Keras' mask of the query), else in causal
    self-attention its key padding (the queries are the keys).
    """
    mask = named.get("query_mask")
    if mask is None and named.get("use_causal_mask") is True:
        mask = named.get("key_mask")
        mask = named.get("value_mask") if mask is None else mask
    return mask


def _mse(out, target, mask):
    """Mean over unpadded queries (all if `mask` is None) of the mean square error over the output dim."""
    squares = ops.mean(
        ops.square(ops.cast(out, "float32") - ops.stop_gradient(ops.cast(target, "float32"))), axis=-1
    )  # [B, T]
    if mask is None:
        return ops.mean(squares)
    weights = ops.cast(mask, "float32")  # [B, T]
    return ops.sum(squares * weights) / ops.maximum(ops.sum(weights), 1.0)


def _first(output):
    return output[0] if isinstance(output, (list, tuple)) else output


def _transfer_objective(teacher, student, pairs, names, objective_name="output"):
    teacher_layers = [t for t, _ in pairs]
    student_layers = [s for _, s in pairs]
    calls = {"teacher": [], "student": []}

    def record_teacher(index, call, arguments):
        output = call(*arguments.args, **arguments.kwargs)
        calls["teacher"][index].append((_attention_inputs(arguments), _first(output)))
        return output

    def force_student(index, call, arguments):
        recorded = calls["teacher"][index]
        done = calls["student"][index]
        if len(done) >= len(recorded):
            raise ValueError(
                f"Student attention layer {student_layers[index].name!r} is called more often than its teacher "
                f"layer {teacher_layers[index].name!r}: check the pairs. Received: {len(recorded)} teacher call(s)"
            )
        (query, value, key), target = recorded[len(done)]
        arguments.arguments["query"] = ops.stop_gradient(query)
        arguments.arguments["value"] = ops.stop_gradient(value)
        arguments.arguments["key"] = None if key is None else ops.stop_gradient(key)
        mask = _query_mask(arguments.arguments)
        entropy = None
        if objective_name != "output":
            named = arguments.arguments
            entropy = _attention_objective.attention_cross_entropy(
                student_layers[index], named["query"], named["value"], named["key"], mask, split_gradient="weights"
            )
        # The attention objective alone needs no student output: the later layers are teacher-forced too.
        output = target if objective_name == "attention" else call(*arguments.args, **arguments.kwargs)
        done.append((_first(output), target, mask, entropy))
        return output

    def objective(x):
        calls["teacher"] = [[] for _ in pairs]
        calls["student"] = [[] for _ in pairs]
        with CallHooks(teacher_layers, record_teacher):
            teacher(x, training=False)
        with CallHooks(student_layers, force_student):
            student(x, training=False)
        errors, entropies = [], []
        for index, (recorded, done) in enumerate(zip(calls["teacher"], calls["student"], strict=True)):
            if not done or len(done) != len(recorded):
                raise ValueError(
                    f"Attention layers {teacher_layers[index].name!r} (teacher) and "
                    f"{student_layers[index].name!r} (student) were not called as often on one batch "
                    "(a layer used only through `step`, or inside a while_loop / RNN cell, cannot be captured). "
                    f"Received: {len(recorded)} and {len(done)} call(s)"
                )
            if objective_name != "attention":
                errors.append(ops.mean(ops.stack([_mse(out, target, mask) for out, target, mask, _ in done])))
            if objective_name != "output":
                entropies.append(ops.mean(ops.stack([entropy for *_, entropy in done])))
        loss = ops.mean(ops.stack(errors)) if errors else 0.0
        if entropies:  # "both": the output MSE plus the cross-entropy
            loss = loss + ops.mean(ops.stack(entropies))
        logs = {"loss": loss}
        for prefix, values in (("mse", errors), ("ce", entropies)):
            if values:  # one per layer, or none for an objective that leaves it out
                logs.update({f"{prefix}/{name}": value for name, value in zip(names, values, strict=True)})
        return logs

    return objective


def _check_first_batch(teacher, x):
    """Refuses a first batch the teacher cannot run, before the teacher's own (raw TF) error.

    Token ids (an integer tensor, or the ``"token_ids"`` of a dict) must lie
    in ``[0, vocabulary_size)`` and rows may not be longer than
    ``max_sequence_length``, where the teacher (or its ``backbone``, as in
    keras-hub tasks) has these attributes. Float inputs must be finite.
    """
    ids = x.get("token_ids") if isinstance(x, dict) else x
    backbone = getattr(teacher, "backbone", teacher)
    if ids is not None and not isinstance(ids, (list, tuple, dict)):
        ids = ops.convert_to_numpy(ids)
        if ids.dtype.kind in "iu" and ids.ndim == 2 and ids.size:
            vocabulary = getattr(backbone, "vocabulary_size", None)
            low, high = int(ids.min()), int(ids.max())
            if isinstance(vocabulary, int) and (low < 0 or high >= vocabulary):
                raise ValueError(
                    f"`data` holds token ids outside the teacher's vocabulary [0, {vocabulary}): map them into it "
                    f"(or use the teacher's tokenizer). Received: vocabulary_size={vocabulary}, ids min={low}, "
                    f"max={high} in the first batch"
                )
            limit = getattr(backbone, "max_sequence_length", None)
            if isinstance(limit, int) and ids.shape[1] > limit:
                raise ValueError(
                    f"`data` holds sequences of {ids.shape[1]} tokens, longer than the teacher's "
                    f"max_sequence_length={limit}: cut them to at most {limit} tokens (e.g. "
                    f"`sequence_length={limit}` in the preprocessor). Received: first batch shape {ids.shape}"
                )
    for value in x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else [x]:
        value = ops.convert_to_numpy(value)
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            raise ValueError(
                "`data` holds NaN or inf values in its first batch: clean or drop those examples "
                f"(np.isfinite). Received: {int(np.size(value) - np.isfinite(value).sum())} non-finite value(s)"
            )


# Marks the assertions of `_checked_batches` in the error that fit raises.
_BATCH_CHECK = "keras_linattn batch check:"


def _teacher_limits(teacher):
    """``(vocabulary_size, max_sequence_length)`` of the teacher (or its ``backbone``); None where it has none."""
    backbone = getattr(teacher, "backbone", teacher)
    vocabulary = getattr(backbone, "vocabulary_size", None)
    limit = getattr(backbone, "max_sequence_length", None)
    return (vocabulary if isinstance(vocabulary, int) else None), (limit if isinstance(limit, int) else None)


def _checked_batches(dataset, teacher, what):
    """`dataset`, each batch's token ids and length checked as tf.data reads it.

    The check runs in the input pipeline, outside the training step, so it
    holds under XLA too (which drops assertions and clamps an out-of-range
    gather index to the table's last row). A batch that fails it stops
    `fit` with an ``InvalidArgumentError`` marked with `_BATCH_CHECK`, which
    `attention_transfer` raises as a ValueError naming the batch (counted
    from 0 within one pass of `dataset`).
    """
    import tensorflow as tf

    vocabulary, limit = _teacher_limits(teacher)
    if vocabulary is None and limit is None:
        return dataset

    def check(index, element):
        x = element[0] if isinstance(element, tuple) else element
        ids = x.get("token_ids") if isinstance(x, dict) else x
        if not isinstance(ids, tf.Tensor) or not ids.dtype.is_integer or ids.shape.rank != 2:
            return element
        prefix = f"{_BATCH_CHECK} `{what}` batch"
        checks = []
        if vocabulary is not None:
            inside = tf.reduce_all(tf.logical_and(ids >= 0, ids < vocabulary))
            data = [
                prefix,
                index,
                f"(counted from 0) holds token ids outside the teacher's vocabulary_size={vocabulary}: map them "
                "into it (or use the teacher's tokenizer). Received: ids min",
                tf.reduce_min(ids),
                "max",
                tf.reduce_max(ids),
            ]
            checks.append(tf.debugging.Assert(inside, data))
        if limit is not None:
            length = tf.shape(ids)[1]
            data = [
                prefix,
                index,
                f"(counted from 0) holds rows longer than the teacher's max_sequence_length={limit}: cut them to "
                f"at most {limit} tokens. Received: rows of",
                length,
                "tokens",
            ]
            checks.append(tf.debugging.Assert(length <= limit, data))
        with tf.control_dependencies(checks):
            return tf.nest.map_structure(tf.identity, element)

    return dataset.enumerate().map(check)


def _batch_error(error):
    """The ValueError of a failed `_checked_batches` assertion (None for any other error)."""
    import re

    text = str(error)
    start = text.find(_BATCH_CHECK)
    if start < 0:
        return None
    line = text[start:].splitlines()[0]
    message = " ".join(re.findall(r"\[([^\[\]]*)\]", "[" + line))
    return ValueError(message.replace(_BATCH_CHECK, "").replace("\\'", "'").strip())


def _is_text(data):
    """True for a list / tuple / numpy array of Python strings (or bytes)."""
    if isinstance(data, (list, tuple)) and data:
        return all(isinstance(item, (str, bytes)) for item in data)
    return isinstance(data, np.ndarray) and data.dtype.kind in "USO" and data.size > 0 and data.ndim == 1


def _tokenized(data, teacher, student, argument):
    """Strings through the teacher's preprocessor (else the student's): ``{"token_ids", "padding_mask"}`` arrays.

    Args:
        data: what the caller passed; returned unchanged unless it is text.
        teacher, student: the models; the first with a ``preprocessor`` tokenizes.
        argument: the argument's name, for the error.

    Returns:
        `data`, or a dict of numpy arrays ``[N, sequence_length]``.

    Raises:
        ValueError: text for models without a preprocessor.
    """
    if not _is_text(data):
        return data
    preprocessor = getattr(teacher, "preprocessor", None) or getattr(student, "preprocessor", None)
    if preprocessor is None:
        raise ValueError(
            f"`{argument}` holds strings, but neither the teacher nor the student has a preprocessor to tokenize "
            f"them: pass token ids ({{'token_ids', 'padding_mask'}} arrays). Received: {argument}={list(data)[:2]!r}..."
        )
    x, _, _ = keras.utils.unpack_x_y_sample_weight(preprocessor(list(data) if isinstance(data, tuple) else data))
    return {key: np.asarray(value) for key, value in x.items()}


def attention_transfer(
    student,
    teacher,
    data,
    *,
    steps,
    learning_rate=1e-2,
    epochs=1,
    optimizer=None,
    batch_size=32,
    pairs=None,
    callbacks=None,
    validation_data=None,
    validation_steps=None,
    jit_compile=False,
    verbose=1,
    objective="output",
    freeze=None,
):
    """Trains a linearized model's feature maps (and window gammas) to match its teacher's attention.

    See the module docstring for the loss (mean over attention layers of the
    MSE between each student layer's output and its teacher layer's, the
    student teacher-forced) and how layers are captured. Training runs
    through ``fit`` on a `keras.Model` whose ``train_step`` takes one step
    (the trainer shared with `keras_linattn.distill.distill_attention`):
    callbacks, the progress bar and `keras.callbacks.BackupAndRestore` work
    (it saves the student's and teacher's weights and the optimizer's
    state; on resuming, the data iterator starts again from the beginning).
    The student is modified in place: only `transfer_variables` of its
    paired layers change. The teacher is not modified.

    Args:
        student: the linearized model (e.g. from `keras_linattn.linearize`).
        teacher: the softmax model it was made from.
        data: a `tf.data.Dataset` of batches (``x`` or ``(x, y[, w])``;
            labels are ignored), repeated as needed, or arrays / a dict of
            arrays batched with `batch_size`, or a list of strings, which
            the teacher's preprocessor (else the student's) tokenizes.
        steps: training steps per epoch (keyword-only).
        learning_rate: learning rate of the default Adam optimizer. Default
            1e-2 (LoLCATs').
        epochs: number of epochs of `steps` steps. Default 1.
        optimizer: optional Keras optimizer (overrides `learning_rate`).
        batch_size: batch size for array data.
        pairs: None for `attention_pairs(teacher, student)`, or a list of
            ``(teacher_layer, student_layer)``.
        callbacks: optional list of `keras.callbacks.Callback` for ``fit``
            (their ``model`` is the trainer; its ``student`` and ``teacher``
            attributes are the models).
        validation_data: optional data for ``fit``'s per-epoch validation
            (``val_loss``, ``val_mse/<layer>``).
        validation_steps: batches of `validation_data` per evaluation.
        jit_compile: compile the training step with XLA.
        verbose: 0 silent, 1 progress bar, 2 one line per epoch.
        objective: ``"output"`` (default: the MSE of the layers' outputs,
            as above), ``"attention"`` (Hedgehog's cross-entropy between the
            teacher's softmax weights and the student's window + linear
            weights, per layer, head and row:
            `keras_linattn.linearization._attention_objective`; causal
            self-attention) or ``"both"`` (their sum). The cross-entropy's
            split between the window and the linear part trains the
            window's gamma and linear weight only, and the feature map
            learns the linear part's shape (``split_gradient="weights"``
            there): the features are not pushed to raise the linear part's
            share, which with bounded features collapses them (the plain
            gradient's failure with both weights frozen).
        freeze: None (default), or a tuple of ``"gamma"`` and
            ``"linear_weight"``: those window weights stay as they are (the
            feature map still trains).

    Returns:
        ``(student, history)``: the student, and the `keras.callbacks.History`
        of ``fit`` (per-epoch means of ``loss``, ``mse/<student layer>`` and,
        with the attention objective, ``ce/<student layer>``;
        a student layer whose name repeats an earlier one's is logged as
        ``mse/<name>_<index>``).

    Raises:
        ValueError: for bad arguments, unpaired attention layers, paired
            layers with nothing to train, or a first batch the teacher cannot
            run (token ids outside its vocabulary, rows longer than its
            ``max_sequence_length``, NaN/inf inputs).
        NonFiniteLossError: a step's loss or gradient was NaN or inf; that
            step's update was not applied and training stopped.

    Warns:
        DivergenceWarning: the last epoch's mean loss is above the first
            step's (the message names the learning rate).

    Example:

    >>> import keras
    >>> import numpy as np
    >>> import keras_linattn
    >>> keras.utils.set_random_seed(0)
    >>> inputs = keras.Input((16, 8))
    >>> attention = keras.layers.MultiHeadAttention(2, 4, name="attention")  # named: the metric's name
    >>> teacher = keras.Model(inputs, attention(inputs, inputs, use_causal_mask=True))
    >>> student = keras_linattn.linearize(teacher, window_size=4)
    >>> x = np.random.default_rng(0).normal(size=(8, 16, 8)).astype("float32")
    >>> student, history = keras_linattn.attention_transfer(student, teacher, x, steps=4, batch_size=4, verbose=0)
    >>> sorted(history.history)
    ['loss', 'mse/attention']
    """
    steps = check_positive_int("steps", steps)
    check_one_of("objective", objective, _attention_objective.OBJECTIVES)
    frozen = _attention_objective.frozen_names(freeze)
    epochs = check_positive_int("epochs", epochs)
    check_one_of("verbose", verbose, (0, 1, 2))
    if student is teacher:
        raise ValueError(
            "`student` and `teacher` must be two models (the teacher is left unchanged). "
            f"Received: the same model {student.name!r} twice"
        )
    pairs = attention_pairs(teacher, student) if pairs is None else _check_pairs(pairs, teacher, student)
    data = _tokenized(data, teacher, student, "data")
    validation_data = _tokenized(validation_data, teacher, student, "validation_data")
    dataset = _as_dataset(data, batch_size)
    validation = None if validation_data is None else _as_dataset(validation_data, batch_size)
    first = next(iter(dataset), None)
    if first is None:
        raise ValueError(f"`data` yielded no batch. Received: data={type(data).__name__} with no element")
    x, _, _ = keras.utils.unpack_x_y_sample_weight(first)
    _check_first_batch(teacher, x)
    teacher(x, training=False)  # builds both models (their layers are built before fit)
    student(x, training=False)
    variables, seen = [], set()
    for _, layer in pairs:
        for v in transfer_variables(layer):
            if id(v) not in seen and v.name not in frozen:
                seen.add(id(v))
                variables.append(v)
    if not variables:
        raise ValueError(
            "The student's attention layers have nothing to train (a feature map with trainable weights, "
            f"e.g. 'hedgehog', or a window gamma). Received: layers={[s.name for _, s in pairs]}"
        )
    names = layer_names([s for _, s in pairs])
    log_names = ["loss"] + [f"mse/{name}" for name in names if objective != "attention"]
    log_names += [f"ce/{name}" for name in names if objective != "output"]
    objective = _transfer_objective(teacher, student, pairs, names, objective)
    trainer = ObjectiveTrainer(
        objective, variables, {"student": student, "teacher": teacher}, log_names, name="attention_transfer"
    )
    trainer.compile(
        optimizer=keras.optimizers.Adam(learning_rate) if optimizer is None else optimizer, jit_compile=jit_compile
    )
    dataset = _checked_batches(dataset, teacher, "data")
    if validation is not None:
        validation = _checked_batches(validation, teacher, "validation_data")
    try:
        history = trainer.fit(
            dataset.repeat(),
            epochs=epochs,
            steps_per_epoch=steps,
            callbacks=callbacks,
            validation_data=validation,
            validation_steps=validation_steps,
            verbose=verbose,
            shuffle=False,
        )
    except Exception as e:  # TensorFlow's InvalidArgumentError, from a batch check of the input pipeline
        refused = _batch_error(e)
        if refused is None:
            raise
        raise refused from None
    return student, history
