"""Command lines of the training examples: ``--help`` exits cleanly and lists the main flags."""

import importlib

import pytest


@pytest.mark.parametrize(
    "module,flags",
    [
        ("examples.char_lm.train", ["--corpus", "--feature-map", "--no-jit"]),
        ("examples.listops.train", ["--variants", "--seq-len", "--no-jit"]),
        ("examples.text_classification.train", ["--tokenizer", "--feature-map", "--no-jit"]),
    ],
)
def test_help_exits_cleanly(module, flags, capsys):
    train = importlib.import_module(module)

    with pytest.raises(SystemExit) as exc:
        train.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in flags:
        assert flag in out
