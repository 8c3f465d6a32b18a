"""`benchmarks/bench_moe_step.py`: both forms agree and the weights each reads, float32 and int8 experts."""

import re

import pytest

from benchmarks import bench_moe_step as B


@pytest.mark.parametrize("precision, bytes_per_weight", [("float32", 4), ("int8", 1)])
def test_a_tiny_run_reports_the_expert_bytes_each_form_reads(precision, bytes_per_weight, capsys):
    # Width 512, experts of 512: each expert's gate, up and down kernels are 3 * 512 * 512 weights (3 MiB in
    # float32, 0.75 MiB in int8).
    B.main(["--hidden", "512", "--expert-dim", "512", "--experts", "4", "--repeats", "1", "--precision", precision])
    lines = capsys.readouterr().out.splitlines()
    mib = {line.split(":")[0].strip(): float(re.search(r"read: (\d+\.?\d*)", line).group(1)) for line in lines}
    assert set(mib) == {"gathered top-k", "every expert"}
    per_expert = 3 * 512 * 512 * bytes_per_weight / 2**20
    assert mib == {"gathered top-k": 2 * per_expert, "every expert": 4 * per_expert}  # top 2 of 4 at batch 1
