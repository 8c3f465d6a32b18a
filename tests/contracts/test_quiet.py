"""`keras_linattn.quiet()`: a documented snippet prints nothing on stderr (14 lines without it, on x86 CPUs)."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)

SNIPPET = textwrap.dedent(
    """
    import os, tempfile
    import keras

    from keras_linattn import export, layers

    out = tempfile.mkdtemp()
    inputs = keras.Input((None, 16), name="features")
    model = keras.Model(inputs, keras.layers.Dense(2)(layers.LinearAttention(2, 8)(inputs, inputs)))
    paths = export.export_onnx(model, os.path.join(out, "classifier.onnx"))
    print(export.verify(model, onnx_path=paths["model"]).ok)
    """
)


def _stderr_lines(code):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "KERAS_BACKEND")}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "True"
    return result.stderr.splitlines()


def test_quiet_keeps_a_snippets_stderr_empty():
    assert _stderr_lines("import keras_linattn\nkeras_linattn.quiet()\n" + SNIPPET) == []
