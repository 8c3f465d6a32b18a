"""`make demo` end to end at a tiny size: trains the recall configuration, samples, exports, verifies."""

import os

import pytest

from examples import demo


@pytest.mark.slow  # two exports and their verification; `make test-slow`
def test_demo_runs_end_to_end_and_verifies_its_exports(tmp_path, capsys):
    out = tmp_path / "demo"
    code = demo.main(
        ["--out", str(out), "--steps", "4", "--max-chars", "30000", "--generate-length", "8", "--batch-size", "4"]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "conv_size=4, decay=scalar" in printed
    assert "verification  passed" in printed
    assert os.path.exists(out / "char_lm.keras")


def test_the_demo_trains_with_one_accuracy_metric():
    import numpy as np

    from keras_linattn.models import LinearCausalLM

    model = LinearCausalLM(vocabulary_size=20, num_layers=1, hidden_dim=8, num_heads=2, intermediate_dim=16)
    demo.compile_lm(model)
    ids = np.random.default_rng(0).integers(1, 20, (4, 9)).astype("int32")
    history = model.fit(ids[:, :-1], ids[:, 1:], validation_data=(ids[:, :-1], ids[:, 1:]), epochs=1, verbose=0)
    assert sorted(history.history) == ["accuracy", "loss", "val_accuracy", "val_loss"]
