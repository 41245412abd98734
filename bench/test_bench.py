"""pytest-benchmark front end to the same cases `flashrl-kernels bench` runs.

    pytest bench/ --benchmark-only                      # quick sizes
    FLASHRL_BENCH_FULL=1 pytest bench/ --benchmark-only # the default (full) sizes
"""
import os

import pytest
import torch

from flashrl_kernels.benchmarks import harness

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
QUICK = os.environ.get("FLASHRL_BENCH_FULL", "0") in ("0", "")
CASES = [(m, i, c) for m in harness.op_modules() for i, c in enumerate(harness.load_cases(m, QUICK, DEVICE))]


@pytest.mark.parametrize("module,index,case", CASES, ids=[f"{c.op}-{c.mode}-{c.impl}" for _, _, c in CASES])
def test_bench(benchmark, module, index, case):
    fn = case.make()

    def run():
        fn()
        harness.synchronize(DEVICE)

    benchmark.group = f"{case.op} {case.mode} {case.size}"
    benchmark.extra_info.update(impl=case.impl, bytes=case.bytes, baseline=case.baseline)
    benchmark.pedantic(run, rounds=3 if QUICK else 5, warmup_rounds=1)
