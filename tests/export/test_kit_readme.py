"""Every command of ``export/README.md``, read from the README itself, against a fresh export.

The commands are the lines of the README's fenced ``bash`` blocks (``\\``
continuations joined, comments dropped), so the doc and this test cannot
drift: a command without a handler below fails `test_every_readme_command_has_a_handler`.

- Fast: the request each REST / ``saved_model_cli`` command sends (the
  ``curl`` JSON body, the ``rest_client.py --dry-run`` body, the
  ``--input_exprs`` feeds) is decoded the way TF Serving decodes it and run
  through the signature with `SavedModelRunner` (the server's TF1 loader +
  Session path) on one in-process export; it must feed every input and
  return Keras' tokens.
- Slow (``--runslow``): every command is run as written in a copy of
  ``export/`` (``/path/to/*.keras`` replaced by tiny models), except ``pip
  install`` (no network) and ``docker`` (no Docker engine; the configs are
  checked in ``test_serving_kit.py``). ``curl`` and the REST / gRPC clients
  talk to a stand-in server on 127.0.0.1 that serves ``exported/`` through
  `SavedModelRunner` (TF Serving itself cannot be installed here).
"""

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import export
from keras_linattn.models import LinearCausalLM
from tests import _shared_exports
from tests.export.test_export import DIM, encoder
from tests.export.test_serving_kit import decode_rest_body, load_client

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KIT = os.path.join(ROOT, "export")
BIN = os.path.dirname(sys.executable)
NOT_RUN = {"pip install": "no network", "docker compose": "no Docker engine", "./serve.sh": "no Docker engine"}
VOCAB = 40


def readme_commands(text=None):
    """``[(block, command)]``: every command of the README's ```bash blocks."""
    if text is None:
        with open(os.path.join(KIT, "README.md"), encoding="utf-8") as f:
            text = f.read()
    commands = []
    for k, block in enumerate(re.findall(r"```bash\n(.*?)```", text, flags=re.S)):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            words = shlex.split(line, comments=True)
            if words:
                commands.append((k, shlex.join(words)))
    return commands


def kind(command):
    for prefix in (
        "pip install",
        "docker compose",
        "./serve.sh",
        "cd ",
        "./export_model.sh",
        "keras-linattn ",
        "saved_model_cli ",
        "curl ",
        "python clients/rest_client.py",
        "python clients/grpc_client.py",
        "python clients/onnxruntime_gpu_example.py",
    ):
        if command.startswith(prefix):
            return prefix.strip()
    return None


def test_every_readme_command_has_a_handler():
    commands = readme_commands()
    assert len(commands) >= 15
    unknown = [c for _, c in commands if kind(c) is None]
    assert not unknown, f"README commands this test does not run: {unknown}"
    # "which runs": the commands shown are the ones export_model.sh runs
    with open(os.path.join(KIT, "export_model.sh")) as f:
        script = f.read()
    assert 'keras-linattn export "$model" --out "$here/exported" --name "$name"' in script
    assert 'keras-linattn verify "$here/exported" --name "$name"' in script


def tiny_lm():
    keras.utils.set_random_seed(0)
    lm = LinearCausalLM(
        vocabulary_size=VOCAB, num_layers=2, hidden_dim=16, num_heads=2, intermediate_dim=32, chunk_size=4
    )
    lm(np.zeros((1, 2), "int32"))
    return lm


@pytest.fixture(scope="module")
def lm_export():
    # tiny_lm() exported once per run for every file that reads it (tests/_shared_exports.py)
    model, version_dir, _ = _shared_exports.lm_export()
    return model, version_dir


def input_exprs_feeds(command, input_info):
    """``saved_model_cli run --input_exprs 'a=...;b=...'`` -> feeds, cast to the signature's dtypes."""
    words = shlex.split(command)
    exprs = words[words.index("--input_exprs") + 1]
    feeds = {}
    for item in exprs.split(";"):
        name, _, value = item.partition("=")
        feeds[name.strip()] = np.asarray(ast.literal_eval(value.strip()), dtype=input_info[name.strip()][0])
    return words[words.index("--signature_def") + 1], feeds


