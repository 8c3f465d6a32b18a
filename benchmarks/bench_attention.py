"""Time and memory of attention layers, side by side, forward + backward.

    python -m benchmarks.bench_attention                 # full sweep, tf.function (no XLA)
    python -m benchmarks.bench_attention --jit           # same, XLA-compiled
    python -m benchmarks.bench_attention --ns 1024,4096 --impls linear,mha

Implementations (self-attention, B=1, H=8, D=M=64, model width H*D=512,
feature map elu + 1):

    linear            keras_linattn LinearAttention, non-causal
    linear_causal     keras_linattn LinearAttention, causal (chunked, chunk 64)
    mha               keras.layers.MultiHeadAttention (softmax), non-causal
    kernel_attention  TF Model Garden KernelAttention(feature_transform="elu"),
                      non-causal, no random projection (same kernel as ours)
    naive_causal      causal linear attention through a per-token cumsum
                      [B, T, H, C, M] (the textbook form): the memory anchor
    projections       the floor: LinearAttention's four width x width
                      projections alone (q * k + v into the output
                      projection), no attention. Every layer here pays it;
                      "core" below means a layer's time minus this one.
                      Not q + k + v: q, k and v would then receive the same
                      gradient, and TensorFlow's runtime merges the three
                      identical weight-gradient matmuls x^T g into one, so
                      that floor ran 10 of the 12 matmuls.
    causal_fixed, causal_scalar, causal_channel
                      LinearAttention causal with decay="fixed" / "scalar" /
                      "channel" (RetNet, Mamba2, GLA gates)
    causal_conv       LinearAttention causal with conv_size=4
    causal_window     LinearAttention causal with window_size=64 (softmax
                      window + linear attention beyond it)
    causal_delta, causal_gated_delta
                      LinearAttention causal with update="delta" (DeltaNet),
                      and with decay="scalar" (Gated DeltaNet)

Time: one process; every implementation is traced and run once (warm-up), then
the implementations are run in interleaved rounds (the order rotates from one
round to the next) and the median over rounds is reported. One call is
``loss = sum(layer(x, x) * dy)`` plus the gradients with respect to ``x`` and
all trainable weights, inside one ``tf.function`` (``jit_compile`` with --jit).

Memory: one fresh child process per (implementation, N). The child imports,
builds the layer, traces the step function and records its resident set size
(the baseline); then it runs the step twice and reads its peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss``). Reported: peak minus baseline.

Points that cannot fit in the memory budget are skipped with the reason in the
table. Outputs: ``<out-dir>/<prefix>.md`` (tables), ``.json`` (raw numbers),
``.png`` (log-log time and memory vs N).
"""

import argparse
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from benchmarks._common import proc_status_bytes, reset_peak_rss  # noqa: E402

