"""`benchmarks/bench_length.py`: its arguments, the length scoring and a smoke run at tiny sizes."""

import json
import math

import numpy as np
import pytest

from benchmarks import bench_length as B


class _Uniform:
    """Equal logits over V tokens: log2(V) bits per character at every position and length."""

    def __init__(self, vocabulary_size):
        self.vocabulary_size = vocabulary_size
        self.lengths = []

    def __call__(self, inputs, training=False):
        ids = np.asarray(inputs["token_ids"])
        self.lengths.append(ids.shape[1])
        return np.zeros(ids.shape + (self.vocabulary_size,), "float32")


def test_every_length_scores_windows_of_that_length_from_the_same_characters():
    model = _Uniform(16)
    ids = np.arange(1000) % 16
    bits = B.bits_at_lengths(model, ids, 10, [1, 4, 16], 700)
    assert bits == {1: 4.0, 4: 4.0, 16: 4.0}  # log2(16)
    # 700 characters: 63 windows of 10 (+1 target), 17 of 40, 4 of 160.
    assert model.lengths == [10] * 63 + [40] * 17 + [160] * 4


def test_rows_report_the_ratio_to_the_training_length():
    row = B._row("x", {1: 2.0, 4: 2.2, 16: 1.9})
    assert row["ratio_to_1x"] == {"1": 1.0, "4": 1.1, "16": 0.95}


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        B.parse_args(["--students", "lolcats,nope"])
    with pytest.raises(SystemExit):
        B.parse_args(["--scratch", "softmax"])
    with pytest.raises(SystemExit):
        B.parse_args(["--eval-chars", "1000"])  # 16 x 512 needs 8,193
    args = B.parse_args(["--quick"])
    assert (args.sequence_length, args.eval_chars) == (B.QUICK["sequence_length"], B.QUICK["eval_chars"])


# Slow: a teacher, three students and a scratch model, each trained and scored at two lengths; the
# scoring and the arguments are checked above without a run.
@pytest.mark.slow
def test_a_tiny_run_writes_every_row(tmp_path):
    path = tmp_path / "length.json"
    argv = ["--quick", "--students", "window,unrotated_mean,cache_unrotated_mean", "--scratch", "delta_conv"]
    argv += ["--factors", "1,4"]
    B.main(argv + ["--out", str(path)])
    result = json.loads(path.read_text())
    rows = {row["row"]: row for row in result["rows"]}
    assert set(rows) == {"teacher", "window", "unrotated_mean", "cache_unrotated_mean", "scratch_delta_conv"}
    assert rows["unrotated_mean"]["options"] == {"linear_rope": False, "linear_mean": True, "linear_weight": 8.0}
    assert rows["cache_unrotated_mean"]["options"] == {
        "cache_size": B.QUICK["cache_size"],
        "linear_rope": False,
        "linear_mean": True,
        "linear_weight": 8.0,
    }
    assert rows["scratch_delta_conv"]["trained_at"] == B.QUICK["scratch_length"]
    for row in rows.values():
        assert set(row["bits_per_char"]) == {"1", "4"}
        assert all(math.isfinite(b) and 0 < b < 8 for b in row["bits_per_char"].values())


def test_the_clamped_cache_rows_are_known_students():
    args = B.parse_args(["--quick", "--students", ",".join(B.OBJECTIVES) + ",cache_clamped_copy", "--scratch", ""])
    assert args.students == [
        "cache_clamped_output",
        "cache_clamped_attention",
        "cache_clamped_both",
        "cache_clamped_copy",
    ]
    assert B.STUDENTS["cache_clamped_attention"] == B.STUDENTS["cache_clamped"]  # the same student, trained otherwise
    assert B.STUDENTS["cache_copy"] == B.STUDENTS["cache"]
    assert B.STUDENTS["cache_unrotated_fixed_copy"] == B.STUDENTS["cache_unrotated_fixed"]
    with pytest.raises(ValueError, match="Unknown student 'nope'"):
        B.make_student("nope", None, None, args)


