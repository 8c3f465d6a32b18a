"""TF Serving warmup requests: ``assets.extra/tf_serving_warmup_requests``.

A TFRecord file of `tensorflow_serving.apis.prediction_log_pb2.PredictionLog`
records; TF Serving replays them when it loads a version, so the first real
request does not pay for graph initialization.
"""

import os
import re

import numpy as np
import tensorflow as tf

from keras_linattn._validation import check_positive_int
from keras_linattn.export import _specs

__all__ = ["read_warmup_requests", "write_warmup_requests"]

_WARMUP_FILE = "tf_serving_warmup_requests"


def _serving_apis():
    try:
        from tensorflow_serving.apis import predict_pb2, prediction_log_pb2
    except ImportError as e:
        raise ImportError(
            "Writing TF Serving warmup requests needs the `tensorflow-serving-api` package, a dependency of "
            "keras-linattn (pip install tensorflow-serving-api), or pass warmup=False."
        ) from e
    return predict_pb2, prediction_log_pb2


def _predict_request(model_name, signature_name, inputs):
    """A `PredictRequest` for named numpy inputs."""
    predict_pb2, _ = _serving_apis()
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model_name
    request.model_spec.signature_name = signature_name
    for name, value in inputs.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(np.asarray(value)))
    return request


def _warmup_inputs(specs, batch_size=1, length=16, include_generate=True):
    """(signature name, named numpy inputs) pairs used for warmup."""
    desc = specs.describe()
    # Requests within the model's own limit (the signatures refuse longer ones).
    limit = desc.get("max_sequence_length") or length
    length = min(length, limit)
    requests = [
        (
            _specs.SERVING_DEFAULT,
            _specs.example_inputs(desc["inputs"], batch_size, length, specs.vocabulary_size),
        )
    ]
    if specs.causal_lm:
        step_inputs = {_specs.TOKEN_T: np.zeros((batch_size,), np.int32)}
        for i, s in enumerate(specs.initial_state(batch_size)):
            step_inputs[_specs.state_name(i)] = s
        requests.append((_specs.STEP, step_inputs))
        if include_generate:
            prompt = np.zeros((batch_size, min(2, limit)), np.int32)
            mask = np.ones_like(prompt)
            requests.append(
                (
                    _specs.GENERATE,
                    {_specs.PROMPT_IDS: prompt, _specs.PADDING_MASK: mask, _specs.MAX_LENGTH: np.int32(min(4, limit))},
                )
            )
            requests.append(
                (
                    _specs.GENERATE_SAMPLED,
                    {
                        _specs.PROMPT_IDS: prompt,
                        _specs.PADDING_MASK: mask,
                        _specs.MAX_LENGTH: np.int32(min(4, limit)),
                        _specs.TEMPERATURE: np.float32(1.0),
                        _specs.TOP_K: np.int32(0),
                        _specs.TOP_P: np.float32(1.0),
                        _specs.SEED: np.int64(0),
                    },
                )
            )
    return requests


def write_warmup_requests(path, specs, model_name, batch_size=1, length=16, include_generate=True):
    """Writes one `PredictionLog` per signature to the TFRecord file `path`.

    Raises:
        ValueError: for an empty `model_name` or a `batch_size`/`length` that
            is not a positive integer.
    """
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"`model_name` must be a non-empty string. Received: model_name={model_name!r}")
    batch_size = check_positive_int("batch_size", batch_size)
    length = check_positive_int("length", length)
    _, prediction_log_pb2 = _serving_apis()
    with tf.io.TFRecordWriter(path) as writer:
        for signature_name, inputs in _warmup_inputs(specs, batch_size, length, include_generate):
            log = prediction_log_pb2.PredictionLog(
                predict_log=prediction_log_pb2.PredictLog(request=_predict_request(model_name, signature_name, inputs))
            )
            writer.write(log.SerializeToString())
    return path


def read_warmup_requests(path):
    """Parses a warmup file: a list of (signature name, named numpy inputs).

    Raises:
        ValueError: naming `path` if it is not a file, or not a TFRecord file
            of `PredictionLog` records with predict requests.
    """
    from google.protobuf.message import DecodeError

    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        raise ValueError(f"`path` must be an existing warmup file. Received: path={path!r}")
    _, prediction_log_pb2 = _serving_apis()
    requests = []
    try:
        for record in tf.data.TFRecordDataset(str(path)).as_numpy_iterator():
            log = prediction_log_pb2.PredictionLog.FromString(record)
            if not log.HasField("predict_log"):
                raise DecodeError("a record is not a predict log")
            request = log.predict_log.request
            inputs = {name: tf.make_ndarray(proto) for name, proto in request.inputs.items()}
            requests.append((request.model_spec.signature_name, inputs))
    except (tf.errors.OpError, DecodeError) as e:
        reason = getattr(e, "message", None) or str(e)
        reason = reason.strip().splitlines()[0] if reason.strip() else type(e).__name__
        record = re.search(r"(truncated|corrupted) record at \d+", reason)
        if record:  # TF's message wraps this in op and device names
            reason = f"the file is truncated or corrupted ({record.group(0)})"
        raise ValueError(
            "Not a TF Serving warmup file (a TFRecord file of PredictionLog records with "
            f"predict requests): {reason}. Received: path={path!r}"
        ) from e
    return requests
