"""The deploy kit in ``export/``: configs parse, clients build valid requests.

`tensorflow_model_server` itself cannot run here (no Docker engine); the
requests the clients build are decoded the way TF Serving decodes them and
run through the exported signature with `SavedModelRunner` (the server's
TF1 loader + Session path), and must reproduce Keras.
"""

import importlib.util
import json
import os

import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import text_format

from keras_linattn import export
from tests import _shared_exports
from tests.export.test_export import DIM, encoder, encoder_tolerance
from tests.tolerance import assert_close

KIT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "export")


def load_client(name):
    spec = importlib.util.spec_from_file_location(f"kit_{name}", os.path.join(KIT, "clients", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decode_rest_body(body, input_info):
    """TF Serving's JSON decoding: row ("instances") or columnar ("inputs")."""
    names = sorted(input_info)
    if "instances" in body:
        rows = body["instances"]
        if len(names) == 1 and not isinstance(rows[0], dict):
            columns = {names[0]: rows}
        else:
            columns = {name: [row[name] for row in rows] for name in names}
    else:
        inputs = body["inputs"]
        columns = inputs if isinstance(inputs, dict) else {names[0]: inputs}
    return {name: np.asarray(columns[name], dtype=input_info[name][0]) for name in names}


@pytest.fixture(scope="module")
def encoder_export(tmp_path_factory):
    model = encoder("elu", causal=True)
    return model, export.export_saved_model(model, tmp_path_factory.mktemp("kit") / "encoder")


@pytest.fixture(scope="module")
def lm_export():
    # tiny_lm() exported once per run for every file that reads it (tests/_shared_exports.py)
    model, version_dir, _ = _shared_exports.lm_export()
    return model, version_dir


# ------------------------------------------------------------------ configs
def test_models_config_parses():
    from tensorflow_serving.config import model_server_config_pb2

    with open(os.path.join(KIT, "models.config")) as f:
        config = text_format.Parse(f.read(), model_server_config_pb2.ModelServerConfig())
    models = {c.name: c for c in config.model_config_list.config}
    assert sorted(models) == ["encoder", "lm"]
    for name, c in models.items():
        assert c.base_path == f"/models/{name}"
        assert c.model_platform == "tensorflow"
        assert c.model_version_policy.latest.num_versions == 1


def test_batching_config_uses_known_fields():
    import re

    # Fields of tensorflow_serving.BatchingParameters (its proto is not in the pip package).
    known = {
        "max_batch_size",
        "batch_timeout_micros",
        "max_enqueued_batches",
        "num_batch_threads",
        "pad_variable_length_inputs",
        "allowed_batch_sizes",
        "thread_pool_name",
    }
    with open(os.path.join(KIT, "batching.config")) as f:
        lines = [line.strip() for line in f if line.strip() and not line.strip().startswith("#")]
    fields = {}
    for line in lines:
        match = re.fullmatch(r"(\w+) \{ value: (\d+) \}|(\w+): (true|false)", line)
        assert match, line
        fields[match.group(1) or match.group(3)] = match.group(2) or match.group(4)
    assert set(fields) <= known
    assert fields["max_batch_size"] == "32" and fields["pad_variable_length_inputs"] == "false"


def test_docker_recipes_mount_what_models_config_expects():
    with open(os.path.join(KIT, "docker-compose.yml")) as f:
        compose = f.read()
    for service in ("serving-cpu:", "serving-gpu:"):
        assert f"  {service}" in compose
    assert compose.count("- ./exported:/models:ro") == 2
    assert compose.count("- --model_config_file=/config/models.config") == 2
    assert compose.count('- "8500:8500"') == 2 and compose.count('- "8501:8501"') == 2
    assert "image: tensorflow/serving:latest\n" in compose and "image: tensorflow/serving:latest-gpu\n" in compose
    assert "capabilities: [gpu]" in compose
    with open(os.path.join(KIT, "serve.sh")) as f:
        script = f.read()
    assert '-v "$here/exported:/models:ro"' in script and "--gpus all" in script


# --------------------------------------------------------------------- REST
@pytest.mark.parametrize("request_format", ["instances", "inputs"])
def test_rest_body_reproduces_keras(encoder_export, rng, request_format):
    model, version_dir = encoder_export
    rest = load_client("rest_client")
    x = rng.standard_normal((3, 9, DIM)).astype("float32")
    body = json.loads(json.dumps(rest.predict_body({"features": x}, "serving_default", request_format)))
    assert body["signature_name"] == "serving_default"
    assert (request_format in body) and len(body) == 2
    with export.SavedModelRunner(version_dir) as runner:
        feeds = decode_rest_body(body, runner.input_info("serving_default"))
        out = runner.run("serving_default", feeds)
    np.testing.assert_array_equal(feeds["features"], x)  # JSON round trip of float32 is exact
    expected = model(x).numpy()
    assert_close(out["head"], expected, paths=2, **encoder_tolerance(model, x, causal=True))  # export vs Keras
    # and the client reads both response formats back
    rows = {"predictions": out["head"].tolist()}
    columns = {"outputs": {"head": out["head"].tolist()}}
    np.testing.assert_array_equal(rest.parse_response(rows)["output"], out["head"])
    np.testing.assert_array_equal(rest.parse_response(columns)["head"], out["head"])


def test_rest_generate_body_reproduces_keras_generate(lm_export):
    model, version_dir = lm_export
    rest = load_client("rest_client")
    prompt = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
    body = rest.predict_body(
        {"prompt_ids": prompt, "padding_mask": np.ones_like(prompt), "max_length": np.int32(10)}, "generate", "inputs"
    )
    body = json.loads(json.dumps(body))
    assert body == {
        "signature_name": "generate",
        "inputs": {"prompt_ids": prompt.tolist(), "padding_mask": [[1, 1, 1], [1, 1, 1]], "max_length": 10},
    }
    with export.SavedModelRunner(version_dir) as runner:
        out = runner.run("generate", decode_rest_body(body, runner.input_info("generate")))
    np.testing.assert_array_equal(out["output_ids"], model.generate(prompt, max_length=10))
    with pytest.raises(ValueError, match="use request_format='inputs'"):
        rest.predict_body(
            {"prompt_ids": prompt, "padding_mask": np.ones_like(prompt), "max_length": np.int32(10)},
            "generate",
            "instances",
        )


def test_rest_multi_input_instances_and_url():
    rest = load_client("rest_client")
    body = rest.predict_body({"a": np.zeros((2, 3), np.float32), "b": np.array([1, 2], np.int32)})
    assert body["instances"] == [{"a": [0.0, 0.0, 0.0], "b": 1}, {"a": [0.0, 0.0, 0.0], "b": 2}]
    assert rest.predict_url("localhost:8501", "lm") == "http://localhost:8501/v1/models/lm:predict"
    assert rest.predict_url("http://h:1", "lm", 3) == "http://h:1/v1/models/lm/versions/3:predict"


def test_rest_client_dry_run_prints_the_body(capsys):
    rest = load_client("rest_client")
    assert rest.main(["--model", "lm", "--prompt", "1,2,3", "--max-length", "8", "--dry-run"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body == {
        "signature_name": "generate",
        "inputs": {"prompt_ids": [[1, 2, 3]], "padding_mask": [[1, 1, 1]], "max_length": 8},
    }


# --------------------------------------------------------------------- gRPC
def test_grpc_request_reproduces_keras(encoder_export, rng):
    from tensorflow_serving.apis import predict_pb2

    model, version_dir = encoder_export
    grpc_client = load_client("grpc_client")
    x = rng.standard_normal((2, 13, DIM)).astype("float32")
    request = grpc_client.predict_request("encoder", {"features": x}, "serving_default", version=1)
    wire = predict_pb2.PredictRequest.FromString(request.SerializeToString())
    assert wire.model_spec.name == "encoder" and wire.model_spec.version.value == 1
    assert wire.model_spec.signature_name == "serving_default"
    feeds = {name: tf.make_ndarray(proto) for name, proto in wire.inputs.items()}
    with export.SavedModelRunner(version_dir) as runner:
        out = runner.run("serving_default", feeds)
    assert_close(out["head"], model(x).numpy(), paths=2, **encoder_tolerance(model, x, causal=True))  # export vs Keras


def test_grpc_step_decoding_reproduces_keras_generate(lm_export):
    from tensorflow_serving.apis import predict_pb2

    model, version_dir = lm_export
    grpc_client = load_client("grpc_client")
    description = export.read_description(version_dir)
    prompt = np.array([[7, 8], [9, 1]], np.int32)
    with export.SavedModelRunner(version_dir) as runner:

        def call(feeds):
            request = grpc_client.predict_request("lm", feeds, "step")
            wire = predict_pb2.PredictRequest.FromString(request.SerializeToString())
            return runner.run("step", {k: tf.make_ndarray(v) for k, v in wire.inputs.items()})

        tokens = grpc_client.greedy_with_step(call, description, prompt, max_length=9)
        generate_request = grpc_client.predict_request(
            "lm", {"prompt_ids": prompt, "padding_mask": np.ones_like(prompt), "max_length": np.int32(9)}, "generate"
        )
        generated = runner.run("generate", {k: tf.make_ndarray(v) for k, v in generate_request.inputs.items()})[
            "output_ids"
        ]
    expected = model.generate(prompt, max_length=9)
    np.testing.assert_array_equal(tokens, expected)
    np.testing.assert_array_equal(generated, expected)


# --------------------------------------------------------- onnxruntime-gpu
def test_onnxruntime_example_reproduces_keras(tmp_path, capsys, monkeypatch):
    model = encoder("elu", causal=False)
    path = export.export_onnx(model, tmp_path / "encoder.onnx")["model"]
    example = load_client("onnxruntime_gpu_example")
    calls = []

    class RecordingPredictor(export.OnnxPredictor):
        """The client's predictor, recording what it is fed and what it returns."""

        def __call__(self, inputs):
            outputs = super().__call__(inputs)
            calls.append(({k: np.array(v) for k, v in inputs.items()}, {k: np.array(v) for k, v in outputs.items()}))
            return outputs

    monkeypatch.setattr(example, "OnnxPredictor", RecordingPredictor)
    assert example.main([path, "--device", "cpu", "--batch", "2", "--length", "9", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "provider: CPUExecutionProvider" in out
    assert "head: shape=(2, 9, 5)" in out
    assert len(calls) == 3  # warm-up and 2 timed repeats
    # The client's outputs are the model's: ONNX vs Keras on the client's own inputs.
    for feeds, outputs in calls:
        x = feeds["features"]
        assert x.shape == (2, 9, DIM) and x.dtype == np.float32
        assert_close(outputs["head"], model(x).numpy(), paths=2, **encoder_tolerance(model, x, causal=False))
