"""Smoke test of an installed wheel, run by `make dist-check` from outside the source tree.

It checks that `keras_linattn` is imported from the fresh venv the wheel went into (not from the
source tree or an editable install), that its version is the one in the wheel's file name, that a
`LinearAttention` forward pass matches a float64 numpy reference, and that the console script runs:
``--help`` without importing TensorFlow, then ``keras-linattn export`` (SavedModel with TF Serving
warmup records, and ONNX) and ``keras-linattn verify`` of a tiny model, with no TensorFlow log line
in their output, and that every Python block of the README runs as written with the wheel.
Then a second, fresh venv with the wheel (``--no-deps``), numpy and onnxruntime only: there
``import tensorflow`` fails and `OnnxGenerator` decodes a tiny LM exported here to Keras' tokens
(``--serving-only`` runs this check alone).
Every base requirement the wheel declares must be installed, and the export needs no
extra: tensorflow-serving-api is one of them.
Not collected by pytest (no `test_` prefix).
"""

import argparse
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile

# Run in the serving venv: TensorFlow and Keras absent, `OnnxGenerator` from the wheel, its tokens printed.
_SERVING_PROBE = """
import json, sys
import numpy as np
try:
    import tensorflow  # noqa: F401
    absent = False
except ImportError:
    absent = True
assert absent, "tensorflow is importable in the serving venv"
from keras_linattn.serving import OnnxGenerator
generator = OnnxGenerator(sys.argv[1], device="cpu")
tokens = generator.generate(np.array(json.loads(sys.argv[2]), "int32"), max_length=int(sys.argv[3]))
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"tensorflow", "keras", "keras_hub", "tf2onnx"})
print(json.dumps({"tokens": tokens.tolist(), "loaded": loaded, "from": __import__("keras_linattn").__file__}))
"""


