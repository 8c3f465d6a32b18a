"""The steps of the linearization example, small enough to test.

Teachers are keras-hub ``GPT2CausalLM`` / ``LlamaCausalLM`` (random init,
character vocabulary, trained here) or a real preset. The student is
`keras_linattn.linearize(teacher, window_size=W)`: hedgehog feature maps
plus a softmax window of W tokens, the teacher's weights copied.

Shape legend: B batch, T sequence length, V vocabulary.
"""

import math
import time

import keras
import keras_hub
import numpy as np
import tensorflow as tf

import keras_linattn
from keras_linattn import feature_maps
from keras_linattn._capture import walk_layers
from keras_linattn.feature_maps.base import FeatureMap
from keras_linattn.linearization import enable_lora, merge_lora
from keras_linattn.models import LinearCausalLM

FAMILIES = ("gpt2", "llama")
LN2 = math.log(2.0)


def build_teacher(family, vocabulary_size, *, hidden_dim=64, num_layers=2, num_heads=2, sequence_length=512, seed=0):
    """A random-init keras-hub causal LM (no preprocessor: it takes token ids)."""
    keras.utils.set_random_seed(seed)
    if family == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=vocabulary_size,
            num_layers=num_layers,
            num_heads=num_heads,
            hidden_dim=hidden_dim,
            intermediate_dim=4 * hidden_dim,
            max_sequence_length=sequence_length,
        )
        return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    if family == "llama":
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=vocabulary_size,
            num_layers=num_layers,
            num_query_heads=num_heads,
            num_key_value_heads=max(1, num_heads // 2),  # grouped-query attention
            hidden_dim=hidden_dim,
            intermediate_dim=2 * hidden_dim,
        )
        return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
    raise ValueError(f"`family` must be one of {FAMILIES}. Received: family={family!r}")


def as_inputs(x):
    """keras-hub's input dict for ``[B, T]`` ids (no padding)."""
    x = tf.convert_to_tensor(x)
    return {"token_ids": x, "padding_mask": tf.ones_like(x)}


def dataset(ids, sequence_length, batch_size, seed=0):
    """Shuffled, repeated ``({"token_ids", "padding_mask"}, targets)`` batches of non-overlapping windows."""
    span = sequence_length + 1
    n = len(ids) // span
    if n < batch_size:
        raise ValueError(f"Too few ids for one batch. Received: len(ids)={len(ids)}, sequence_length={sequence_length}")
    blocks = np.asarray(ids[: n * span], np.int32).reshape(n, span)
    ds = tf.data.Dataset.from_tensor_slices(blocks).shuffle(n, seed=seed).repeat()
    ds = ds.batch(batch_size, drop_remainder=True)
    return ds.map(lambda w: (as_inputs(w[:, :-1]), w[:, 1:])).prefetch(tf.data.AUTOTUNE)


def compile_lm(model, learning_rate):
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate, clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sampler="greedy",
    )
    return model