def test_readme_requests_feed_every_input_and_give_keras_tokens(lm_export, capsys):
    """The fast twin: what each REST / saved_model_cli command sends, run through the signature."""
    model, version_dir = lm_export
    rest = load_client("rest_client")
    requests = []  # (what, body or (signature, feeds))
    for _, command in readme_commands():
        if command.startswith("curl -d"):
            requests.append((command, json.loads(shlex.split(command)[2])))
        elif command.startswith("python clients/rest_client.py --model lm"):
            assert rest.main(shlex.split(command)[2:] + ["--dry-run"]) == 0
            requests.append((command, json.loads(capsys.readouterr().out)))
        elif command.startswith("saved_model_cli run"):
            requests.append((command, command))
    assert len(requests) == 4
    with export.SavedModelRunner(version_dir) as runner:
        for command, body in requests:
            if isinstance(body, str):
                signature, feeds = input_exprs_feeds(
                    body, runner.input_info(shlex.split(body)[shlex.split(body).index("--signature_def") + 1])
                )
            else:
                signature = body["signature_name"]
                feeds = decode_rest_body(body, runner.input_info(signature))
            missing = set(runner.input_info(signature)) - set(feeds)
            assert not missing, f"{command}: does not feed {sorted(missing)}"
            out = runner.run(signature, feeds)["output_ids"]
            prompt, max_length = feeds["prompt_ids"], int(feeds["max_length"])
            if signature == "generate":
                expected = model.generate(prompt, max_length=max_length)
            else:
                from keras_linattn import samplers

                sampler = samplers.get(
                    "top_p",
                    p=float(feeds["top_p"]),
                    k=int(feeds["top_k"]) or None,
                    temperature=float(feeds["temperature"]),
                )
                expected = model.generate(prompt, max_length=max_length, sampler=sampler, seed=int(feeds["seed"]))
                settings = (float(feeds["temperature"]), int(feeds["top_k"]), float(feeds["top_p"]), int(feeds["seed"]))
                assert settings == (pytest.approx(0.8), 20, pytest.approx(0.95), 7)
            np.testing.assert_array_equal(out, expected, err_msg=command)


# ------------------------------------------------------- stand-in servers
class StandIn:
    """TF Serving's REST and gRPC ``Predict`` for ``exported/<name>/<latest>``, through `SavedModelRunner`."""

    def __init__(self, exported):
        self.exported, self.runners, self.lock = exported, {}, threading.Lock()

    def runner(self, name, version=None):
        base = os.path.join(self.exported, name)
        version = version or max(int(v) for v in os.listdir(base) if v.isdigit())
        key = (name, int(version))
        if key not in self.runners:
            self.runners[key] = export.SavedModelRunner(os.path.join(base, str(version)))
        return self.runners[key]

    def predict(self, name, version, signature, decode):
        with self.lock:
            runner = self.runner(name, version)
            return runner.run(signature, decode(runner.input_info(signature)))

    def close(self):
        for runner in self.runners.values():
            runner.close()


