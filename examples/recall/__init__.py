"""Synthetic recall tasks: multi-query associative recall (MQAR, Zoology).

    from examples.recall import mqar
    train = mqar.generate(num_examples=1000, sequence_length=64, num_kv_pairs=4, vocabulary_size=128, seed=0)

The benchmark that trains on them is ``python -m benchmarks.bench_quality``.
"""
