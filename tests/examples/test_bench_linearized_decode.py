"""`benchmarks/bench_linearized_decode.py`: the serving stage's batch choice and a tiny end-to-end run."""

import json

import numpy as np
import pytest

from benchmarks import bench_linearized_decode as B


def test_a_batch_is_tried_only_when_its_memory_fits_the_budget():
    assert B._serve_batches(10, 45, [1, 2, 4, 8]) == [1, 2, 4]
    assert B._serve_batches(10, 5, [1, 2]) == []


def test_the_median_step_time_ignores_the_two_warm_up_calls():
    calls = []
    assert B._time_steps(lambda: calls.append(1), repeats=3) >= 0.0
    assert len(calls) == 5


def test_a_tiny_build_and_serve_run_reports_both_models(tmp_path):
    out = tmp_path / "serve.json"
    argv = ["--family", "llama", "--size", "tiny", "--stages", "build,serve", "--serve-context", "64"]
    argv += ["--serve-batches", "1,2", "--repeats", "1", "--workdir", str(tmp_path / "w"), "--out", str(out)]
    assert B.main(argv) == 0
    serve = json.loads(out.read_text())["stages"]["serve"]
    assert "failed" not in serve, serve
    config = B.CONFIGS[("llama", "tiny")]
    heads, kv_heads = config["num_query_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_dim"] // heads
    # keras-hub's cache: layers x (K, V) x (context + 1) x KV heads x head dim, float32.
    assert serve["teacher"]["kv_bytes_per_sequence"] == config["num_layers"] * 2 * 65 * kv_heads * head_dim * 4
    for name in ("student", "teacher"):
        rows = serve[name]["rows"]
        assert sorted({r["batch"] for r in rows}) == [1, 2]
        for r in rows:
            assert r["step_s"] > 0 and np.isclose(r["tokens_per_s"], r["batch"] / r["step_s"])
        assert serve[name]["largest_batch"] == 2
    assert np.isclose(
        serve["throughput_ratio"], serve["student"]["best"]["tokens_per_s"] / serve["teacher"]["best"]["tokens_per_s"]
    )
    assert serve["student"]["state_bytes_per_sequence"] > 0