@pytest.fixture(scope="module")
def tiny():
    """A small untrained Llama teacher at the quick sizes, its ids, the quick arguments and its clamped copy."""
    from examples.char_lm.data import CharVocabulary, load_stdlib_corpus
    from examples.linearize import pipeline as P

    args = B.parse_args(["--quick", "--scratch", "", "--transfer-steps", "1"])
    args.transfer_steps = 1  # --quick sets 3; one step moves the maps
    text = load_stdlib_corpus(args.max_chars)
    text = text[: int(0.95 * len(text))]  # the run's training split, whose characters are its vocabulary
    vocab = CharVocabulary.from_text(text)
    teacher = P.build_teacher("llama", vocab.size, sequence_length=args.sequence_length, seed=0)
    ids = vocab.encode(text)
    copy, copy_extra = B.make_student("cache_clamped_copy", teacher, ids, args)
    return teacher, ids, args, copy, copy_extra


def _window_weights(student):
    """``(frozen values, feature-map values)``, each in the attention layers' order."""
    from examples.linearize import pipeline as P
    from keras_linattn.linearization._attention_objective import frozen_names

    names = frozen_names(B.FROZEN)
    layers = P.attention_layers(student)
    frozen = [np.array(v) for layer in layers for v in layer.weights if v.name in names]
    maps = [np.array(v) for layer in layers for v in layer.feature_map.trainable_weights]
    return frozen, maps


# The output objective runs the cache's recurrence with gradients (slow at any size); the attention row alone
# covers the path in the fast suite.
@pytest.mark.parametrize(
    "name",
    [
        "cache_clamped_attention",
        pytest.param("cache_clamped_output", marks=pytest.mark.slow),
        pytest.param("cache_clamped_both", marks=pytest.mark.slow),
    ],
)
def test_a_clamped_row_trains_its_feature_maps_with_its_objective_gamma_and_weight_frozen(tiny, name):
    teacher, ids, args, copy, copy_extra = tiny
    student, extra = B.make_student(name, teacher, ids, args)
    assert copy_extra["transfer"] is None
    assert extra["transfer"] == {"objective": B.OBJECTIVES[name], "freeze": ["gamma", "linear_weight"], "steps": 1}
    assert extra["options"] == {"cache_size": 4, "linear_rope": False, "cache_max_distance": args.sequence_length}
    (copy_frozen, copy_maps), (frozen, maps) = _window_weights(copy), _window_weights(student)
    assert len(frozen) == 2 * len(P_layers(student))  # a gamma and a linear weight per layer
    for before, after in zip(copy_frozen, frozen, strict=True):
        np.testing.assert_array_equal(after, before)  # frozen: bit for bit the copy's
    assert extra["frozen_max_change"] == 0.0
    assert any(not np.array_equal(a, b) for a, b in zip(copy_maps, maps, strict=True))  # the maps trained


def P_layers(model):
    from examples.linearize import pipeline as P

    return P.attention_layers(model)


# Slow: two students scored at two lengths after a preset round trip.
@pytest.mark.slow
def test_the_clamped_rows_run_on_a_saved_teacher_preset(tiny, tmp_path):
    teacher, _, _, _, _ = tiny
    preset, out = tmp_path / "teacher", tmp_path / "length.json"
    teacher.save_to_preset(str(preset))
    students = "cache_clamped_copy,cache_clamped_attention"
    argv = ["--quick", "--teacher-preset", str(preset), "--students", students, "--scratch", "", "--factors", "1,4"]
    B.main([*argv, "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["teacher"] == {"preset": str(preset)}
    rows = {row["row"]: row for row in result["rows"]}
    assert list(rows) == ["teacher", "cache_clamped_copy", "cache_clamped_attention"]
    assert rows["cache_clamped_copy"]["transfer"] is None
    assert rows["cache_clamped_attention"]["transfer"]["objective"] == "attention"
    assert rows["cache_clamped_attention"]["frozen_max_change"] == 0.0
