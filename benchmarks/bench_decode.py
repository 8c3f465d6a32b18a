"""Time and memory per generated token vs context length: recurrent linear attention vs a KV cache.

    python -m benchmarks.bench_decode                       # full sweep (several minutes on 2 cores)
    python -m benchmarks.bench_decode --contexts 128,1024 --repeats 3 --no-memory

Model (both decoders): 2 layers, width 512, 8 heads of 64, feed-forward 2048,
gelu, pre-norm, vocabulary 256, tied embeddings, batch 8, float32, greedy.

    ours        keras_linattn LinearCausalLM (feature map elu + 1): the
                context is prefilled with `call_with_state` in pieces of
                `--prefill-piece` tokens (XLA-compiled; the state is carried
                from piece to piece, so prefill memory does not grow with the
                context either), then tokens are decoded with `LinearCausalLM.step`
                in an XLA-compiled `ops.while_loop` (greedy argmax).
    kv_cache    a softmax decoder of the same size written here with Keras 3
                layers: per layer Dense q/k/v/output projections (what
                `MultiHeadAttention` computes) and a preallocated KV cache
                ``[B, H, context + tokens, 64]`` updated with
                `ops.slice_update`; each step attends over the whole
                preallocated cache with a causal mask (as keras-hub's cached
                attention does), decoding in the same XLA-compiled while_loop.
                The cache holds random keys/values for the context (the cost
                of a step does not depend on the values).
    recompute   decoding without a state: each new token runs our parallel
                model (chunked causal path, XLA-compiled) on the whole prefix.
                Measured up to `--recompute-max`; beyond, extrapolated
                linearly from the largest measured context (the parallel path
                is O(N)) and marked as such.

Time per token: `--tokens` tokens are decoded per call; the call is compiled
and run once (warm-up), then timed in interleaved rounds (see
`measure_times`): ours 2 x `--repeats` runs per context, KV-cached and
recompute `--repeats` runs; the median is reported (min and all runs are in
the JSON).

Memory (`--memory`): one fresh child process per (method, context). It builds
the model, prefills (ours: pieces; kv_cache: allocates the cache), then
decodes `--tokens` tokens once (compilation), resets the kernel's peak-RSS
mark (``/proc/self/clear_refs``) and decodes `--tokens` tokens again.
Reported: the peak RSS of that last decoding call (``VmHWM`` in
``/proc/self/status``) and the process peak before it (prefill and
compilation included). ``getrusage``'s ``ru_maxrss`` is not used: on Linux it
carries the parent's peak across ``exec``.

Outputs: ``<out-dir>/decode.md`` (tables) and ``decode.json`` (raw numbers).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from benchmarks._common import proc_status_bytes, reset_peak_rss  # noqa: E402

DEFAULT_CONTEXTS = (128, 1024, 4096, 8192, 16384)
CONFIG = dict(vocabulary_size=256, num_layers=2, hidden_dim=512, num_heads=8, intermediate_dim=2048)
RESULT_TAG = "BENCH_DECODE_CHILD "
MB = 1e6


# ----------------------------------------------------------------- models
def build_ours(chunk_size=64, feature_map="elu", **mechanisms):
    """The benchmark's LinearCausalLM; `mechanisms` are `LinearAttention`'s recall arguments."""
    from keras_linattn.models import LinearCausalLM

    # No convolution unless a mechanism names one: the figures on record are of that configuration.
    mechanisms = {"conv_size": None, **mechanisms}
    return LinearCausalLM(feature_map=feature_map, chunk_size=chunk_size, **CONFIG, **mechanisms, name="ours")


class KVCacheDecoder:
    """Pre-norm softmax decoder with a preallocated KV cache (the baseline).

    Same sizes as `LinearCausalLM` with `CONFIG`; Keras 3 layers and
    `keras.ops` only. ``step(token [B], caches, index)`` writes the new key and
    value at `index` with `ops.slice_update` and attends over the cache.
    """

    def __init__(self, vocabulary_size, num_layers, hidden_dim, num_heads, intermediate_dim):
        import keras

        self.num_heads = num_heads
        self.head_dim = hidden_dim // num_heads
        self.embedding = keras.layers.ReversibleEmbedding(vocabulary_size, hidden_dim, tie_weights=True)
        self.embedding.build((None,))
        self.layers = []
        for _ in range(num_layers):
            layer = dict(
                ln1=keras.layers.LayerNormalization(epsilon=1e-5),
                q=keras.layers.Dense(hidden_dim),
                k=keras.layers.Dense(hidden_dim),
                v=keras.layers.Dense(hidden_dim),
                o=keras.layers.Dense(hidden_dim),
                ln2=keras.layers.LayerNormalization(epsilon=1e-5),
                ff1=keras.layers.Dense(intermediate_dim, activation="gelu"),
                ff2=keras.layers.Dense(hidden_dim),
            )
            for name, sub in layer.items():
                sub.build((None, intermediate_dim if name == "ff2" else hidden_dim))
            self.layers.append(layer)
        self.final_norm = keras.layers.LayerNormalization(epsilon=1e-5)
        self.final_norm.build((None, hidden_dim))

    def empty_caches(self, batch, length, fill_random=True):
        from keras import ops, random

        shape = (batch, self.num_heads, length, self.head_dim)
        make = (lambda s: random.normal(shape, seed=s)) if fill_random else (lambda s: ops.zeros(shape))
        return [make(i) for i in range(2 * len(self.layers))]

    def step(self, token, caches, index):
        from keras import ops

        b = ops.shape(token)[0]
        x = self.embedding(token)  # [B, dim]
        new_caches = []
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = caches[2 * i], caches[2 * i + 1]  # [B, H, L, Dh]
            h = layer["ln1"](x)
            q = ops.reshape(layer["q"](h), (b, self.num_heads, 1, self.head_dim))  # [B, H, 1, Dh]
            k = ops.reshape(layer["k"](h), (b, self.num_heads, 1, self.head_dim))  # [B, H, 1, Dh]
            v = ops.reshape(layer["v"](h), (b, self.num_heads, 1, self.head_dim))  # [B, H, 1, Dh]
            start = ops.stack([0, 0, index, 0])
            k_cache = ops.slice_update(k_cache, start, k)  # [B, H, L, Dh]
            v_cache = ops.slice_update(v_cache, start, v)  # [B, H, L, Dh]
            scores = ops.einsum("bhqd,bhld->bhql", q, k_cache) / (self.head_dim**0.5)  # [B, H, 1, L]
            visible = ops.arange(ops.shape(k_cache)[2]) <= index  # [L]
            scores = ops.where(visible[None, None, None, :], scores, -1e9)
            weights = ops.softmax(scores, axis=-1)  # [B, H, 1, L]
            att = ops.einsum("bhql,bhld->bhqd", weights, v_cache)  # [B, H, 1, Dh]
            x = x + layer["o"](ops.reshape(att, (b, -1)))  # [B, dim]
            x = x + layer["ff2"](layer["ff1"](layer["ln2"](x)))  # [B, dim]
            new_caches += [k_cache, v_cache]
        return self.embedding(self.final_norm(x), reverse=True), new_caches  # [B, V]


# --------------------------------------------------------------- decoding
def ours_decoder(model):
    import tensorflow as tf
    from keras import ops

    @tf.function(jit_compile=True, autograph=False)
    def decode(token, state, num_tokens):
        def body(i, token, state):
            logits, state = model.step(token, state)
            return i + 1, ops.cast(ops.argmax(logits, axis=-1), "int32"), state

        _, token, state = ops.while_loop(lambda i, t, s: i < num_tokens, body, (0, token, state))
        return token, state

    return decode


def kv_decoder(decoder):
    import tensorflow as tf
    from keras import ops

    @tf.function(jit_compile=True, autograph=False)
    def decode(token, caches, index, num_tokens):
        def body(i, token, caches):
            logits, caches = decoder.step(token, caches, index + i)
            return i + 1, ops.cast(ops.argmax(logits, axis=-1), "int32"), caches

        _, token, caches = ops.while_loop(lambda i, t, c: i < num_tokens, body, (0, token, caches))
        return token, caches

    return decode


def prefill_ours(model, batch, context, piece, rng):
    """Prefills `context` random tokens in pieces; returns (state, seconds)."""
    import tensorflow as tf
    from keras import ops

    piece = min(piece, context)

    @tf.function(jit_compile=True, autograph=False)
    def run(ids, state):
        logits, state = model.call_with_state(ids, state)
        return ops.cast(ops.argmax(logits[:, -1], axis=-1), "int32"), state

    ids = rng.integers(0, CONFIG["vocabulary_size"], size=(batch, context)).astype("int32")
    state = model.get_initial_state(batch)
    # Warm-up compiles for the piece shape (and the remainder, if any).
    run(ids[:, :piece], state)
    if context % piece:
        run(ids[:, : context % piece], state)
    start = time.perf_counter()
    token = None
    for lo in range(0, context, piece):
        token, state = run(ids[:, lo : lo + piece], state)
    _ = float(ops.sum(state[0]))  # sync
    return token, state, time.perf_counter() - start


def _timed(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def measure_times(args):
    """Returns one row per context (see the module docstring).

    The machine may be shared and noisy, so runs are interleaved: every
    context's prefilled state is kept (it is ~1 MB per layer whatever the
    context) and each round times ours at every context, then, context by
    context, alternates KV-cached and ours runs. The median over all runs of
    a (method, context) is reported.
    """
    import numpy as np
    import tensorflow as tf
    from keras import ops

    rng = np.random.default_rng(0)
    model = build_ours()
    decode = ours_decoder(model)
    kv = KVCacheDecoder(**CONFIG)
    kv_decode = kv_decoder(kv)
    n = tf.constant(args.tokens)
    rows = {c: {"context": c, "ours_runs_s": [], "kv_runs_s": []} for c in args.contexts}
    prefilled = {}
    for context in args.contexts:
        token, state, prefill_s = prefill_ours(model, args.batch, context, args.prefill_piece, rng)
        prefilled[context] = (token, state)
        rows[context]["ours_prefill_s"] = prefill_s
        print(f"prefilled {context} tokens x {args.batch} rows in {prefill_s:.1f} s", flush=True)

    def run_ours(context):
        token, state = prefilled[context]
        start = time.perf_counter()
        decode(token, state, n)[0].numpy()
        return time.perf_counter() - start

    run_ours(args.contexts[0])  # compile (one shape for every context)
    for _ in range(args.repeats):
        for context in args.contexts:
            rows[context]["ours_runs_s"].append(run_ours(context))

    for context in args.contexts:
        caches = kv.empty_caches(args.batch, context + args.tokens)
        kv_token = ops.zeros((args.batch,), "int32")
        index = tf.constant(context)

        def run_kv(kv_token=kv_token, caches=caches, index=index):
            start = time.perf_counter()
            kv_decode(kv_token, caches, index, n)[0].numpy()
            return time.perf_counter() - start

        run_kv()  # compile for this cache length
        for _ in range(args.repeats):
            rows[context]["kv_runs_s"].append(run_kv())
            rows[context]["ours_runs_s"].append(run_ours(context))
        caches = None  # frees this context's KV cache before the next one
        print(f"kv-cache {context}: done", flush=True)

    recompute_measured = {}
    for context in args.contexts:
        row = rows[context]
        if context <= args.recompute_max:
            ids = rng.integers(0, CONFIG["vocabulary_size"], size=(args.batch, context)).astype("int32")
            forward = tf.function(lambda x: ops.argmax(model(x)[:, -1], axis=-1), jit_compile=True, autograph=False)

            def run_recompute(forward=forward, ids=ids):
                forward(ids).numpy()

            run_recompute()
            med, times = _timed(run_recompute, args.repeats)
            row["recompute_ms_per_token"] = 1e3 * med
            row["recompute_runs_s"] = times
            row["recompute_extrapolated"] = False
            recompute_measured[context] = 1e3 * med
        else:
            base = max(recompute_measured)
            row["recompute_ms_per_token"] = recompute_measured[base] * context / base
            row["recompute_extrapolated"] = True
        row["ours_ms_per_token"] = 1e3 * statistics.median(row["ours_runs_s"]) / args.tokens
        row["kv_ms_per_token"] = 1e3 * statistics.median(row["kv_runs_s"]) / args.tokens
        print(json.dumps(row), flush=True)
    return [rows[c] for c in args.contexts]


# ----------------------------------------------------------------- memory
def _status_mb(field):
    """A /proc/self/status memory field (VmRSS: current, VmHWM: peak) in MB, NaN where unreadable."""
    size = proc_status_bytes(field)
    return float("nan") if size is None else size / MB


def _rss_mb():
    return _status_mb("VmRSS")


def memory_child(method, context, args):
    import numpy as np
    import tensorflow as tf
    from keras import ops

    rng = np.random.default_rng(0)
    n = tf.constant(args.tokens)
    if method == "ours":
        model = build_ours()
        decode = ours_decoder(model)
        token, state, _ = prefill_ours(model, args.batch, context, args.prefill_piece, rng)
        run = lambda: decode(token, state, n)[0].numpy()  # noqa: E731
    else:
        kv = KVCacheDecoder(**CONFIG)
        decode = kv_decoder(kv)
        caches = kv.empty_caches(args.batch, context + args.tokens)
        zeros = ops.zeros((args.batch,), "int32")
        run = lambda: decode(zeros, caches, tf.constant(context), n)[0].numpy()  # noqa: E731
    run()  # compile and run once
    # VmHWM, not getrusage's ru_maxrss: on Linux ru_maxrss survives exec, so a
    # child started by a large parent would report the parent's peak.
    peak_total = _status_mb("VmHWM")
    before = _rss_mb()
    reset = reset_peak_rss()
    run()
    result = {
        "peak_rss_mb": peak_total,
        "rss_before_decode_mb": before,
        "decode_peak_rss_mb": _status_mb("VmHWM") if reset else None,
    }
    print(RESULT_TAG + json.dumps(result))


def measure_memory(args):
    rows = []
    for context in args.memory_contexts:
        row = {"context": context}
        for method in ("ours", "kv_cache"):
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.bench_decode",
                "--child",
                method,
                str(context),
                "--batch",
                str(args.batch),
                "--tokens",
                str(args.tokens),
                "--prefill-piece",
                str(args.prefill_piece),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
            if proc.returncode or not lines:
                row[method] = {"error": (proc.stderr or proc.stdout)[-400:]}
            else:
                row[method] = json.loads(lines[-1][len(RESULT_TAG) :])
        row["kv_cache_tensor_mb"] = (
            2 * CONFIG["num_layers"] * args.batch * (context + args.tokens) * CONFIG["hidden_dim"] * 4 / MB
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


# ----------------------------------------------------------------- report
def _fmt_ms(x):
    return f"{x:.2f}" if x < 100 else f"{x:.0f}"


def run_meta(args):
    import keras
    import tensorflow as tf

    return {
        "command": "python -m benchmarks.bench_decode " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores",
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "batch": args.batch,
        "tokens_per_call": args.tokens,
        "repeats": args.repeats,
        "model": CONFIG,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "prefill_piece": args.prefill_piece,
    }


def write_report(meta, rows, memory_rows, out_dir):
    """Writes decode.json (raw) and decode.md (tables) under `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "decode.json"), "w") as f:
        json.dump({"meta": meta, "time": rows, "memory": memory_rows}, f, indent=1)
    lines = [
        "# Decoding: time and memory per generated token vs context",
        "",
        f"`{meta['command']}` — {meta['machine']}, TF {meta['tensorflow']}, Keras {meta['keras']}, "
        f"{meta['date_utc']} UTC.",
        "",
        f"Batch {meta['batch']}, 2 layers, width 512, 8 heads x 64, FFN 2048, vocabulary 256, float32, greedy; "
        f"{meta['tokens_per_call']} tokens per timed call (XLA-compiled while_loop); median of "
        f"{2 * meta['repeats']} calls for ours, {meta['repeats']} for the others, interleaved (see the module "
        "docstring).",
        "",
        "| context | ours: step after prefill (ms/token) | KV-cached softmax (ms/token) | recompute prefix (ms/token) "
        "| KV / ours | recompute / ours | ours prefill (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rec = _fmt_ms(r["recompute_ms_per_token"]) + (" (extrapolated)" if r["recompute_extrapolated"] else "")
        lines.append(
            f"| {r['context']} | {_fmt_ms(r['ours_ms_per_token'])} | {_fmt_ms(r['kv_ms_per_token'])} | {rec} "
            f"| {r['kv_ms_per_token'] / r['ours_ms_per_token']:.1f}x "
            f"| {r['recompute_ms_per_token'] / r['ours_ms_per_token']:.0f}x | {r['ours_prefill_s']:.1f} |"
        )
    by_ctx = {r["context"]: r for r in rows}
    checks = []
    if 128 in by_ctx and 8192 in by_ctx:
        ratio = by_ctx[8192]["ours_ms_per_token"] / by_ctx[128]["ours_ms_per_token"]
        checks.append(("ours at 8192 / ours at 128", f"{ratio:.2f}", "<= 1.2", ratio <= 1.2))
    for ctx, target in ((4096, 2.0), (16384, 5.0)):
        if ctx in by_ctx:
            s = by_ctx[ctx]["kv_ms_per_token"] / by_ctx[ctx]["ours_ms_per_token"]
            checks.append((f"KV-cached / ours at {ctx}", f"{s:.1f}x", f">= {target:.0f}x", s >= target))
    if 4096 in by_ctx:
        s = by_ctx[4096]["recompute_ms_per_token"] / by_ctx[4096]["ours_ms_per_token"]
        ext = " (extrapolated)" if by_ctx[4096]["recompute_extrapolated"] else ""
        checks.append((f"recompute / ours at 4096{ext}", f"{s:.0f}x", ">= 100x", s >= 100))
    if checks:
        lines += ["", "| target | measured | wanted | met |", "|---|---:|---:|---|"]
        lines += [f"| {a} | {b} | {c} | {'yes' if d else 'NO'} |" for a, b, c, d in checks]
    if memory_rows:
        lines += [
            "",
            "Memory: one fresh process per cell: build, prefill (ours: pieces of "
            f"{meta['prefill_piece']} tokens through `call_with_state`; KV: allocate the cache), compile and "
            f"decode {meta['tokens_per_call']} tokens once, reset the kernel's peak-RSS mark, decode again. "
            "'Peak RSS while decoding' is the peak of that last call (whole process: model, state or cache "
            "included); 'process peak' is the peak of everything before it (prefill and compilation included).",
            "",
            "| context | ours: peak RSS while decoding (MB) | ours: process peak (MB) "
            "| KV-cached: peak RSS while decoding (MB) | KV-cached: process peak (MB) | KV cache tensors (MB) |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for r in memory_rows:

            def cell(m, key, r=r):
                v = r[m].get(key)
                return f"{v:.0f}" if v is not None else "error"

            lines.append(
                f"| {r['context']} | {cell('ours', 'decode_peak_rss_mb')} | {cell('ours', 'peak_rss_mb')} "
                f"| {cell('kv_cache', 'decode_peak_rss_mb')} | {cell('kv_cache', 'peak_rss_mb')} "
                f"| {r['kv_cache_tensor_mb']:.0f} |"
            )
    lines += [
        "",
        "Notes: ours decodes from the state of a real prefill of the context (random token ids). The KV cache "
        "holds random keys/values for the context (a step's cost does not depend on them). Recompute is "
        "measured up to the largest context not marked 'extrapolated' and scaled linearly beyond (the parallel "
        "path is O(N)). Every run's time is in decode.json: on a shared, loaded machine single runs of the "
        "same call vary by up to 3x, so compare medians and ratios, not single figures.",
    ]
    with open(os.path.join(out_dir, "decode.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def _ints(text):
    return tuple(int(x) for x in text.split(",") if x)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=_ints, default=DEFAULT_CONTEXTS)
    parser.add_argument("--memory-contexts", type=_ints, default=(1024, 4096, 16384))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per timed call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--recompute-max", type=int, default=4096)
    parser.add_argument("--prefill-piece", type=int, default=1024)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--report-only", action="store_true", help="re-render decode.md from decode.json")
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "CONTEXT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.tokens < 1 or args.batch < 1:
        parser.error("--repeats, --tokens and --batch must be positive")
    if args.child:
        memory_child(args.child[0], int(args.child[1]), args)
        return
    if args.report_only:
        with open(os.path.join(args.out_dir, "decode.json")) as f:
            saved = json.load(f)
        write_report(saved["meta"], saved["time"], saved["memory"], args.out_dir)
        return
    meta = run_meta(args)
    rows = measure_times(args)
    memory_rows = [] if args.no_memory else measure_memory(args)
    write_report(meta, rows, memory_rows, args.out_dir)


if __name__ == "__main__":
    main()
