"""Where the time of one attention layer goes: per-op self time from the TF profiler.

    python -m benchmarks.profile_attention                       # linear, linear_causal, projections
    python -m benchmarks.profile_attention --impls linear_causal --n 8192 --jit
    python -m benchmarks.profile_attention --prefix profile_before

The step profiled is the one `benchmarks.bench_attention` times (forward +
backward, ``loss = sum(layer(x, x) * dy)``, B=1, H=8, D=64, elu), built by the
same code. For each implementation: warm-up calls (tracing), then `--steps`
calls under ``tf.profiler.experimental``; the trace is read back with the
profiler's own ``framework_op_stats`` tool and summed by op type.

Op types are grouped so that the remaining time can be read at a glance:

    matmul      MatMul / BatchMatMul / Einsum / XLA dots: the useful work
    transpose   Transpose (layout changes)
    cast        Cast
    select      Select / SelectV2 / where (masks)
    scan        Cumsum
    move        Pad, Slice, StridedSlice, ConcatV2, Reshape, Tile, Pack, ...
    reduce      Sum, Max, Mean, ...
    elementwise everything else that computes (Exp, Mul, AddV2, Elu, ...)

Outputs ``<out-dir>/<prefix>.md`` and ``.json``. Times are per step (the total
self time over the profiled steps divided by `--steps`); the profiler adds its
own overhead, so read shares, not absolute times (`bench_attention` times).
"""

import argparse
import glob
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import defaultdict

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

GROUPS = (
    (
        "matmul",
        (
            "MatMul",
            "BatchMatMul",
            "BatchMatMulV2",
            "BatchMatMulV3",
            "Einsum",
            "_MklMatMul",
            "_MklBatchMatMulV2",
            "_MklFusedMatMul",
            "_FusedMatMul",
            "_MklNativeFusedMatMul",
            "_MklNativeBatchMatMulV2",
            "_MklNativeMatMul",
            "dot",
            "fusion.dot",
            "Conv2D",
        ),
    ),
    ("transpose", ("Transpose", "_MklTranspose", "ConjugateTranspose")),
    ("cast", ("Cast",)),
    ("select", ("Select", "SelectV2")),
    ("scan", ("Cumsum",)),
    (
        "move",
        (
            "Pad",
            "PadV2",
            "Slice",
            "StridedSlice",
            "StridedSliceGrad",
            "ConcatV2",
            "Reshape",
            "Tile",
            "Pack",
            "Unpack",
            "Split",
            "SplitV",
            "ExpandDims",
            "Squeeze",
            "Identity",
            "BroadcastTo",
            "GatherV2",
            "ConcatOffset",
            "Fill",
            "ZerosLike",
            "OnesLike",
            "Shape",
            "Const",
        ),
    ),
    ("reduce", ("Sum", "Max", "Min", "Mean", "Prod", "All", "Any")),
)
GROUP_ORDER = [g for g, _ in GROUPS] + ["elementwise"]


def group_of(op_type):
    """The group of a TF (or XLA) op type; unknown computing ops are 'elementwise'."""
    base = op_type.split(":")[-1]
    for group, types in GROUPS:
        if base in types:
            return group
    low = base.lower()
    if "matmul" in low or low.startswith("dot") or "einsum" in low or "gemm" in low:
        return "matmul"
    if "transpose" in low:
        return "transpose"
    return "elementwise"


def parse_args(argv=None):
    from benchmarks import bench_attention

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--impls",
        default="linear,linear_causal,projections",
        help=f"comma-separated, among {', '.join(bench_attention.IMPLS)}",
    )
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3, help="profiled calls per implementation")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--key-dim", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--jit", action="store_true", help="XLA: tf.function(jit_compile=True)")
    p.add_argument("--top", type=int, default=12, help="op types listed per implementation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--prefix", default="profile")
    args = p.parse_args(argv)
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    unknown = [i for i in args.impls if i not in bench_attention.IMPLS]
    if unknown:
        p.error(f"unknown implementation(s) {unknown}; choose among {list(bench_attention.IMPLS)}")
    if args.steps < 1:
        p.error(f"--steps must be >= 1. Received: {args.steps}")
    # What bench_attention.Impl reads from its arguments.
    args.jit = bool(args.jit)
    args.no_download = True
    return args


def read_op_stats(logdir):
    """[(op_type, op_name, occurrences, self_time_us)] from the trace under `logdir`."""
    from tensorflow.python.profiler.internal import _pywrap_profiler_plugin as plugin

    paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError(f"the profiler wrote no trace under {logdir}")
    data, ok = plugin.xspace_to_tools_data(paths, "framework_op_stats", {})
    if not ok:
        raise RuntimeError(f"framework_op_stats failed: {data[:200]!r}")
    table = json.loads(data)[0]
    cols = [c["id"] for c in table["cols"]]
    rows = []
    for row in table["rows"]:
        cell = dict(zip(cols, (c.get("v") for c in row["c"]), strict=True))
        if cell.get("host_or_device") not in (None, "Host", "Device"):
            continue
        op_type = cell["type"]
        if op_type in ("IDLE", "Idle"):
            continue
        rows.append((op_type, cell["operation"], int(cell["occurrences"]), float(cell["total_self_time"])))
    return rows


