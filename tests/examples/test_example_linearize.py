"""Smoke test of examples/linearize: the pipeline's steps on tiny keras-hub teachers."""

import json

import keras
import numpy as np
import pytest

import keras_linattn
from examples.linearize import pipeline as P
from tests.tolerance import assert_close

V, T = 30, 32


def _ids(n=4000, seed=0):
    return np.random.default_rng(seed).integers(2, V, n).astype("int32")


def _teacher(family, num_layers=2):
    return P.build_teacher(family, V, hidden_dim=16, num_layers=num_layers, num_heads=2, sequence_length=T)


@pytest.mark.parametrize("family", P.FAMILIES)
def test_covering_window_student_gives_the_teachers_logits(family):
    teacher = _teacher(family)
    student = keras_linattn.linearize(teacher, window_size=T)
    x = _ids(2 * T).reshape(2, T)
    want = np.asarray(teacher(P.as_inputs(x)), "float64")
    assert_close(np.asarray(student(P.as_inputs(x))), want, paths=8, n=32)
    # The window-only control is then the teacher too (every key is in the window).
    assert_close(np.asarray(P.window_only(teacher, T)(P.as_inputs(x))), want, paths=8, n=32)


def test_window_only_control_ignores_keys_older_than_the_window():
    # One layer, window 4: the last position's logits see only the last 4 tokens in the window-only
    # control (the linear part is 0), but all of them in the hedgehog student.
    teacher = _teacher("llama", num_layers=1)
    a = _ids(T)[None]
    b = a.copy()
    b[0, :8] = (b[0, :8] + 1 - 2) % (V - 2) + 2  # change tokens far older than the window
    window_only = P.window_only(teacher, 4)
    np.testing.assert_allclose(
        np.asarray(window_only(P.as_inputs(a)))[0, -1], np.asarray(window_only(P.as_inputs(b)))[0, -1], atol=1e-5
    )
    student = keras_linattn.linearize(teacher, window_size=4)
    gap = np.abs(np.asarray(student(P.as_inputs(a)))[0, -1] - np.asarray(student(P.as_inputs(b)))[0, -1]).max()
    assert gap > 1e-4


def test_transfer_lowers_the_attention_loss_and_lora_trains_only_adapters():
    teacher = _teacher("llama")
    ids = _ids()
    student = keras_linattn.linearize(teacher, window_size=4)
    _, first, last = P.transfer(
        student, teacher, ids, steps=15, sequence_length=T, batch_size=4, learning_rate=5e-2, verbose=0
    )
    assert last < 0.9 * first  # measured: about 0.74
    before = P.bits_per_char(student, ids, T, 4)
    merged, tokens = P.lora_student(
        student, ids, steps=3, sequence_length=T, batch_size=4, learning_rate=1e-2, verbose=0
    )
    assert tokens == 3 * 4 * T
    assert not any(v.path.endswith("lora_kernel_a") for v in merged.weights)
    assert np.isfinite(P.bits_per_char(merged, ids, T, 4)) and before > 0


@pytest.mark.parametrize("family", P.FAMILIES)
def test_teacher_lora_control_trains_only_the_same_adapters(family):
    control = _teacher(family)
    adapters = P.enable_teacher_lora(control, rank=2, alpha=4)
    assert len(adapters) == 2 * 4 * 2 and {id(v) for v in control.trainable_weights} == {id(v) for v in adapters}


def test_bits_per_char_is_the_mean_cross_entropy_in_bits():
    teacher = _teacher("gpt2")
    ids = _ids(3 * (T + 1))
    blocks = ids.reshape(3, T + 1)
    logits = np.asarray(teacher(P.as_inputs(blocks[:, :-1])), "float64")
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    want = -np.take_along_axis(logp, blocks[:, 1:, None], -1).mean() / np.log(2.0)
    assert abs(P.bits_per_char(teacher, ids, T, 3) - want) < 1e-5


def test_run_help_and_bad_skip(capsys):
    from examples.linearize import run

    with pytest.raises(SystemExit):
        run.parse_args(["--help"])
    assert "--teacher" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run.parse_args(["--skip", "nothing"])
    from examples.linearize import decode

    with pytest.raises(SystemExit):
        decode.main(["--help"])
    assert "--student-preset" in capsys.readouterr().out


def test_decode_per_token_time_is_the_median_of_paired_differences():
    from examples.linearize import decode

    n0, n1 = 8, 1032
    t0 = [0.50, 0.52, 0.70]  # the third n0 run hit a hiccup
    t1 = [0.54, 0.57, 0.56]
    per_token = sorted(1e3 * (b - a) / (n1 - n0) for a, b in zip(t0, t1, strict=True))
    median, lowest, highest = decode.per_token_ms(t0, t1, n0, n1)
    np.testing.assert_allclose([median, lowest, highest], [per_token[1], per_token[0], per_token[2]], rtol=1e-12)
    with pytest.raises(ValueError, match="n1 > n0"):
        decode.per_token_ms([0.1], [0.2], 8, 8)
    with pytest.raises(ValueError, match="one n0 and one n1 time per repeat"):
        decode.per_token_ms([0.1, 0.2], [0.2], 8, 16)


def test_reuse_teacher_takes_a_previous_run_only_with_the_same_teacher(tmp_path):
    from examples.linearize import run

    def args(*extra):
        return run.parse_args(["--family", "llama", "--teacher-steps", "7", "--reuse-teacher", *extra])

    preset = tmp_path / "preset"
    preset.mkdir()
    results = str(tmp_path / "r.json")
    assert run._reusable_teacher(args(), results) is None  # no previous run
    config = {k: v for k, v in vars(args()).items() if k not in ("log", "results")}
    previous = {"config": config, "teacher_preset": str(preset), "teacher_tokens": 123}
    with open(results, "w") as f:
        json.dump(previous, f)
    assert run._reusable_teacher(args(), results)["teacher_tokens"] == 123
    # Another transfer setting does not matter; another teacher setting does, and so does a missing preset.
    assert run._reusable_teacher(args("--transfer-steps", "3"), results) is not None
    assert run._reusable_teacher(args("--teacher-steps", "8"), results) is None
    assert run._reusable_teacher(args("--family", "gpt2"), results) is None
    preset.rmdir()
    assert run._reusable_teacher(args(), results) is None


@pytest.mark.slow
def test_whole_example_runs_and_exports_the_same_tokens(tmp_path):
    from examples.linearize import run

    keras.utils.set_random_seed(0)
    path = tmp_path / "r.json"
    run.main(
        ["--family", "llama", "--sequence-length", "64", "--window-size", "8", "--hidden-dim", "16",
         "--teacher-steps", "4", "--transfer-steps", "2", "--lora-steps", "2", "--eval-sequences", "2",
         "--max-chars", "60000", "--decode-contexts", "64", "--teacher-decode-contexts", "64",
         "--decode-repeats", "1", "--skip", "scratch", "--work-dir", str(tmp_path), "--results", str(path)]
    )  # fmt: skip
    res = json.loads(path.read_text())
    assert res["exactness"]["max_abs_logit_error"] < 1e-4
    assert res["export"]["tokens_equal_keras_saved_model"] and res["export"]["tokens_equal_keras_onnx"]
    assert res["export"]["saved_model_max_abs_logit_error"] <= 1e-4
    assert res["export"]["onnx_max_abs_logit_error"] <= 1e-4
    assert [e["factor"] for e in res["length"]] == [1, 4, 16]
