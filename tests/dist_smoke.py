"""Smoke test of an installed wheel, run by `make dist-check` from outside the source tree.

It checks that `keras_linattn` is imported from the fresh venv the wheel went into (not from the
source tree or an editable install), that its version is the one in the wheel's file name, that a
`LinearAttention` forward pass matches a float64 numpy reference, and that the console script runs.
Not collected by pytest (no `test_` prefix).
"""

import argparse
import glob
import os
import subprocess
import sys
import zipfile


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--venv", required=True, help="the venv the wheel was installed into")
    parser.add_argument("--dist", required=True, help="the folder with the sdist and the wheel")
    parser.add_argument("--source", required=True, help="the source tree, which must not be imported")
    args = parser.parse_args()
    venv, source = os.path.realpath(args.venv), os.path.realpath(args.source)

    wheels = glob.glob(os.path.join(args.dist, "keras_linattn-*.whl"))
    sdists = glob.glob(os.path.join(args.dist, "keras_linattn-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, (wheels, sdists)
    wheel_version = os.path.basename(wheels[0]).split("-")[1]
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "keras_linattn/layers/linear_attention.py" in names, names[:20]
    stray = [n for n in names if n.startswith(("tests/", "examples/", "benchmarks/"))]
    assert not stray, f"non-package code in the wheel: {stray[:5]}"

    assert os.path.realpath(os.getcwd()) != source and not os.path.realpath(os.getcwd()).startswith(source + os.sep)
    import numpy as np

    import keras_linattn as kla

    where = os.path.realpath(kla.__file__)
    assert where.startswith(venv + os.sep), f"keras_linattn imported from {where}, not from the wheel in {venv}"
    assert kla.__version__ == wheel_version, (kla.__version__, wheel_version)

    # One forward pass against a float64 reference: elu + 1 features, non-causal, 2 heads.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 7, 8)).astype("float32")
    layer = kla.layers.LinearAttention(num_heads=2, key_dim=4, feature_map="elu", use_bias=False)
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

    cli = os.path.join(venv, "bin", "keras-linattn")
    out = subprocess.run([cli, "--help"], capture_output=True, text=True, check=True).stdout
    assert "export" in out, out
    print(
        f"dist-check: keras_linattn {kla.__version__} from {where}; LinearAttention forward max error {error:.1e}; "
        f"{os.path.basename(cli)} --help ok; {os.path.basename(wheels[0])}, {os.path.basename(sdists[0])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
