"""Smoke test of the attention benchmark at N=64, and of its naive cumsum anchor."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from benchmarks import anchors
from benchmarks import bench_attention as bench
from keras_linattn.layers import LinearAttention
from keras_linattn.ops import kernel_attention_reference
from tests.tolerance import assert_close


def _features(rng, shape):
    return tf.constant(np.exp(0.5 * rng.standard_normal(shape)), tf.float32)  # positive, like phi


def assert_gradients_close(got, expected, ns, paths, what="gradient"):
    """Each gradient within the error model for its reduction length ``ns[i]``.

    A gradient's rounding error is inherited from the whole backward pass, so
    each is checked with conditioning = (scale of all the gradients) / (its own scale).
    """
    expected = [np.asarray(e, np.float64) for e in expected]
    scale = max(float(np.abs(e).max()) for e in expected)
    assert len(got) == len(expected) == len(ns)
    for i, (a, e, n) in enumerate(zip(got, expected, ns, strict=True)):
        conditioning = scale / float(np.abs(e).max())
        assert_close(a, e, n=n, paths=paths, conditioning=conditioning, what=f"{what} {i}")


def test_naive_cumsum_matches_quadratic_oracle(rng):
    b, t, h, c, m = 2, 37, 3, 5, 4
    qf = _features(rng, (b, t, h, c))  # [B, T, H, C]
    kf = _features(rng, (b, t, h, c))  # [B, T, H, C]
    v = tf.constant(rng.standard_normal((b, t, h, m)), tf.float32)  # [B, T, H, M]
    with tf.GradientTape() as tape:
        tape.watch([qf, kf, v])
        naive = anchors.naive_causal_linear_attention(qf, kf, v)
        loss_naive = tf.reduce_sum(naive * tf.sin(tf.range(m, dtype=tf.float32)))
    g_naive = tape.gradient(loss_naive, [qf, kf, v])
    # The oracle in float64 from the same (float32-representable) inputs.
    q64, k64, v64 = (tf.cast(a, tf.float64) for a in (qf, kf, v))
    with tf.GradientTape() as tape:
        tape.watch([q64, k64, v64])
        ref = kernel_attention_reference(q64, k64, v64, causal=True)  # float64 (v's dtype)
        loss_ref = tf.reduce_sum(ref * tf.sin(tf.range(m, dtype=tf.float64)))
    g_ref = tape.gradient(loss_ref, [q64, k64, v64])
    # Prefix sums over T positions, then q . S over C features (positive features: conditioning 1).
    assert_close(naive, ref, n=t + c, what="outputs")
    # Backward: the same reductions, plus the cotangent contracted over the M value features.
    assert_gradients_close(g_naive, g_ref, ns=[t + c + m] * 3, paths=1)


def test_naive_layer_equals_chunked_causal_layer(rng):
    # T=70 is not a multiple of the chunk (16): several chunks plus padding.
    b, t, dim, heads, key_dim = 2, 70, 12, 2, 8
    x = tf.constant(rng.standard_normal((b, t, dim)), tf.float32)  # [B, T, dim]
    # The naive anchor replaces the core alone (no convolution in its call): both without one.
    ours = LinearAttention(num_heads=heads, key_dim=key_dim, feature_map="elu", conv_size=None, chunk_size=16)
    naive = anchors.NaiveCausalLinearAttention(num_heads=heads, key_dim=key_dim, feature_map="elu", conv_size=None)
    ours(x, x, use_causal_mask=True)
    naive(x, x)
    naive.set_weights(ours.get_weights())
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y_ours = ours(x, x, use_causal_mask=True)  # [B, T, dim]
        y_naive = naive(x, x)  # [B, T, dim]
        l_ours = tf.reduce_sum(y_ours * x)
        l_naive = tf.reduce_sum(y_naive * x)
    # Two float32 computations (chunked vs prefix sums): paths=2. elu features are positive.
    n = dim + t + key_dim + heads * key_dim  # input projection over dim + S keys + C features + H*M output projection
    assert_close(y_ours, y_naive, n=n, paths=2, what="outputs")
    g_ours = tape.gradient(l_ours, [x] + ours.trainable_variables)
    g_naive = tape.gradient(l_naive, [x] + naive.trainable_variables)
    assert len(g_ours) == len(g_naive) == 1 + 8
    # The input gradient mirrors the forward reductions; a weight's gradient adds the B*T positions sharing it.
    assert_gradients_close(g_ours, g_naive, ns=[n] + [n + b * t] * 8, paths=2)


def _parse_tables(markdown):
    """{section title: list of rows (list of cells)} of the '### ' sections."""
    tables, title = {}, None
    for line in markdown.splitlines():
        if line.startswith("### "):
            title = line[4:].strip()
            tables[title] = []
        elif title and line.startswith("|") and not set(line) <= set("|-: "):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            tables[title].append(cells)
    return tables


def test_benchmark_machinery_at_n64(tmp_path):
    args = bench.parse_args(
        [
            "--ns",
            "64",
            "--repeats",
            "2",
            "--memory-impls",
            "linear_causal",
            "--no-download",
            "--out-dir",
            str(tmp_path),
            "--prefix",
            "smoke",
        ]
    )
    results = bench.run_benchmark(args, log=lambda *a: None)
    paths = bench.write_outputs(results, args.out_dir, args.prefix, plot=True)

    # Markdown tables parse back to the raw numbers of the JSON.
    with open(paths["json"]) as f:
        raw = json.load(f)
    with open(paths["md"]) as f:
        tables = _parse_tables(f.read())
    time_table = tables["Time (s), median forward + backward"]
    header, rows = time_table[0], time_table[1:]
    assert header == ["N"] + [bench.SHORT[i] for i in bench.IMPLS]
    assert [r[0] for r in rows] == ["64"]
    by_impl = {p["impl"]: p for p in raw["points"]}
    for impl, cell in zip(bench.IMPLS, rows[0][1:], strict=True):
        pt = by_impl[impl]
        if impl in ("kernel_attention", "kernel_attention_rf") and "skipped" in pt:
            # Allowed only because downloads are off and the file is not cached.
            assert cell.startswith("skipped: unavailable") and "not cached" in cell
            continue
        assert len(pt["times_s"]) == 2
        # Not a rounding bound: the table prints 4 decimals, so a cell is within half a unit (5e-5) of the value.
        assert float(cell) == pytest.approx(np.median(pt["times_s"]), abs=5e-5)
        assert float(cell) > 0
    cpu_rows = tables["Process CPU time (s), median forward + backward (all threads)"][1:]
    for impl, cell in zip(bench.IMPLS, cpu_rows[0][1:], strict=True):
        if "skipped" in by_impl[impl]:
            continue
        assert float(cell) == pytest.approx(np.median(by_impl[impl]["cpu_times_s"]), abs=5e-5)
    mem_rows = tables["Peak memory increase (MB), fresh child process per point"][1:]
    mem_cells = dict(zip(bench.IMPLS, mem_rows[0][1:], strict=True))
    mem = by_impl["linear_causal"]["memory"]
    assert "error" not in mem, mem
    assert mem["peak_rss"] >= mem["baseline_rss"] > 0
    # The table prints MB with 1 decimal: within half a unit (0.05 MB).
    assert float(mem_cells["linear_causal"].lstrip("<= ")) == pytest.approx(mem["increase"] / 1e6, abs=0.05)
    assert mem_cells["linear"] == "not measured"
    figure_rows = tables["Figures"][1:]
    assert len(figure_rows) == len(bench.TARGETS)
    assert all(r[1] == "n/a" for r in figure_rows)  # no N=8192 point in a smoke run
    with open(paths["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    # The compiled steps the benchmark times compute the same function for the
    # naive cumsum anchor and our chunked causal layer (same weights).
    ours = bench.Impl("linear_causal", args)
    naive = bench.Impl("naive_causal", args)
    naive.layer.set_weights(ours.layer.get_weights())
    x, dy = ours.inputs(64)
    loss_ours, grads_ours = ours.step(x, dy)
    loss_naive, grads_naive = naive.step(x, dy)
    # Two float32 computations of one function: paths=2. Forward: input projection over the
    # width (H*D) inputs + N keys + C = D elu features + output projection over H*M = width.
    n_batch = args.batch * 64  # B*N positions
    n = ours.width + 64 + args.key_dim + ours.width
    # The loss sums B*N*width products y*dy: its conditioning is that of a sum, sum|y dy| / |sum y dy|.
    y_dy = np.asarray(ours.layer(x, x, use_causal_mask=True), np.float64) * np.asarray(dy, np.float64)
    sum_conditioning = float(np.abs(y_dy).sum() / abs(y_dy.sum()))
    assert_close(loss_ours, loss_naive, n=n + n_batch * ours.width, paths=2, conditioning=sum_conditioning, what="loss")
    # Input gradient: the forward reductions mirrored; a weight's gradient adds the B*N positions.
    ns = [n] + [n + n_batch] * (len(grads_ours) - 1)
    assert_gradients_close(grads_ours, grads_naive, ns=ns, paths=2)


def test_loglog_slope_and_figures():
    ns = [4096, 8192, 16384, 32768]
    assert bench.loglog_slope(ns, [3.0 * n for n in ns]) == pytest.approx(1.0)
    assert bench.loglog_slope(ns, [1e-6 * n**2 for n in ns]) == pytest.approx(2.0)
    assert bench.loglog_slope([4096], [1.0]) is None
    results = {
        "config": {"ns": ns},
        "points": [
            {"impl": "linear", "n": 8192, "median_s": 0.5, "cpu_median_s": 0.25},
            {"impl": "linear_causal", "n": 8192, "median_s": 0.9, "memory": {"increase": 100}},
            {"impl": "kernel_attention", "n": 8192, "median_s": 1.0, "cpu_median_s": 1.0},
            {"impl": "mha", "n": 8192, "median_s": 10.0},
            {"impl": "naive_causal", "n": 8192, "median_s": 30.0, "memory": {"increase": 1000}},
        ],
    }
    figs = bench.compute_figures(results)
    assert figs["speedup_vs_kernel_attention"]["value"] == pytest.approx(2.0)
    assert figs["speedup_vs_kernel_attention"]["met"] is False
    assert figs["speedup_vs_mha"]["value"] == pytest.approx(20.0)
    assert figs["speedup_vs_mha"]["met"] is True
    assert figs["causal_over_noncausal_time"]["value"] == pytest.approx(1.8)
    assert figs["causal_over_naive_memory"]["value"] == pytest.approx(0.1)
    assert figs["slope_time_linear"]["value"] is None  # one point only
    assert figs["cpu_speedup_vs_kernel_attention"]["value"] == pytest.approx(4.0)
    assert figs["cpu_speedup_vs_kernel_attention"]["met"] is True
    assert figs["cpu_speedup_vs_mha"]["value"] is None  # no CPU time for mha


def test_kernel_attention_unavailable_without_cache(tmp_path):
    with pytest.raises(anchors.AnchorUnavailable, match="not cached"):
        anchors.fetch_kernel_attention_source(str(tmp_path), allow_download=False)
    assert not os.listdir(tmp_path)


def test_profile_reads_the_trace_and_its_groups_add_up(tmp_path):
    from benchmarks import profile_attention as prof

    assert prof.group_of("_MklBatchMatMulV2") == "matmul" and prof.group_of("Cumsum") == "scan"
    assert prof.group_of("StridedSliceGrad") == "move" and prof.group_of("EluGrad") == "elementwise"
    prof.main(
        [
            "--impls",
            "linear_causal,projections",
            "--n",
            "64",
            "--steps",
            "1",
            "--out-dir",
            str(tmp_path),
            "--prefix",
            "p",
        ]
    )
    with open(tmp_path / "p.json") as f:
        raw = json.load(f)
    assert [r["impl"] for r in raw["impls"]] == ["linear_causal", "projections"]
    for r in raw["impls"]:
        assert r["op_self_time_per_step_s"] > 0
        assert sum(r["groups_s"].values()) == pytest.approx(r["op_self_time_per_step_s"], rel=1e-6)
        assert sum(op["self_s"] for op in r["op_types"]) == pytest.approx(r["op_self_time_per_step_s"], rel=1e-6)
        assert any(op["group"] == "matmul" for op in r["op_types"])  # the projections at least
    text = (tmp_path / "p.md").read_text()
    assert "### Beyond the projections-only floor" in text and "| linear_causal |" in text


def test_short_conv_benchmark_times_both_methods_in_both_modes(tmp_path):
    from benchmarks import bench_short_conv

    rows = bench_short_conv.main(["--shapes", "2x9x6", "--repeats", "1", "--out-dir", str(tmp_path), "--prefix", "c"])
    assert sorted((r["mode"], r["method"]) for r in rows) == [
        ("graph", "depthwise"),
        ("graph", "shifted"),
        ("xla", "depthwise"),
        ("xla", "shifted"),
    ]
    for r in rows:
        assert r["median_s"] > 0 and r["shape"] == [2, 9, 6]
    auto = {(r["mode"], r["method"]): r["over_auto"] for r in rows}
    assert auto[("graph", "depthwise")] == 1.0 and auto[("xla", "shifted")] == 1.0
    with open(tmp_path / "c.json") as f:
        assert json.load(f)["rows"] == rows
    assert "| 2 x 9 x 6 | xla | shifted |" in (tmp_path / "c.md").read_text()


def test_projections_floor_runs_all_twelve_matmuls(tmp_path):
    # The floor is the four projections forward (4 matmuls) and backward (8:
    # the input and the weight gradient of each). With q + k + v as its glue
    # the three projections got one gradient, and the runtime merged their
    # identical weight-gradient matmuls: 10 ran. Counted from a profile,
    # because that merging happens after the traced graph (which holds 12).
    from benchmarks import profile_attention as prof

    args = bench.parse_args(["--ns", "64", "--impls", "projections", "--no-memory", "--no-plot"])
    impl = bench.Impl("projections", args)
    x, dy = impl.inputs(64)
    impl.step(x, dy)
    logdir = str(tmp_path / "trace")
    tf.profiler.experimental.start(logdir)
    impl.step(x, dy)
    tf.profiler.experimental.stop()
    matmuls = {op for op_type, op, _, _ in prof.read_op_stats(logdir) if prof.group_of(op_type) == "matmul"}
    assert len(matmuls) == 12, sorted(matmuls)
