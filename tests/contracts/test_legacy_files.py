"""`.keras` files written by round 2 (commit 1e0cd7d) load into the current code with the same outputs.

The fixtures in tests/fixtures/round2 were saved by the round-2 code (see
make_fixtures.py there): plain, fixed/scalar/channel decay, unnormalized,
conv, window and (gated) delta layers, and two LMs (taylor + conv + window;
delta + conv). Committed files rather than a subprocess running the old
code: the old code is not importable next to the new one, and a file that
once loaded must keep loading however the history is checked out.
Loading must find every weight at its round-2 path (Keras warns and leaves
fresh weights otherwise, which the output comparison would catch) and the
outputs must be bitwise those of the round-2 code on this machine's kernels
up to float32 rounding of the same sums.
"""

import os
import re
import warnings

import keras
import numpy as np
import pytest

import keras_linattn  # noqa: F401  (registers the classes the files name)
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric

HERE = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures", "round2")
LAYERS = ["plain", "fixed", "scalar_conv", "channel_unnormalized", "window", "gated_delta"]
LMS = ["lm_based", "lm_delta_conv"]


def _load(name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = keras.models.load_model(os.path.join(HERE, f"{name}.keras"))
    # A weight Keras could not place is reported as a warning: none may be.
    unplaced = [str(w.message) for w in caught if re.search("variable|weight", str(w.message), re.I)]
    assert not unplaced, unplaced
    return model


@pytest.mark.parametrize("name", LAYERS)
def test_older_layer_file_loads_with_the_same_outputs(name):
    data = np.load(os.path.join(HERE, f"{name}.npz"))
    model = _load(name)
    # Same weights, same ops: the outputs agree to float32 rounding of the
    # attention sums (T keys, C features, H * M outputs; the kernels may
    # differ between the machine that wrote the file and this one).
    assert_close(model(data["x"]), data["y"], n=64, paths=2, what=name)


@pytest.mark.parametrize("name", LMS)
def test_older_lm_file_loads_with_the_same_logits_and_tokens(name):
    data = np.load(os.path.join(HERE, f"{name}.npz"))
    lm = _load(name)
    assert_close(lm(data["x"]), data["y"], n=256, paths=2, what=name)
    np.testing.assert_array_equal(lm.generate(data["x"][:, :3], max_length=data["tokens"].shape[1]), data["tokens"])


@pytest.mark.slow
@pytest.mark.parametrize("name", LMS)
def test_older_lm_file_exports_to_the_same_tokens(tmp_path, name):
    from keras_linattn import export

    data = np.load(os.path.join(HERE, f"{name}.npz"))
    lm = _load(name)
    prompt = data["x"][:, :3]
    mask = np.ones_like(prompt)
    max_length = data["tokens"].shape[1]
    version_dir = export.export_saved_model(lm, str(tmp_path / "sm"))
    paths = export.export_onnx(lm, str(tmp_path / "lm.onnx"))
    feeds = {"prompt_ids": prompt, "padding_mask": mask, "max_length": np.int32(max_length)}
    sm_ids = export.SavedModelRunner(version_dir).run("generate", feeds)["output_ids"]
    onnx_ids = export.OnnxGenerator(paths["step"], device="cpu").generate(prompt, max_length=max_length)
    np.testing.assert_array_equal(sm_ids, data["tokens"], err_msg="SavedModel vs round 2")
    np.testing.assert_array_equal(np.asarray(onnx_ids), data["tokens"], err_msg="ONNX vs round 2")
