"""Benchmarks of keras_linattn against softmax and kernel-attention anchors.

Run ``python -m benchmarks.bench_attention --help`` (or ``make bench``).
"""