def train(model, ids, *, steps, sequence_length, batch_size, learning_rate, seed=0, verbose=2):
    """Next-token training for `steps` steps; returns the tokens seen (steps * B * T)."""
    if isinstance(learning_rate, float) and steps > 20:
        learning_rate = keras.optimizers.schedules.CosineDecay(
            0.0, steps, alpha=0.1, warmup_target=learning_rate, warmup_steps=max(1, steps // 10)
        )
    compile_lm(model, learning_rate)
    model.fit(dataset(ids, sequence_length, batch_size, seed), steps_per_epoch=steps, epochs=1, verbose=verbose)
    return steps * batch_size * sequence_length


def bits_per_char(model, ids, sequence_length, max_sequences=16, chars_per_token=1.0):
    """Bits per character on non-overlapping windows of held-out ids (mean over all predicted tokens)."""
    span = sequence_length + 1
    n = min(max_sequences, len(ids) // span)
    if n < 1:
        raise ValueError(f"Held-out text shorter than one window. Received: len(ids)={len(ids)}")
    blocks = np.asarray(ids[: n * span], np.int32).reshape(n, span)
    nats, count = 0.0, 0
    for block in blocks:
        x, y = block[None, :-1], block[None, 1:]
        logits = np.asarray(model(as_inputs(tf.constant(x)), training=False), "float64")  # [1, T, V]
        logits = logits - logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        nats -= np.take_along_axis(logp, y[..., None], -1).sum()
        count += y.size
    return float(nats / count / LN2 / chars_per_token)


def attention_layers(model):
    """The attention layers of a keras-hub decoder, or of a `LinearCausalLM`, in block order."""
    backbone = model.backbone if hasattr(model, "backbone") else model
    if isinstance(model, LinearCausalLM) or hasattr(backbone, "decoder_blocks"):
        return [block.attention for block in backbone.decoder_blocks]
    return [block._self_attention_layer for block in backbone.transformer_layers]


def transfer(student, teacher, ids, *, steps, sequence_length, batch_size, learning_rate=1e-2, verbose=2):
    """LoLCATs attention transfer (feature maps and window gamma only); returns (tokens, first loss, last loss)."""
    pairs = list(zip(attention_layers(teacher), attention_layers(student), strict=True))
    data = dataset(ids, sequence_length, batch_size, seed=1).map(lambda x, y: x)
    _, history = keras_linattn.attention_transfer(
        student, teacher, data, steps=1, epochs=steps, learning_rate=learning_rate, pairs=pairs, verbose=0
    )
    losses = history.history["loss"]
    if verbose:
        print(f"  transfer: loss {losses[0]:.4g} -> {losses[-1]:.4g} over {steps} steps", flush=True)
    return steps * batch_size * sequence_length, float(losses[0]), float(losses[-1])


def lora_student(student, ids, *, steps, sequence_length, batch_size, learning_rate, rank=8, alpha=16, verbose=2):
    """LoRA on the student's q/k/v/o, trained then merged; returns (merged student, tokens)."""
    enable_lora(student, rank=rank, alpha=alpha)
    tokens = train(
        student,
        ids,
        steps=steps,
        sequence_length=sequence_length,
        batch_size=batch_size,
        learning_rate=keras.optimizers.schedules.CosineDecay(learning_rate, steps, alpha=0.1),
        seed=2,
        verbose=verbose,
    )
    return merge_lora(student), tokens


def enable_teacher_lora(teacher, rank=8, alpha=16):
    """The control: the same adapters (rank, alpha, q/k/v/o) on the softmax teacher; everything else frozen."""
    adapters = []
    for attention in attention_layers(teacher):
        for name in ("_query_dense", "_key_dense", "_value_dense", "_output_dense"):
            dense = getattr(attention, name)
            dense.enable_lora(rank, lora_alpha=alpha)
            adapters += [dense.lora_kernel_a, dense.lora_kernel_b]
    chosen = {id(v) for v in adapters}
    for v in teacher.weights:
        if id(v) not in chosen:
            v.trainable = False
    trainable = {id(v) for v in teacher.trainable_weights}
    if trainable != {id(v) for v in adapters}:
        raise RuntimeError("The teacher LoRA control trains more than its adapters.")
    return adapters


def lora_teacher(teacher, ids, *, steps, sequence_length, batch_size, learning_rate, rank=8, alpha=16, verbose=2):
    enable_teacher_lora(teacher, rank, alpha)
    return train(
        teacher,
        ids,
        steps=steps,
        sequence_length=sequence_length,
        batch_size=batch_size,
        learning_rate=keras.optimizers.schedules.CosineDecay(learning_rate, steps, alpha=0.1),
        seed=2,
        verbose=verbose,
    )


@keras.saving.register_keras_serializable(package="examples.linearize")
class ZeroFeatureMap(FeatureMap):
    """``phi(x) = 0``: in a window recurrence, only the softmax window is left (the linear part removed).

    With every linear term 0 the window layer computes
    ``sum_window gamma e^s v / (sum_window gamma e^s + eps)``: sliding-window
    softmax attention (gamma cancels up to the epsilon).
    """

    def feature_dim(self, input_dim):
        return input_dim

    def call(self, inputs, is_query=True, causal=False):
        return keras.ops.zeros_like(inputs)


def window_only(teacher, window_size):
    """Control: the teacher's weights in a sliding-window softmax model (the linear part removed).

    The zero map is registered only while the model is built (each layer
    deserializes its copy of the map): it is a control, not a feature map
    that the package's own checks over every registered map should see.
    """
    registry = feature_maps.registry._REGISTRY._classes
    registry["zero"] = ZeroFeatureMap
    try:
        return keras_linattn.linearize(teacher, feature_map=ZeroFeatureMap(), window_size=window_size)
    finally:
        registry.pop("zero", None)


def max_errors(student, teacher, ids):
    """(max abs, max rel) error of the student's logits vs the teacher's on ``[B, T]`` ids."""
    want = np.asarray(teacher(as_inputs(tf.constant(ids))), "float64")
    got = np.asarray(student(as_inputs(tf.constant(ids))), "float64")
    err = np.abs(got - want).max()
    return float(err), float(err / np.abs(want).max())


def _median_time(fn, repeats):
    fn()  # compile / warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def student_ms_per_token(student, context, vocabulary_size, new=(8, 72), repeats=3):
    """Median ms per generated token after a `context`-token prompt: (t(n1) - t(n0)) / (n1 - n0), prefill cancels."""
    prompt = np.random.default_rng(0).integers(2, vocabulary_size, (1, context)).astype("int32")
    t = [
        _median_time(lambda n=n: student.generate(prompt, max_length=context + n, stop_token_ids=None), repeats)
        for n in new
    ]
    return 1e3 * (t[1] - t[0]) / (new[1] - new[0])


def teacher_ms_per_token(teacher, context, vocabulary_size, new=(8, 72), repeats=3):
    """keras-hub `generate` with its KV cache, same difference of two runs of equal total length (equal prefill)."""
    total = context + new[1]
    ids = np.random.default_rng(0).integers(2, vocabulary_size, (1, total)).astype("int32")

    def run(n):
        mask = np.zeros((1, total), "int32")
        mask[:, : total - n] = 1
        return teacher.generate({"token_ids": ids, "padding_mask": mask}, stop_token_ids=None)

    t = [_median_time(lambda n=n: run(n), repeats) for n in new]
    return 1e3 * (t[1] - t[0]) / (new[1] - new[0])


def export_check(student, directory, vocabulary_size, prompt_length=16, max_length=64):
    """SavedModel and ONNX of the (merged) student: logits parity and generated tokens vs Keras."""
    import onnxruntime as ort

    from keras_linattn import export

    rng = np.random.default_rng(0)
    ids = rng.integers(2, vocabulary_size, (2, 48)).astype("int32")
    want = np.asarray(student(ids), "float64")
    version_dir = export.export_saved_model(student, f"{directory}/saved_model")
    paths = export.export_onnx(student, f"{directory}/onnx/lm.onnx")
    runner = export.SavedModelRunner(version_dir)
    sm_logits = np.asarray(runner.run("serving_default", {"token_ids": ids})["logits"], "float64")
    session = ort.InferenceSession(paths["model"], providers=["CPUExecutionProvider"])
    onnx_logits = np.asarray(session.run(None, {session.get_inputs()[0].name: ids})[0], "float64")
    prompt = ids[:, :prompt_length]
    keras_tokens = student.generate(prompt, max_length=max_length, stop_token_ids=None)
    feeds = {"prompt_ids": prompt, "padding_mask": np.ones_like(prompt), "max_length": np.int32(max_length)}
    sm_tokens = np.asarray(runner.run("generate", feeds)["output_ids"])
    onnx_tokens = np.asarray(export.OnnxGenerator(paths["step"], device="cpu").generate(prompt, max_length=max_length))
    return {
        "saved_model_max_abs_logit_error": float(np.abs(sm_logits - want).max()),
        "onnx_max_abs_logit_error": float(np.abs(onnx_logits - want).max()),
        "tokens_equal_keras_saved_model": bool(np.array_equal(keras_tokens, sm_tokens)),
        "tokens_equal_keras_onnx": bool(np.array_equal(keras_tokens, onnx_tokens)),
        "keras_tokens": keras_tokens.tolist(),
    }


def walk(model):
    """All layers of `model` (public attributes), for checks."""
    return walk_layers(model)