def profile_impl(name, args, log=print):
    import tensorflow as tf

    from benchmarks.bench_attention import Impl

    impl = Impl(name, args, log=log)
    x, dy = impl.inputs(args.n)
    t0 = time.perf_counter()
    for _ in range(2):  # trace, then one untimed call
        loss, _ = impl.step(x, dy)
        float(loss)
    warm = time.perf_counter() - t0
    logdir = tempfile.mkdtemp(prefix="kla_profile_")
    try:
        tf.profiler.experimental.start(logdir)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss, _ = impl.step(x, dy)
            float(loss)
        wall = (time.perf_counter() - t0) / args.steps
        tf.profiler.experimental.stop()
        rows = read_op_stats(logdir)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    by_type = defaultdict(lambda: [0, 0.0])
    for op_type, _, occ, self_us in rows:
        by_type[op_type][0] += occ
        by_type[op_type][1] += self_us
    total = sum(v[1] for v in by_type.values())
    groups = defaultdict(float)
    for op_type, (_, us) in by_type.items():
        groups[group_of(op_type)] += us
    steps = args.steps
    result = {
        "impl": name,
        "wall_per_step_s": wall,
        "warmup_s": warm,
        "op_self_time_per_step_s": total / 1e6 / steps,
        "groups_s": {g: groups.get(g, 0.0) / 1e6 / steps for g in GROUP_ORDER},
        "op_types": sorted(
            (
                {"type": t, "group": group_of(t), "calls_per_step": occ / steps, "self_s": us / 1e6 / steps}
                for t, (occ, us) in by_type.items()
            ),
            key=lambda r: -r["self_s"],
        ),
    }
    log(
        f"[profile] {name:<17} wall {wall:.3f} s/step under the profiler; op self time "
        f"{result['op_self_time_per_step_s']:.3f} s/step: "
        + ", ".join(f"{g} {result['groups_s'][g]:.3f}" for g in GROUP_ORDER if result["groups_s"][g] > 0)
    )
    return result


def render_markdown(results, top):
    cfg = results["config"]
    env = results["environment"]
    mode = "XLA (`jit_compile=True`)" if cfg["jit"] else "`tf.function`, no XLA"
    lines = [
        f"# Profile: where the time of forward + backward goes (N={cfg['n']})",
        "",
        f"Command: `{results['command']}`",
        "",
        f"B={cfg['batch']}, H={cfg['heads']}, D=M={cfg['key_dim']}, chunk {cfg['chunk_size']}, elu; {mode}; "
        f"{cfg['steps']} profiled steps after 2 warm-up calls. TensorFlow {env['tensorflow']}, Keras "
        f"{env['keras']}, {env['cpu_count']} CPUs, load average {env['loadavg_start'][0]:.2f} at start. "
        "Seconds per step of op self time (the TF profiler's framework_op_stats), summed by group; "
        "the profiler's own overhead is in the wall column, so compare shares and differences.",
        "",
        "### Self time per step by group (s)",
        "",
        "| impl | wall | ops total | " + " | ".join(GROUP_ORDER) + " |",
        "|---|---:|---:|" + "---:|" * len(GROUP_ORDER),
    ]
    for r in results["impls"]:
        cells = [f"{r['groups_s'][g]:.3f}" for g in GROUP_ORDER]
        lines.append(
            f"| {r['impl']} | {r['wall_per_step_s']:.3f} | {r['op_self_time_per_step_s']:.3f} | "
            + " | ".join(cells)
            + " |"
        )
    lines.append("")
    floor = next((r for r in results["impls"] if r["impl"] == "projections"), None)
    if floor is not None:
        lines += [
            "### Beyond the projections-only floor (s per step)",
            "",
            "| impl | ops total | " + " | ".join(GROUP_ORDER) + " |",
            "|---|---:|" + "---:|" * len(GROUP_ORDER),
        ]
        for r in results["impls"]:
            if r is floor:
                continue
            cells = [f"{r['groups_s'][g] - floor['groups_s'][g]:+.3f}" for g in GROUP_ORDER]
            lines.append(
                f"| {r['impl']} | {r['op_self_time_per_step_s'] - floor['op_self_time_per_step_s']:+.3f} | "
                + " | ".join(cells)
                + " |"
            )
        lines.append("")
    for r in results["impls"]:
        lines += [
            f"### {r['impl']}: the {top} op types with the most self time",
            "",
            "| op type | group | calls / step | self s / step | share |",
            "|---|---|---:|---:|---:|",
        ]
        total = r["op_self_time_per_step_s"] or 1.0
        for op in r["op_types"][:top]:
            lines.append(
                f"| {op['type']} | {op['group']} | {op['calls_per_step']:.0f} | {op['self_s']:.4f} | "
                f"{op['self_s'] / total:.1%} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    import keras
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    results = {
        "command": "python -m benchmarks.profile_attention " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {k: getattr(args, k) for k in ("n", "steps", "batch", "heads", "key_dim", "chunk_size", "jit")},
        "environment": {
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "loadavg_start": list(os.getloadavg()),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "impls": [profile_impl(name, args) for name in args.impls],
    }
    os.makedirs(args.out_dir, exist_ok=True)
    md = os.path.join(args.out_dir, args.prefix + ".md")
    with open(md, "w") as f:
        f.write(render_markdown(results, args.top))
    with open(os.path.join(args.out_dir, args.prefix + ".json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"[profile] wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