DEFAULT_NS = (1024, 2048, 4096, 8192, 16384, 32768)
# The recall mechanisms, as LinearAttention arguments (causal).
MECHANISMS = {
    "causal_fixed": dict(decay="fixed"),
    "causal_scalar": dict(decay="scalar"),
    "causal_channel": dict(decay="channel"),
    "causal_conv": dict(conv_size=4),
    "causal_window": dict(window_size=64),
    "causal_delta": dict(update="delta", normalize=False),
    "causal_gated_delta": dict(update="delta", normalize=False, decay="scalar"),
}
IMPLS = (
    "linear",
    "linear_causal",
    "projections",
    "mha",
    "kernel_attention",
    "kernel_attention_rf",
    "naive_causal",
) + tuple(MECHANISMS)
LABELS = {
    "linear": "LinearAttention (non-causal)",
    "linear_causal": "LinearAttention (causal, chunked)",
    "mha": "keras MultiHeadAttention (softmax)",
    "kernel_attention": "Model Garden KernelAttention(elu, num_random_features=0)",
    "kernel_attention_rf": "Model Garden KernelAttention(elu), default 256 random features",
    "naive_causal": "naive causal cumsum [B,T,H,C,M]",
    "projections": "the four projections alone (no attention)",
    **{
        name: f"LinearAttention (causal, {', '.join(f'{k}={v!r}' for k, v in kw.items())})"
        for name, kw in MECHANISMS.items()
    },
}
SHORT = {
    "linear": "ours non-causal",
    "linear_causal": "ours causal",
    "mha": "MHA softmax",
    "kernel_attention": "KernelAttention elu",
    "kernel_attention_rf": "KernelAttention elu (default, 256 rf)",
    "naive_causal": "naive cumsum causal",
    "projections": "projections only",
    **{name: "ours " + name.replace("_", " ") for name in MECHANISMS},
}
FIGURE_N = 8192
SLOPE_RANGE = (4096, 32768)
TARGETS = {
    "speedup_vs_kernel_attention": (">=", 3.0),
    "speedup_vs_kernel_attention_rf": (">=", 3.0),
    "speedup_vs_mha": (">=", 15.0),
    "causal_over_noncausal_time": ("<=", 1.25),
    # The attention core: a layer's time minus the projections-only floor.
    "core_speedup_vs_kernel_attention": (">=", 3.0),
    "core_overhead_noncausal": ("<=", 0.25),
    "core_overhead_causal": ("<=", 0.5),
    "scalar_decay_over_causal_time": ("<=", 1.5),
    "delta_over_causal_time": ("<=", 3.0),
    "gated_delta_over_causal_time": ("<=", 3.0),
    "causal_over_noncausal_memory": ("<=", 2.0),
    "causal_over_naive_memory": ("<=", 0.25),
    "slope_time_linear": ("<=", 1.15),
    "slope_time_linear_causal": ("<=", 1.15),
    "slope_memory_linear": ("<=", 1.15),
    "slope_memory_linear_causal": ("<=", 1.15),
    # The same time figures from process CPU time (steadier on a shared machine).
    "cpu_speedup_vs_kernel_attention": (">=", 3.0),
    "cpu_speedup_vs_mha": (">=", 15.0),
    "cpu_causal_over_noncausal_time": ("<=", 1.25),
    "cpu_core_speedup_vs_kernel_attention": (">=", 3.0),
    "cpu_core_overhead_noncausal": ("<=", 0.25),
    "cpu_core_overhead_causal": ("<=", 0.5),
    "cpu_slope_time_linear": ("<=", 1.15),
    "cpu_slope_time_linear_causal": ("<=", 1.15),
}
RESULT_TAG = "BENCH_CHILD_RESULT "
GB = 1e9
MB = 1e6