def check_serving_without_tensorflow(wheel, work):
    """`OnnxGenerator` from the wheel alone in a venv with numpy and onnxruntime only (no TensorFlow, no Keras).

    A tiny `LinearCausalLM` is exported here (this venv has TensorFlow); a fresh venv (no system
    site-packages) gets the wheel with ``--no-deps`` plus numpy and onnxruntime at this venv's versions
    (pip's cache or the registry); there ``import tensorflow`` fails, and greedy `generate` through the
    exported graphs returns Keras' tokens.

    Returns:
        A one-line summary.
    """
    import keras
    import numpy as np

    from keras_linattn import export
    from keras_linattn.models import LinearCausalLM

    keras.utils.set_random_seed(0)
    lm = LinearCausalLM(vocabulary_size=32, num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=32)
    prompt, max_length = [[1, 2, 3], [4, 5, 6]], 9
    expected = np.asarray(lm.generate(np.array(prompt, "int32"), max_length=max_length)).tolist()
    step = export.export_onnx(lm, os.path.join(work, "serving", "lm.onnx"))["step"]

    serving = os.path.join(work, "serving-venv")
    # Nothing of this process's paths leaks in (a PYTHONPATH would show pip another keras_linattn as installed).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    subprocess.run([sys._base_executable, "-m", "venv", serving], check=True, env=env)
    python = os.path.join(serving, "bin", "python")
    import onnxruntime

    # The CPU onnxruntime at this venv's version (which may be onnxruntime-gpu): pip's cache is likely to hold it.
    pins = [f"numpy=={np.__version__}", f"onnxruntime=={onnxruntime.__version__}"]
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", wheel], check=True, env=env)
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-warn-conflicts", *pins], check=True, env=env)
    result = subprocess.run(
        [python, "-c", _SERVING_PROBE, step, json.dumps(prompt), str(max_length)],
        capture_output=True,
        text=True,
        cwd=work,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, f"OnnxGenerator without TensorFlow failed: {(result.stdout + result.stderr)[-3000:]}"
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert os.path.realpath(found["from"]).startswith(os.path.realpath(serving) + os.sep), found["from"]
    assert found["loaded"] == [], f"the serving path loaded {found['loaded']}"
    assert found["tokens"] == expected, (found["tokens"], expected)
    return f"OnnxGenerator in a venv without TensorFlow ({', '.join(pins)}) returned Keras' tokens"


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--venv", required=True, help="the venv the wheel was installed into")
    parser.add_argument("--dist", required=True, help="the folder with the sdist and the wheel")
    parser.add_argument("--source", required=True, help="the source tree, which must not be imported")
    parser.add_argument(
        "--serving-only", action="store_true", help="only the serving check (a venv without TensorFlow)"
    )
    args = parser.parse_args()
    venv, source = os.path.realpath(args.venv), os.path.realpath(args.source)

    if args.serving_only:
        wheel = glob.glob(os.path.join(args.dist, "keras_linattn-*.whl"))
        assert len(wheel) == 1, wheel
        print("dist-check: " + check_serving_without_tensorflow(wheel[0], tempfile.mkdtemp(prefix="dist-check-")))
        return 0
    wheels = glob.glob(os.path.join(args.dist, "keras_linattn-*.whl"))
    sdists = glob.glob(os.path.join(args.dist, "keras_linattn-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, (wheels, sdists)
    wheel_version = os.path.basename(wheels[0]).split("-")[1]
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "keras_linattn/layers/linear_attention.py" in names, names[:20]
    assert "keras_linattn_cli.py" in names, "the console script's module is missing from the wheel"
    stray = [n for n in names if n.startswith(("tests/", "examples/", "benchmarks/"))]
    assert not stray, f"non-package code in the wheel: {stray[:5]}"

    assert os.path.realpath(os.getcwd()) != source and not os.path.realpath(os.getcwd()).startswith(source + os.sep)
    import keras
    import numpy as np

    import keras_linattn as kla

    where = os.path.realpath(kla.__file__)
    assert where.startswith(venv + os.sep), f"keras_linattn imported from {where}, not from the wheel in {venv}"
    assert kla.__version__ == wheel_version, (kla.__version__, wheel_version)

    # One forward pass against a float64 reference: elu + 1 features, no short convolution, non-causal, 2 heads.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 7, 8)).astype("float32")
    layer = kla.layers.LinearAttention(num_heads=2, key_dim=4, feature_map="elu", conv_size=None, use_bias=False)
    y = np.asarray(layer(x, x))
    dense = (layer.query_dense, layer.key_dense, layer.value_dense, layer.output_dense)
    wq, wk, wv, wo = (np.asarray(d.kernel, "float64") for d in dense)
    x64 = x.astype("float64")
    q, k, v = (np.einsum("btd,dhc->bthc", x64, w) for w in (wq, wk, wv))
    phi = lambda a: np.where(a > 0, a + 1.0, np.exp(a))  # noqa: E731
    scores = np.einsum("bthc,bshc->bhts", phi(q), phi(k))
    ctx = np.einsum("bhts,bshc->bthc", scores / scores.sum(-1, keepdims=True), v)
    reference = np.einsum("bthc,hcd->btd", ctx, wo)
    error = np.max(np.abs(y - reference))
    assert y.shape == (2, 7, 8) and error < 1e-4, (y.shape, error)

    # The wheel's base requirements (no extra) are all installed: the export below needs nothing more.
    from importlib import metadata

    base = [r for r in metadata.requires("keras-linattn") or [] if "extra ==" not in r]
    names = [re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in base]
    assert "tensorflow-serving-api" in names, f"tensorflow-serving-api is not a base requirement: {base}"
    missing = []
    for name in names:
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    assert not missing, f"base requirements not installed: {missing}"

    cli = os.path.join(venv, "bin", "keras-linattn")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}  # the CLI quiets TF itself
    # the console script itself, run in a Python that reports what it imported
    probe = (
        "import runpy, sys\nsys.argv = ['keras-linattn', '--help']\n"
        "try:\n    runpy.run_path(%r, run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print('tensorflow' in sys.modules)"
    )
    out = subprocess.run([cli, "--help"], capture_output=True, text=True, check=True, env=env).stdout
    assert "export" in out, out
    loaded = subprocess.run(
        [os.path.join(venv, "bin", "python"), "-c", probe % cli], capture_output=True, text=True, check=True, env=env
    ).stdout
    assert loaded.strip().splitlines()[-1] == "False", f"--help imported TensorFlow: {loaded}"

    work = tempfile.mkdtemp(prefix="dist-check-")
    inputs = keras.Input((None, 8), name="features")
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(layer(inputs, inputs)))
    model.save(os.path.join(work, "tiny.keras"))
    exported = os.path.join(work, "exported")
    for args in (["export", os.path.join(work, "tiny.keras"), "--out", exported], ["verify", exported]):
        result = subprocess.run([cli, *args], capture_output=True, text=True, env=env)
        assert result.returncode == 0, f"keras-linattn {args[0]}: {result.stdout[-3000:]}{result.stderr[-3000:]}"
        noise = [
            line for line in (result.stdout + result.stderr).splitlines() if re.match(r"[IWE]0000 |WARNING: All", line)
        ]
        assert not noise, f"keras-linattn {args[0]} printed TensorFlow log lines: {noise}"
    assert "checks passed" in result.stdout, result.stdout
    warmup = os.path.join(exported, "tiny", "1", "assets.extra", "tf_serving_warmup_requests")
    assert os.path.isfile(warmup), "no TF Serving warmup records"

    # Every README Python block, as written, with the wheel's keras_linattn: the block extractor and
    # runner of tests/contracts/test_readme.py (loaded by path: it imports nothing from the package).
    spec = importlib.util.spec_from_file_location(
        "_readme", os.path.join(source, "tests", "contracts", "test_readme.py")
    )
    readme = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(readme)
    blocks_dir = tempfile.mkdtemp(prefix="dist-check-readme-")
    blocks_file = os.path.join(blocks_dir, "blocks.json")
    with open(blocks_file, "w", encoding="utf-8") as f:
        json.dump(readme._python_blocks(), f)
    block_env = dict(env, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    block_env.pop("PYTHONPATH", None)
    runner = [os.path.join(venv, "bin", "python"), "-c", readme._RUNNER, blocks_file]
    result = subprocess.run(runner, cwd=blocks_dir, capture_output=True, text=True, env=block_env, timeout=900)
    assert result.returncode == 0, f"a README block failed with the wheel: {(result.stdout + result.stderr)[-4000:]}"
    ran = result.stdout.count("=== block ")
    serving = check_serving_without_tensorflow(wheels[0], work)
    print(
        f"dist-check: keras_linattn {kla.__version__} from {where}; LinearAttention forward max error {error:.1e}; "
        f"{os.path.basename(cli)} --help ok without TensorFlow; export (SavedModel + warmup, ONNX) and verify ok; "
        f"{ran} README Python blocks ran; {serving}; "
        f"{os.path.basename(wheels[0])}, {os.path.basename(sdists[0])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
