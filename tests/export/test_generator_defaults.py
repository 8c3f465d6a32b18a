"""`OnnxGenerator`'s sessions keep one copy of the weights by default (issue 58: a 1B model fits)."""

import numpy as np
import pytest

from keras_linattn.serving import OnnxGenerator
from tests import _shared_exports

pytestmark = pytest.mark.tf_only("reads the shared TensorFlow export")


def _prepacking_disabled(predictor):
    options = predictor.session.get_session_options()
    try:
        return options.get_session_config_entry("session.disable_prepacking") == "1"
    except RuntimeError:  # onnxruntime: no entry with that key
        return False


@pytest.fixture(scope="module")
def step_path():
    return _shared_exports.lm_export()[2]["step"]


def test_generator_sessions_do_not_prepack_by_default(step_path):
    generator = OnnxGenerator(step_path, device="cpu")
    generator.generate(np.array([[1, 2, 3]], "int32"), max_length=5)
    assert generator.predictor.prepacking is False
    assert _prepacking_disabled(generator.predictor)
    assert _prepacking_disabled(generator._generate_graph())  # the generate graph's session too


def test_generator_prepacking_can_be_asked_for(step_path):
    generator = OnnxGenerator(step_path, device="cpu", prepacking=True)
    generator.generate(np.array([[1, 2, 3]], "int32"), max_length=5)
    assert not _prepacking_disabled(generator.predictor)
    assert not _prepacking_disabled(generator._generate_graph())
