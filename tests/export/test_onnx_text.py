"""Text through the exported ONNX graphs: the tokenizer written beside them, read without TensorFlow."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import keras_hub
import numpy as np
import pytest

from keras_linattn import export
from keras_linattn.export import _onnx_text
from keras_linattn.models import LinearBackbone, LinearCausalLM, LinearCausalLMPreprocessor
from tests.contracts.test_lazy_import import BLOCK, ROOT

# Single spaces: keras-hub's TensorFlow path and its `tokenizers` path (the one read here) split runs of
# several spaces differently, and this test compares with the former.
TEXTS = ["def f(x):", "import os\n", "a b, 'c'"]


def _tokenizer():
    tokens = ["<|endoftext|>", "Ġ", "ĠĠ", "Ċ", *map(chr, range(33, 127))]  # "Ġ" is GPT-2's space, "Ċ" its newline
    return keras_hub.tokenizers.GPT2Tokenizer(vocabulary={t: i for i, t in enumerate(tokens)}, merges=["Ġ Ġ"])


@pytest.fixture(scope="module")
def text_export(tmp_path_factory):
    tokenizer = _tokenizer()
    keras.utils.set_random_seed(0)
    backbone = LinearBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=32
    )
    lm = LinearCausalLM(backbone, preprocessor=LinearCausalLMPreprocessor(tokenizer, 16))
    paths = export.export_onnx(lm, str(tmp_path_factory.mktemp("text") / "lm.onnx"))
    return lm, paths


def test_the_export_writes_the_tokenizer_beside_the_step_graph(text_export):
    _, paths = text_export
    directory = os.path.join(os.path.dirname(paths["step"]), "lm_tokenizer")
    assert sorted(os.listdir(directory)) == ["merges.txt", "tokenizer.json", "vocabulary.json"]
    config = json.load(open(os.path.join(directory, "tokenizer.json"), encoding="utf-8"))
    assert config["kind"] == "byte_pair" and config["end_token_id"] == 0 and config["add_start_token"] is True


def test_the_exported_tokenizer_reads_as_keras_hubs(text_export):
    lm, paths = text_export
    codec = _onnx_text.TextCodec(os.path.join(os.path.dirname(paths["step"]), "lm_tokenizer"))
    for text in TEXTS:
        assert codec.encode(text) == [int(t) for t in np.asarray(lm.preprocessor.tokenizer(text))], text
        assert codec.decode(codec.encode(text)) == text


def test_onnx_generator_takes_and_returns_text_as_keras_does(text_export):
    lm, paths = text_export
    generator = export.OnnxGenerator(paths["step"], device="cpu")
    assert generator.generate(TEXTS, 16) == lm.generate(TEXTS, max_length=16)
    assert generator.generate(TEXTS[0], 16) == lm.generate(TEXTS[0], max_length=16)


def test_text_generation_runs_without_tensorflow(text_export):
    lm, paths = text_export
    code = BLOCK + textwrap.dedent(
        f"""
        import json
        from keras_linattn.serving import OnnxGenerator
        out = OnnxGenerator({paths["step"]!r}, device="cpu").generate({TEXTS!r}, 16)
        heavy = sorted(m for m in ("tensorflow", "keras", "keras_hub") if m in sys.modules)
        print(json.dumps({{"out": out, "heavy": heavy}}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"out": lm.generate(TEXTS, max_length=16), "heavy": []}


def test_the_model_graph_names_the_step_graph(text_export):
    _, paths = text_export
    with pytest.raises(ValueError, match="pass its step graph: OnnxGenerator") as info:
        export.OnnxGenerator(paths["model"], device="cpu")
    assert repr(paths["step"]) in str(info.value)


def test_text_without_an_exported_tokenizer_says_pass_token_ids(tmp_path):
    keras.utils.set_random_seed(0)
    lm = LinearCausalLM(vocabulary_size=32, num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=32)
    paths = export.export_onnx(lm, str(tmp_path / "ids.onnx"))
    with pytest.raises(ValueError, match="this export has none: pass token ids"):
        export.OnnxGenerator(paths["step"], device="cpu").generate(["text"], 8)
