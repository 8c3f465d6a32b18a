"""Markdown tables from the example's JSON results.

python -m examples.linearize.report benchmarks/results/linearize_gpt2.json benchmarks/results/linearize_llama.json
"""

import json
import sys


def tables(res):
    out = [f"**{res['family']}** — `{res['command']}`", ""]
    teacher = res["rows"][0]["bits_per_char"]
    out += ["| model | tokens trained | bits/char | vs teacher |", "|---|---:|---:|---:|"]
    for r in res["rows"]:
        tokens = "" if r.get("tokens") is None else f"{r['tokens']:,}"
        out.append(f"| {r['row']} | {tokens} | {r['bits_per_char']:.4f} | {r['bits_per_char'] - teacher:+.4f} |")
    out.append("")
    if "linearize_tokens" in res:
        out.append(
            f"Linearizing (transfer + LoRA) used {res['linearize_tokens']:,} tokens; the teacher was trained on "
            f"{res['teacher_tokens']:,} ({100 * res.get('linearize_token_fraction', 0):.1f}%)."
        )
    if "exactness" in res:
        e = res["exactness"]
        out.append(
            f"Exactness (window {e['window_size']} at T = {e['sequence_length']}): max abs logit error "
            f"{e['max_abs_logit_error']:.2e}, relative to the largest logit {e['max_rel']:.2e}."
        )
    if "length" in res:
        out += ["", "| length | sequences | teacher | student (transfer + LoRA) |", "|---:|---:|---:|---:|"]
        for e in res["length"]:
            out.append(
                f"| {e['length']} ({e['factor']}x) | {e['sequences']} | {e['teacher']:.4f} | {e['student']:.4f} |"
            )
    if "decode" in res:
        d = res["decode"]
        out += [
            "",
            "| context | student ms/token | teacher (keras-hub generate) ms/token | ratio |",
            "|---:|---:|---:|---:|",
        ]
        spans = d.get("range_ms_per_token", {})

        def cell(ms, key):
            lo_hi = spans.get(key)
            return f"{ms:.4f}" + ("" if lo_hi is None else f" [{lo_hi[0]:.4f}, {lo_hi[1]:.4f}]")

        for c, ms in d["student_ms_per_token"].items():
            t = d["teacher_ms_per_token"].get(c)
            teacher = "" if t is None else cell(t, f"teacher {c}")
            out.append(f"| {c} | {cell(ms, f'student {c}')} | {teacher} | {'' if t is None else f'{t / ms:.1f}x'} |")
        if "student_spread" in d:
            out.append(
                f"\nStudent per-token time, highest / lowest median over the contexts: {d['student_spread']:.2f}x "
                f"(medians of {d['repeats']} repeats; the lowest and highest repeat in brackets)."
            )
    if "export" in res:
        x = res["export"]
        out.append(
            "\nExport of the merged student: SavedModel max abs logit error "
            f"{x['saved_model_max_abs_logit_error']:.2e}, "
            f"ONNX {x['onnx_max_abs_logit_error']:.2e}; greedy tokens equal Keras / SavedModel "
            f"{x['tokens_equal_keras_saved_model']}, Keras / ONNX {x['tokens_equal_keras_onnx']}."
        )
    return "\n".join(out)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as f:
            print(tables(json.load(f)) + "\n")
