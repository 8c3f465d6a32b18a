"""`make demo` end to end at a tiny size: trains the recall configuration, samples, exports, verifies."""

import os

import pytest

from examples import demo


@pytest.mark.slow  # about 90 s alone on 2 cores (two exports and their verification); `make test-slow`
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