# --------------------------------------------------------------- configuration
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_attention",
        description="Forward+backward time and peak memory of LinearAttention vs softmax "
        "MultiHeadAttention, Model Garden KernelAttention and a naive cumsum causal attention.",
    )
    p.add_argument(
        "--ns",
        default=",".join(str(n) for n in DEFAULT_NS),
        help="comma-separated sequence lengths N (default: %(default)s)",
    )
    p.add_argument(
        "--impls",
        default=",".join(IMPLS),
        help="comma-separated implementations among %s (default: all)" % ", ".join(IMPLS),
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--key-dim", type=int, default=64, help="per-head dim D = M; width = heads * key-dim")
    p.add_argument("--chunk-size", type=int, default=64, help="chunk of the causal algorithm")
    p.add_argument("--repeats", type=int, default=3, help="timed interleaved rounds (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per point (the first one traces)")
    p.add_argument("--jit", action="store_true", help="XLA: tf.function(jit_compile=True) for all")
    p.add_argument("--no-memory", action="store_true", help="skip the per-point child processes")
    p.add_argument(
        "--memory-impls", default=None, help="comma-separated implementations to measure memory for (default: --impls)"
    )
    p.add_argument(
        "--mem-budget-gb",
        type=float,
        default=None,
        help="skip points estimated above this (default: 60%% of available RAM at start)",
    )
    p.add_argument(
        "--max-call-seconds",
        type=float,
        default=60.0,
        help="skip a point whose predicted time per call (extrapolated from the previous N, "
        "quadratic for softmax, linear otherwise) exceeds this (default: %(default)s)",
    )
    p.add_argument(
        "--no-download", action="store_true", help="do not fetch tf-models-official; skip KernelAttention if not cached"
    )
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument(
        "--prefix", default=None, help="output file prefix (default: attention, or attention.xla with --jit)"
    )
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--from-json",
        default=None,
        metavar="PATH",
        help="measure nothing: recompute the figures and rewrite the outputs from a saved JSON",
    )
    p.add_argument("--child", nargs=2, metavar=("IMPL", "N"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.ns = [int(n) for n in args.ns.split(",") if n.strip()]
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    unknown = [i for i in args.impls if i not in IMPLS]
    if unknown:
        p.error(f"unknown implementation(s) {unknown}; choose among {list(IMPLS)}")
    args.memory_impls = (
        args.impls if args.memory_impls is None else [i.strip() for i in args.memory_impls.split(",") if i.strip()]
    )
    if args.prefix is None:
        args.prefix = "attention.xla" if args.jit else "attention"
    return args


def available_memory_bytes():
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return 8 * 2**30


def estimate_bytes(impl, n, args):
    """Rough peak working set of one forward+backward call, and what dominates it."""
    b, h, d = args.batch, args.heads, args.key_dim
    width = h * d
    linear_terms = 40 * b * n * width * 4  # activations, gradients, projections
    if impl == "mha":
        scores = b * h * n * n * 4
        return 4 * scores + linear_terms, f"4 x [B,H,N,N] float32 scores of {scores / GB:.1f} GB"
    if impl == "naive_causal":
        prefix = b * n * h * d * d * 4
        # Measured: 6.8 GB at N=8192 where one [B,T,H,C,M] tensor is 1.1 GB.
        return 7 * prefix + linear_terms, f"7 x [B,T,H,C,M] float32 prefix sums of {prefix / GB:.1f} GB"
    return linear_terms, "linear in N"


# --------------------------------------------------------------- implementations
class Impl:
    """A built layer and its compiled forward+backward step."""

    def __init__(self, name, args, log=print):
        import keras
        import tensorflow as tf

        from benchmarks import anchors
        from keras_linattn.layers import LinearAttention

        self.name = name
        self.args = args
        h, d = args.heads, args.key_dim
        width = h * d
        keras.utils.set_random_seed(args.seed)
        causal = False
        if name in ("linear", "linear_causal"):
            layer = LinearAttention(
                num_heads=h, key_dim=d, feature_map="elu", chunk_size=args.chunk_size, conv_size=None
            )
            causal = name == "linear_causal"
        elif name in MECHANISMS:
            layer = LinearAttention(
                num_heads=h,
                key_dim=d,
                feature_map="elu",
                chunk_size=args.chunk_size,
                **{"conv_size": None, **MECHANISMS[name]},
            )
            causal = True
        elif name == "projections":
            layer = LinearAttention(num_heads=h, key_dim=d, feature_map="elu", conv_size=None)
        elif name == "naive_causal":
            layer = anchors.NaiveCausalLinearAttention(num_heads=h, key_dim=d, feature_map="elu", conv_size=None)
        elif name == "mha":
            layer = anchors.make_mha(h, d)
        elif name == "kernel_attention":
            cls = anchors.load_kernel_attention(allow_download=not args.no_download, log=log)
            layer = cls(feature_transform="elu", num_random_features=0, num_heads=h, key_dim=d)
        elif name == "kernel_attention_rf":
            # The constructor as users call it: `KernelAttention(feature_transform="elu")`
            # keeps its default num_random_features=256 (a random projection to
            # 256 features before elu), so its attention state is [256 x 64].
            cls = anchors.load_kernel_attention(allow_download=not args.no_download, log=log)
            layer = cls(feature_transform="elu", num_heads=h, key_dim=d)
        else:
            raise ValueError(f"Unknown implementation. Received: impl={name!r}")

        if name == "projections":

            def apply(x):
                q, k, v = layer.project(x, x)  # [B, N, H, D] each
                # Three different gradients, so that all 12 matmuls run (see
                # the module docstring); the glue is one product and one sum
                # forward, two products backward.
                return layer.project_output(q * k + v, False)  # [B, N, width]
        elif name in ("linear", "linear_causal") or name in MECHANISMS:

            def apply(x):
                return layer(x, x, use_causal_mask=causal)
        else:

            def apply(x):
                return layer(x, x)

        # Build eagerly on a tiny input so that no variable is created while tracing.
        if name == "projections":
            layer(tf.zeros((args.batch, 8, width)), tf.zeros((args.batch, 8, width)))
        apply(tf.zeros((args.batch, 8, width)))
        variables = list(layer.trainable_variables)

        def step(x, dy):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = apply(x)  # [B, N, width]
                loss = tf.reduce_sum(tf.cast(y, tf.float32) * dy)
            grads = tape.gradient(loss, [x] + variables)
            return loss, grads

        self.layer = layer
        self.step = tf.function(step, jit_compile=bool(args.jit))
        self.width = width

    def inputs(self, n):
        import tensorflow as tf

        g = tf.random.Generator.from_seed(self.args.seed + n)
        x = g.normal((self.args.batch, n, self.width))  # [B, N, width]
        dy = g.normal((self.args.batch, n, self.width))  # [B, N, width]
        return x, dy


def _rss_bytes():
    rss = proc_status_bytes("VmRSS")
    if rss is not None:
        return rss
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss_bytes():
    # VmHWM belongs to this process's own address space. ru_maxrss of
    # RUSAGE_SELF / RUSAGE_CHILDREN is not used when VmHWM exists: after
    # fork + exec it still carries the parent's high-water mark.
    hwm = proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def child_memory(args):
    """Runs in a fresh process: peak RSS increase of one (impl, N) fwd+bwd."""
    impl, n = args.child[0], int(args.child[1])
    out = {"impl": impl, "n": n}
    try:
        bench = Impl(impl, args, log=lambda *a: print(*a, file=sys.stderr))
        x, dy = bench.inputs(n)
        bench.step.get_concrete_function(x, dy)  # trace only, nothing runs
        gc.collect()
        baseline = _rss_bytes()
        reset = reset_peak_rss()
        peak_before = _peak_rss_bytes()
        for _ in range(2):
            loss, _ = bench.step(x, dy)
            float(loss)
        peak = _peak_rss_bytes()
        out.update(
            baseline_rss=baseline,
            peak_before=peak_before,
            peak_rss=peak,
            peak_mark_reset=reset,
            increase=peak - baseline,
            # Without a reset, a run that never rose above the high-water mark
            # of imports/build only bounds the increase from above.
            upper_bound=(not reset) and peak <= peak_before,
        )
    except Exception as e:  # reported in the table, never silently
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    print(RESULT_TAG + json.dumps(out), flush=True)


def measure_memory(impl, n, args, timeout=900):
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_attention",
        "--child",
        impl,
        str(n),
        "--batch",
        str(args.batch),
        "--heads",
        str(args.heads),
        "--key-dim",
        str(args.key_dim),
        "--chunk-size",
        str(args.chunk_size),
        "--seed",
        str(args.seed),
    ]
    if args.jit:
        cmd.append("--jit")
    if args.no_download:
        cmd.append("--no-download")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=root, env=env)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "n": n, "error": f"child timed out after {timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
    return {"impl": impl, "n": n, "error": f"child exited with {proc.returncode}: {tail}"}