def start_rest(standin):
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 - model status
            match = re.fullmatch(r"/v1/models/(\w+)", self.path)
            if not match:
                return self._send(404, {"error": f"unknown path {self.path}"})
            versions = sorted(int(v) for v in os.listdir(os.path.join(standin.exported, match.group(1))) if v.isdigit())
            self._send(
                200,
                {
                    "model_version_status": [
                        {"version": str(versions[-1]), "state": "AVAILABLE", "status": {"error_code": "OK"}}
                    ]
                },
            )

        def do_POST(self):  # noqa: N802
            match = re.fullmatch(r"/v1/models/(\w+)(?:/versions/(\d+))?:predict", self.path)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            signature = body.get("signature_name", "serving_default")
            try:
                out = standin.predict(
                    match.group(1), match.group(2), signature, lambda info: decode_rest_body(body, info)
                )
            except Exception as e:  # what TF Serving answers: {"error": ...}
                return self._send(400, {"error": str(e).strip().splitlines()[0]})
            if "instances" in body:
                names = list(out)
                rows = [
                    out[names[0]][i].tolist() if len(names) == 1 else {k: v[i].tolist() for k, v in out.items()}
                    for i in range(len(out[names[0]]))
                ]
                return self._send(200, {"predictions": rows})
            self._send(200, {"outputs": {k: v.tolist() for k, v in out.items()}})

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def start_grpc(standin):
    from concurrent import futures

    import grpc
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    class Servicer(prediction_service_pb2_grpc.PredictionServiceServicer):
        def Predict(self, request, context):  # noqa: N802
            spec = request.model_spec
            out = standin.predict(
                spec.name,
                spec.version.value or None,
                spec.signature_name or "serving_default",
                lambda info: {k: tf.make_ndarray(v) for k, v in request.inputs.items()},
            )
            response = predict_pb2.PredictResponse()
            for k, v in out.items():
                response.outputs[k].CopyFrom(tf.make_tensor_proto(v))
            return response

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path):
    kit = tmp_path / "export"
    shutil.copytree(KIT, kit, ignore=shutil.ignore_patterns("exported", "__pycache__"))
    models = {"encoder": tmp_path / "encoder.keras", "lm": tmp_path / "lm.keras"}
    enc = encoder("elu", causal=True)
    enc.save(models["encoder"])
    lm = tiny_lm()
    lm.save(models["lm"])
    np.save(kit / "x.npy", np.random.default_rng(0).standard_normal((2, 9, DIM)).astype("float32"))
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""), TF_CPP_MIN_LOG_LEVEL="3")
    standin = StandIn(str(kit / "exported"))
    rest = grpc_server = None
    ran, skipped = [], []
    cwd = tmp_path
    try:
        for _, command in readme_commands():
            what = kind(command)
            if what in NOT_RUN:
                skipped.append((command, NOT_RUN[what]))
                continue
            if what == "cd":
                cwd = cwd / shlex.split(command)[1]
                ran.append((command, ""))
                continue
            run = command.replace("/path/to/encoder.keras", str(models["encoder"]))
            run = run.replace("/path/to/lm.keras", str(models["lm"]))
            if what in ("curl", "python clients/rest_client.py", "python clients/grpc_client.py"):
                if rest is None:  # the server starts once there is something to serve
                    rest = start_rest(standin)
                    grpc_server, grpc_port = start_grpc(standin)
                host = f"127.0.0.1:{rest.server_address[1]}"
                run = run.replace("localhost:8501", host)
                if what == "python clients/rest_client.py":
                    run += f" --host {host}"
                elif what == "python clients/grpc_client.py":
                    run += f" --target 127.0.0.1:{grpc_port}"
            if run.startswith("python "):
                run = shlex.quote(sys.executable) + run[len("python") :]
            result = subprocess.run(run, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
            assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
            assert '"error"' not in result.stdout, f"{command}\n{result.stdout[-2000:]}"
            ran.append((command, result.stdout))
    finally:
        if rest is not None:
            rest.shutdown()
            grpc_server.stop(None)
        standin.close()
    outputs = dict(ran)
    assert len(ran) + len(skipped) == len(readme_commands())
    assert {c for c, _ in skipped} == {c for _, c in readme_commands() if kind(c) in NOT_RUN}
    # the tokens the served commands print are Keras'
    prompt = np.array([[1, 2, 3]], np.int32)
    expected = lm.generate(prompt, max_length=32)[0].tolist()
    curl = next(out for c, out in ran if c.startswith("curl -d"))
    assert json.loads(curl)["outputs"]["output_ids"] == [expected]
    cli_run = next(out for c, out in ran if c.startswith("saved_model_cli run"))
    assert str(lm.generate(prompt, max_length=16)[0].tolist()).replace(",", "")[1:-1] in " ".join(cli_run.split())
    assert "checks passed" in outputs["./export_model.sh /path/to/lm.keras lm"]