# The copy: `make test`; in place (the same stage, one model fewer): `make test-slow`.
@pytest.mark.parametrize("in_place", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_merge_lora_stage_reports_each_step_of_the_recipe(tmp_path, in_place):
    out = tmp_path / "merge.json"
    argv = ["--family", "llama", "--size", "tiny", "--stages", "merge_lora", "--workdir", str(tmp_path / "w")]
    assert B.main(argv + ["--out", str(out)] + (["--merge-in-place"] if in_place else [])) == 0
    stage = json.loads(out.read_text())["stages"]["merge_lora"]
    assert "failed" not in stage, stage
    assert stage["in_place"] is in_place
    for name in ("teacher", "linearize", "enable_lora", "merge_lora"):
        assert stage[name]["s"] >= 0 and stage[name]["peak_gib"] >= stage[name]["rss_after_gib"]  # VmHWM >= VmRSS
    assert stage["weights_gib"] > 0


# Slow: a teacher and a student, each prefilled in pieces and decoded step by step; the decode
# contract itself is in `make test` (tests/models/test_causal_lm.py, tests/export/test_generate_parity.py).
@pytest.mark.slow
def test_the_long_generate_stage_decodes_each_model_s_own_greedy_tokens(tmp_path):
    """A pieced prefill and greedy steps give the tokens of each model's own `generate`."""
    import keras

    out = tmp_path / "long.json"
    work = tmp_path / "w"
    argv = ["--family", "llama", "--size", "tiny", "--stages", "build,long_generate,traffic", "--contexts", "24,40"]
    argv += ["--prefill-piece", "16", "--decode-tokens", "3", "--workdir", str(work), "--out", str(out)]
    assert B.main(argv) == 0
    stage = json.loads(out.read_text())["stages"]["long_generate"]
    assert "failed" not in stage, stage
    prompts = B.long_generate_prompts(B.CONFIGS[("llama", "tiny")]["vocabulary_size"], [24, 40])
    student = keras.saving.load_model(str(work / "student.keras"))
    teacher = B.build_teacher("llama", "tiny")
    teacher.compile(sampler="greedy")  # keras-hub's default samples from the top 5
    for name in ("student", "teacher"):
        rows = stage[name]["rows"]
        assert [r["context"] for r in rows] == [24, 40]
        for r in rows:
            # The prefill's token, then one a step.
            assert r["prefill_s"] > 0 and r["ms_per_token"] > 0 and len(r["tokens"]) == 4
            prompt = prompts[r["context"]]
            if name == "student":
                expected = student.generate(prompt, max_length=r["context"] + 4, stop_token_ids=None)[0]
            else:
                ids = np.concatenate([prompt, np.zeros((1, 4), "int32")], axis=1)
                mask = np.concatenate([np.ones_like(prompt), np.zeros((1, 4), "int32")], axis=1)
                expected = np.asarray(
                    teacher.generate({"token_ids": ids, "padding_mask": mask}, stop_token_ids=None)["token_ids"]
                )[0]
            assert list(expected[r["context"] :]) == r["tokens"], name
    assert [r["context"] for r in stage["ratios"]] == [24, 40]
    # The traffic model: every shape known; the student's step moves the same bytes at any context
    # (a state of fixed size), keras-hub's more with a longer cache.
    student_bytes = [r["step_traffic_bytes"] for r in stage["student"]["rows"]]
    teacher_bytes = [r["step_traffic_bytes"] for r in stage["teacher"]["rows"]]
    assert all(r["step_unknown_shapes"] == 0 for m in ("student", "teacher") for r in stage[m]["rows"])
    assert student_bytes[0] == student_bytes[1] > 0
    assert teacher_bytes[1] > teacher_bytes[0] > 0
    # The traffic stage traces the same step graphs without running them.
    traffic = json.loads(out.read_text())["stages"]["traffic"]
    assert [r["step_traffic_bytes"] for r in traffic["student"]] == student_bytes
    assert [r["step_traffic_bytes"] for r in traffic["teacher"]] == teacher_bytes


def test_the_traffic_model_counts_reads_and_writes_and_skips_views():
    import tensorflow as tf

    @tf.function
    def f(x, table, ids):
        y = tf.reshape(x, [4, 8]) * 2.0  # reshape: a view; multiply: reads 32 + 1 floats, writes 32
        return y, tf.gather(table, ids)  # gather: reads and writes the 3 rows it takes (3 x 16 floats)

    graph = f.get_concrete_function(
        tf.TensorSpec([32], "float32"), tf.TensorSpec([1000, 16], "float32"), tf.TensorSpec([3], "int32")
    ).graph
    traffic, unknown = B.graph_traffic_bytes(graph)
    assert unknown == 0
    # Mul (32 + 1 read, 32 written) + GatherV2 (48 read, 48 written) floats; the axis constant is a Const.
    assert traffic == 4 * ((32 + 1 + 32) + (48 + 48))

    head = tf.function(lambda h, e: tf.matmul(h, tf.transpose(e)))  # the transpose folds into the matmul
    graph = head.get_concrete_function(tf.TensorSpec([1, 8], "float32"), tf.TensorSpec([100, 8], "float32")).graph
    assert B.graph_traffic_bytes(graph) == (4 * (8 + 800 + 100), 0)
    alone = tf.function(lambda e: tf.transpose(e) + 1.0)  # read by an add: a real copy
    graph = alone.get_concrete_function(tf.TensorSpec([100, 8], "float32")).graph
    assert B.graph_traffic_bytes(graph) == (4 * ((800 + 2 + 800) + (800 + 1 + 800)), 0)

    inner = tf.function(lambda x: x * 2.0)
    nested = tf.function(lambda x: inner(x) + 1.0).get_concrete_function(tf.TensorSpec([4], "float32")).graph
    assert B.graph_traffic_bytes(nested)[1] == 1  # a nested call is reported, not silently counted as 0 bytes


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_chain_reads_every_matrix_of_the_model_once(family):
    # The matrices from the config alone are the teacher's multiplied weights: every kernel and the
    # vocabulary head, counted once; lookups (position table, an untied input embedding), biases and
    # norms are not among them.
    teacher = B.build_teacher(family, "tiny")
    config = B.CONFIGS[(family, "tiny")]
    skipped = {"position_embedding/embeddings"}
    if not config.get("tie_word_embeddings", family == "gpt2"):
        skipped.add("token_embedding/embeddings")  # looked up; the head is reverse_embeddings
    counted = [
        int(np.prod(w.shape))
        for w in teacher.weights
        if len(w.shape) >= 2 and not w.path.endswith("bias") and not any(s in w.path for s in skipped)
    ]
    shapes = B.weight_matrices(family, "tiny")
    assert sorted(counted) == sorted(int(np.prod(s)) for s in shapes)


# Slow: a whole benchmark stage; the chain's reads are checked above without a run.
@pytest.mark.slow
def test_a_tiny_chain_run_reports_its_time_beside_the_floor(tmp_path):
    out = tmp_path / "chain.json"
    argv = ["--family", "gpt2", "--size", "tiny", "--stages", "chain", "--repeats", "1"]
    assert B.main(argv + ["--workdir", str(tmp_path / "w"), "--out", str(out)]) == 0
    chain = json.loads(out.read_text())["stages"]["chain"]
    assert "failed" not in chain, chain
    shapes = B.weight_matrices("gpt2", "tiny")
    assert chain["matrices"] == len(shapes) and len(chain["chain_ms_all"]) == 5
    assert chain["chain_ms"] > 0 and np.isclose(chain["chain_over_floor"], chain["chain_ms"] / chain["floor_ms"])
    assert chain["numpy_chain_ms"] > 0
    assert np.isclose(chain["numpy_chain_over_floor"], chain["numpy_chain_ms"] / chain["floor_ms"])


# Slow: an ONNX export of a teacher and a student and two onnxruntime thread settings; the
# stage's argument check is the next test, ONNX decoding is in tests/export/.
@pytest.mark.slow
def test_a_tiny_onnx_decode_run_times_both_thread_settings_beside_the_floor(tmp_path):
    out = tmp_path / "onnx.json"
    argv = ["--family", "gpt2", "--size", "tiny", "--stages", "build,export_onnx,onnx_decode", "--repeats", "1"]
    argv += ["--contexts", "16,254", "--new-tokens", "2,4", "--onnx-profile", "2"]
    argv += ["--workdir", str(tmp_path / "w"), "--out", str(out)]
    assert B.main(argv) == 0
    stage = json.loads(out.read_text())["stages"]["onnx_decode"]
    assert "failed" not in stage, stage
    row, skipped = stage["contexts"]
    assert skipped == {"context": 254, "skipped": "context + 4 new tokens > max_sequence_length=256"}
    for name in ("sleep", "spin"):
        assert row[f"generate_{name}_ms_per_token"] == row[f"generate_{name}_ms_range"][0]  # one repeat
        ratio = row[f"generate_{name}_ms_per_token"] / stage["weights_read_floor_ms"]
        assert np.isclose(row[f"generate_{name}_over_floor"], ratio)
        assert stage["step_ms"][name] > 0 and len(stage["step_ms_runs"][name]) == 1
    profile = stage["profile"]
    assert profile["calls"] == 2 and profile["nodes"] > 0 and profile["ms_per_step"] > 0
    # At least the tiny student's 13 weight products (q, k, v, output and the feed-forward's two in each of
    # its 2 layers, and the head), counted once per step (the feature maps' products come on top).
    products = {op: row["nodes"] for op, row in profile["op_types"].items() if op in ("MatMul", "Gemm", "FusedMatMul")}
    assert sum(products.values()) >= 13, profile["op_types"]
    assert np.isclose(sum(row["ms"] for row in profile["op_types"].values()), profile["ms_per_step"])
    # The floor's bytes are the graph's weights: the student's, within the few non-weight constants.
    build = json.loads(out.read_text())["stages"]["build"]
    assert abs(stage["weights_gib"] - build["weights_gib"]) <= 0.002, (stage["weights_gib"], build["weights_gib"])


def test_onnx_decode_refuses_unknown_thread_settings(tmp_path):
    with pytest.raises(SystemExit):
        B.main(["--stages", "onnx_decode", "--onnx-spinning", "fast", "--workdir", str(tmp_path)])