# --------------------------------------------------------------------- the sweep
def run_benchmark(args, log=print):
    import keras
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")  # retracing per N and AutoGraph notes on Model Garden's lambdas
    budget = args.mem_budget_gb * GB if args.mem_budget_gb else 0.6 * available_memory_bytes()
    results = {
        "config": {
            "batch": args.batch,
            "heads": args.heads,
            "key_dim": args.key_dim,
            "width": args.heads * args.key_dim,
            "feature_map": "elu",
            "chunk_size": args.chunk_size,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "jit": bool(args.jit),
            "ns": list(args.ns),
            "impls": list(args.impls),
            "memory_budget_bytes": budget,
            "memory": not args.no_memory,
        },
        "environment": {
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "loadavg_start": list(os.getloadavg()),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "points": [],
        "memory_method": "fresh child per point; increase = peak RSS (VmHWM, reset after build) - RSS after build",
    }
    mode = "XLA (jit_compile=True)" if args.jit else "tf.function, no XLA"
    log(
        f"[bench] {mode}; B={args.batch} H={args.heads} D={args.key_dim} width={args.heads * args.key_dim} "
        f"chunk={args.chunk_size}; repeats={args.repeats}; memory budget {budget / GB:.1f} GB; "
        f"load average {os.getloadavg()[0]:.2f}"
    )

    impls, unavailable = {}, {}
    for name in args.impls:
        try:
            impls[name] = Impl(name, args, log=log)
        except Exception as e:
            reason = f"unavailable: {e}"
            unavailable[name] = reason
            log(f"[bench] skip {name}: {reason}")

    last_time = {}  # impl -> (N, median seconds) of its last measured point
    for n in args.ns:
        points = {}
        runnable = []
        for name in args.impls:
            pt = {"impl": name, "n": n}
            points[name] = pt
            if name in unavailable:
                pt["skipped"] = unavailable[name]
                continue
            est, what = estimate_bytes(name, n, args)
            pt["estimated_bytes"] = est
            if est > budget:
                pt["skipped"] = f"needs ~{est / GB:.0f} GB ({what}) > budget {budget / GB:.1f} GB"
                log(f"[bench] N={n:>6} {name:<17} skipped: {pt['skipped']}")
                continue
            prev = last_time.get(name)
            if prev is not None:
                predicted = prev[1] * (n / prev[0]) ** (2 if name == "mha" else 1)
                if predicted > args.max_call_seconds:
                    pt["skipped"] = (
                        f"predicted ~{predicted:.0f} s per call > limit "
                        f"{args.max_call_seconds:g} s (--max-call-seconds)"
                    )
                    log(f"[bench] N={n:>6} {name:<17} skipped: {pt['skipped']}")
                    continue
            runnable.append(name)
        args_n = {}
        for name in list(runnable):
            x, dy = impls[name].inputs(n)
            args_n[name] = (x, dy)
            t0 = time.perf_counter()
            try:
                for _ in range(max(1, args.warmup)):
                    loss, _ = impls[name].step(x, dy)
                    float(loss)
            except Exception as e:
                points[name]["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                log(f"[bench] N={n:>6} {name:<17} failed: {points[name]['error']}")
                runnable.remove(name)
                del args_n[name]
                continue
            points[name]["warmup_s"] = time.perf_counter() - t0
            log(f"[bench] N={n:>6} {name:<17} warm-up (trace + run) {points[name]['warmup_s']:.2f} s")
        times = {name: [] for name in runnable}
        cpu_times = {name: [] for name in runnable}
        for r in range(args.repeats):
            k = r % max(1, len(runnable))
            for name in runnable[k:] + runnable[:k]:
                x, dy = args_n[name]
                c0 = time.process_time()
                t0 = time.perf_counter()
                loss, _ = impls[name].step(x, dy)
                float(loss)
                times[name].append(time.perf_counter() - t0)
                cpu_times[name].append(time.process_time() - c0)
        del args_n
        gc.collect()
        for name in runnable:
            pt = points[name]
            pt["times_s"] = times[name]
            pt["median_s"] = statistics.median(times[name]) if times[name] else None
            pt["min_s"] = min(times[name]) if times[name] else None
            # Process CPU time (all threads): less sensitive than wall-clock to
            # other processes competing for the cores.
            pt["cpu_times_s"] = cpu_times[name]
            pt["cpu_median_s"] = statistics.median(cpu_times[name]) if cpu_times[name] else None
            if pt["median_s"] is not None:
                last_time[name] = (n, pt["median_s"])
            log(
                f"[bench] N={n:>6} {name:<17} time median {pt['median_s']:.4f} s "
                f"(runs {', '.join(f'{t:.3f}' for t in times[name])}; CPU median {pt['cpu_median_s']:.3f} s)"
            )
        if not args.no_memory:
            for name in runnable:
                if name not in args.memory_impls:
                    continue
                mem = measure_memory(name, n, args)
                points[name]["memory"] = mem
                if "error" in mem:
                    log(f"[bench] N={n:>6} {name:<17} memory failed: {mem['error']}")
                else:
                    bound = "<= " if mem["upper_bound"] else ""
                    log(f"[bench] N={n:>6} {name:<17} peak memory increase {bound}{mem['increase'] / MB:.1f} MB")
        results["points"].extend(points[name] for name in args.impls)
    results["environment"]["loadavg_end"] = list(os.getloadavg())
    results["environment"]["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results["figures"] = compute_figures(results)
    return results


# ------------------------------------------------------------------- figures
def _point(results, impl, n):
    for pt in results["points"]:
        if pt["impl"] == impl and pt["n"] == n:
            return pt
    return None


def _time(results, impl, n, key="median_s"):
    pt = _point(results, impl, n)
    return None if pt is None else pt.get(key)


def _mem(results, impl, n):
    pt = _point(results, impl, n)
    if pt is None or "memory" not in pt or "error" in pt["memory"]:
        return None
    return pt["memory"]["increase"]


def loglog_slope(ns, values):
    """Least-squares slope of log(value) against log(N); None with < 2 points."""
    pairs = [(math.log(n), math.log(v)) for n, v in zip(ns, values, strict=True) if v is not None and v > 0]
    if len(pairs) < 2:
        return None
    mx = sum(p[0] for p in pairs) / len(pairs)
    my = sum(p[1] for p in pairs) / len(pairs)
    sxx = sum((p[0] - mx) ** 2 for p in pairs)
    sxy = sum((p[0] - mx) * (p[1] - my) for p in pairs)
    return sxy / sxx


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _core_ratio(results, a, b, n, key="median_s"):
    """``(t_a - t_proj) / (t_b - t_proj)``, or with ``b=None`` ``(t_a - t_proj) / t_proj``.

    ``t_proj`` is the projections-only floor: the time every layer here spends
    outside its attention core.
    """
    floor = _time(results, "projections", n, key)
    ta = _time(results, a, n, key)
    tb = floor if b is None else _time(results, b, n, key)
    if floor is None or ta is None or tb is None:
        return None
    core_b = tb if b is None else tb - floor
    return (ta - floor) / core_b if core_b > 0 else None


def compute_figures(results):
    n = FIGURE_N
    ns = [m for m in results["config"]["ns"] if SLOPE_RANGE[0] <= m <= SLOPE_RANGE[1]]
    lin = _time(results, "linear", n)
    figs = {
        "speedup_vs_kernel_attention": _ratio(_time(results, "kernel_attention", n), lin),
        "speedup_vs_kernel_attention_rf": _ratio(_time(results, "kernel_attention_rf", n), lin),
        "speedup_vs_mha": _ratio(_time(results, "mha", n), lin),
        "causal_over_noncausal_time": _ratio(_time(results, "linear_causal", n), lin),
        "causal_over_naive_memory": _ratio(_mem(results, "linear_causal", n), _mem(results, "naive_causal", n)),
    }
    causal = _time(results, "linear_causal", n)
    figs["core_speedup_vs_kernel_attention"] = _core_ratio(results, "kernel_attention", "linear", n)
    figs["core_overhead_noncausal"] = _core_ratio(results, "linear", None, n)
    figs["core_overhead_causal"] = _core_ratio(results, "linear_causal", None, n)
    figs["scalar_decay_over_causal_time"] = _ratio(_time(results, "causal_scalar", n), causal)
    figs["delta_over_causal_time"] = _ratio(_time(results, "causal_delta", n), causal)
    figs["gated_delta_over_causal_time"] = _ratio(_time(results, "causal_gated_delta", n), causal)
    figs["causal_over_noncausal_memory"] = _ratio(_mem(results, "linear_causal", n), _mem(results, "linear", n))
    for impl in ("linear", "linear_causal"):
        figs[f"slope_time_{impl}"] = loglog_slope(ns, [_time(results, impl, m) for m in ns])
        figs[f"slope_memory_{impl}"] = loglog_slope(ns, [_mem(results, impl, m) for m in ns])
    cpu = "cpu_median_s"
    lin_cpu = _time(results, "linear", n, cpu)
    figs["cpu_speedup_vs_kernel_attention"] = _ratio(_time(results, "kernel_attention", n, cpu), lin_cpu)
    figs["cpu_speedup_vs_mha"] = _ratio(_time(results, "mha", n, cpu), lin_cpu)
    figs["cpu_causal_over_noncausal_time"] = _ratio(_time(results, "linear_causal", n, cpu), lin_cpu)
    figs["cpu_core_speedup_vs_kernel_attention"] = _core_ratio(results, "kernel_attention", "linear", n, cpu)
    figs["cpu_core_overhead_noncausal"] = _core_ratio(results, "linear", None, n, cpu)
    figs["cpu_core_overhead_causal"] = _core_ratio(results, "linear_causal", None, n, cpu)
    for impl in ("linear", "linear_causal"):
        figs[f"cpu_slope_time_{impl}"] = loglog_slope(ns, [_time(results, impl, m, cpu) for m in ns])
    out = {}
    for key, value in figs.items():
        op, target = TARGETS[key]
        met = None if value is None else (value >= target if op == ">=" else value <= target)
        out[key] = {"value": value, "target": f"{op} {target:g}", "met": met}
    return out


FIGURE_TEXT = {
    "speedup_vs_kernel_attention": f"non-causal speed-up vs KernelAttention(elu) at N={FIGURE_N}",
    "speedup_vs_kernel_attention_rf": (
        f"non-causal speed-up vs KernelAttention(elu) with its default 256 random features at N={FIGURE_N}"
    ),
    "speedup_vs_mha": f"non-causal speed-up vs MultiHeadAttention at N={FIGURE_N}",
    "causal_over_noncausal_time": f"causal / non-causal time at N={FIGURE_N}",
    "core_speedup_vs_kernel_attention": (
        f"attention-core speed-up vs KernelAttention(elu) (time minus projections) at N={FIGURE_N}"
    ),
    "core_overhead_noncausal": f"core overhead over the projections, non-causal, at N={FIGURE_N}",
    "core_overhead_causal": f"core overhead over the projections, causal, at N={FIGURE_N}",
    "scalar_decay_over_causal_time": f"causal decay='scalar' / causal time at N={FIGURE_N}",
    "delta_over_causal_time": f"causal update='delta' / causal time at N={FIGURE_N}",
    "gated_delta_over_causal_time": f"causal Gated DeltaNet / causal time at N={FIGURE_N}",
    "causal_over_noncausal_memory": f"causal / non-causal peak memory at N={FIGURE_N}",
    "causal_over_naive_memory": f"causal peak memory / naive cumsum peak memory at N={FIGURE_N}",
    "slope_time_linear": "log-log slope of time, non-causal, N=4k..32k",
    "slope_time_linear_causal": "log-log slope of time, causal, N=4k..32k",
    "slope_memory_linear": "log-log slope of memory, non-causal, N=4k..32k",
    "slope_memory_linear_causal": "log-log slope of memory, causal, N=4k..32k",
    "cpu_speedup_vs_kernel_attention": f"CPU time: non-causal speed-up vs KernelAttention(elu) at N={FIGURE_N}",
    "cpu_speedup_vs_mha": f"CPU time: non-causal speed-up vs MultiHeadAttention at N={FIGURE_N}",
    "cpu_causal_over_noncausal_time": f"CPU time: causal / non-causal at N={FIGURE_N}",
    "cpu_core_speedup_vs_kernel_attention": f"CPU time: attention-core speed-up vs KernelAttention at N={FIGURE_N}",
    "cpu_core_overhead_noncausal": f"CPU time: core overhead over the projections, non-causal, N={FIGURE_N}",
    "cpu_core_overhead_causal": f"CPU time: core overhead over the projections, causal, N={FIGURE_N}",
    "cpu_slope_time_linear": "CPU time: log-log slope, non-causal, N=4k..32k",
    "cpu_slope_time_linear_causal": "CPU time: log-log slope, causal, N=4k..32k",
}


# ------------------------------------------------------------------- outputs
def _cell(pt, kind):
    if pt is None:
        return "not run"
    if "skipped" in pt:
        return f"skipped: {pt['skipped']}"
    if "error" in pt:
        return f"failed: {pt['error']}"
    if kind in ("time", "cpu"):
        key = "median_s" if kind == "time" else "cpu_median_s"
        return "not run" if pt.get(key) is None else f"{pt[key]:.4f}"
    mem = pt.get("memory")
    if mem is None:
        return "not measured"
    if "error" in mem:
        return f"failed: {mem['error']}"
    return ("<= " if mem["upper_bound"] else "") + f"{mem['increase'] / MB:.1f}"


def _escape(text):
    return text.replace("|", "\\|")


def render_markdown(results):
    cfg = results["config"]
    env = results["environment"]
    impls = cfg["impls"]
    lines = []
    mode = "XLA (`jit_compile=True`)" if cfg["jit"] else "`tf.function`, no XLA"
    lines.append(
        f"Forward + backward, B={cfg['batch']}, H={cfg['heads']}, D=M={cfg['key_dim']}, "
        f"width {cfg['width']}, feature map {cfg['feature_map']}, causal chunk {cfg['chunk_size']}; "
        f"{mode}; median of {cfg['repeats']} interleaved runs after warm-up. "
        f"TensorFlow {env['tensorflow']}, Keras {env['keras']}, {env['cpu_count']} CPUs, "
        f"load average {env['loadavg_start'][0]:.2f} at start, "
        f"{env.get('loadavg_end', [float('nan')])[0]:.2f} at end ({env['started']})."
    )
    lines.append("")
    for kind, title in (
        ("time", "Time (s), median forward + backward"),
        ("memory", "Peak memory increase (MB), fresh child process per point"),
        ("cpu", "Process CPU time (s), median forward + backward (all threads)"),
    ):
        if kind == "memory" and not cfg["memory"]:
            continue
        lines.append(f"### {title}")
        lines.append("")
        lines.append("| N | " + " | ".join(SHORT[i] for i in impls) + " |")
        lines.append("|---:|" + "---:|" * len(impls))
        for n in cfg["ns"]:
            cells = [_escape(_cell(_point(results, i, n), kind)) for i in impls]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("### Figures")
    lines.append("")
    lines.append(
        "From the wall-clock medians (time) and the child-process peaks (memory) above; "
        "the `CPU time:` rows use the process CPU time medians instead."
    )
    lines.append("")
    lines.append("| figure | value | target | met |")
    lines.append("|---|---:|---:|:---:|")
    for key, fig in results["figures"].items():
        value = "n/a" if fig["value"] is None else f"{fig['value']:.3f}"
        met = "n/a" if fig["met"] is None else ("yes" if fig["met"] else "**no**")
        lines.append(f"| {FIGURE_TEXT[key]} | {value} | {fig['target']} | {met} |")
    lines.append("")
    return "\n".join(lines)


def write_plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = results["config"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for kind, ax in zip(("time", "memory"), axes, strict=True):
        for impl in cfg["impls"]:
            ns, vals = [], []
            for n in cfg["ns"]:
                v = _time(results, impl, n) if kind == "time" else _mem(results, impl, n)
                if v is not None and v > 0:
                    ns.append(n)
                    vals.append(v if kind == "time" else v / MB)
            if ns:
                ax.loglog(ns, vals, marker="o", label=LABELS[impl])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("median fwd+bwd time (s)" if kind == "time" else "peak memory increase (MB)")
        ax.set_title("time" if kind == "time" else "memory")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    mode = "XLA" if cfg["jit"] else "tf.function"
    fig.suptitle(f"attention fwd+bwd, B={cfg['batch']} H={cfg['heads']} D={cfg['key_dim']} ({mode})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results, out_dir, prefix, plot=True):
    os.makedirs(out_dir, exist_ok=True)
    paths = {"md": os.path.join(out_dir, prefix + ".md"), "json": os.path.join(out_dir, prefix + ".json")}
    with open(paths["md"], "w") as f:
        f.write(render_markdown(results))
    with open(paths["json"], "w") as f:
        json.dump(results, f, indent=1)
    if plot:
        paths["png"] = os.path.join(out_dir, prefix + ".png")
        write_plot(results, paths["png"])
    return paths


def print_figures(results, log=print):
    log("[bench] figures:")
    for key, fig in results["figures"].items():
        value = "n/a" if fig["value"] is None else f"{fig['value']:.3f}"
        met = "n/a (missing points)" if fig["met"] is None else ("met" if fig["met"] else "MISSED")
        log(f"  {FIGURE_TEXT[key]:<62} {value:>8}  target {fig['target']:<7} {met}")


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        child_memory(args)
        return 0
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
        results["figures"] = compute_figures(results)
    else:
        results = run_benchmark(args)
    paths = write_outputs(results, args.out_dir, args.prefix, plot=not args.no_plot)
    print_figures(results)
    for path in paths.values():
        print(f"[bench] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
