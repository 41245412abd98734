"""Multi-process vLLM engines for tests/test_vllm_multiprocess.py, one scenario per subprocess (so that the
engine mode comes from this process's environment and every engine process is gone afterwards).

    python tests/vllm_mp_scenarios.py {tp2|mp1} CKPT_ROOT OUT_JSON

CKPT_ROOT holds `base` and `perturbed` tiny Qwen2 checkpoints. The scenario writes what it measured to
OUT_JSON; the test asserts on it. Engines run one or two at a time (2-core CI machines).
"""
import gc
import json
import os
import sys
from pathlib import Path


def _shutdown(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _rank_states(llm):
    """Per rank: {name: [sha256, bytes, storage address, dtype]} for every parameter and scale buffer."""
    from _vllm_util import weights_as_bytes  # importable by the workers (PYTHONPATH), unlike a local function

    return llm.apply_model(weights_as_bytes)


def _same_bytes(a, b):
    return a.keys() == b.keys() and all(a[n][:2] == b[n][:2] for n in a)


def _bad_sets(sd):
    good = list(sd.items())
    up = "model.layers.1.mlp.up_proj.weight"
    nan = sd[up].clone()
    nan[3, 5] = float("nan")
    big64 = sd[up].double()
    big64[0, 0] = 1e300  # finite in fp64 (the driver's check), inf in fp32 (each rank's range check)
    return {  # the bad tensor last: a sync that wrote before validating would change the engine
        "wrong shape": good + [(up, sd[up][:, :-1])],
        "unknown name": good + [("model.layers.7.mlp.up_proj.weight", sd[up])],
        "nan": [(n, t) for n, t in good if n != up] + [(up, nan)],
        "fp64 beyond fp32": [(n, t) for n, t in good if n != up] + [(up, big64)],
    }


def _unchanged(before, after):
    """Per rank, the names whose stored bytes a sync left as they were."""
    return [sorted(n for n in b if b[n][0] == a[n][0]) for b, a in zip(before, after)]


def tp2(root: Path, vllm, kw):
    """TP = 2 engines: logprobs vs the float32 model, a sync that changes every stored tensor of both ranks, bad
    syncs, and a sync back to the base weights that leaves both ranks byte for byte as the fresh engine was.

    Two engines, not four: the float32 transformers model is the logprob reference (no bf16 TP = 2 engine), and the
    engine is its own fresh-engine reference (the sync back to the checkpoint it was loaded from); each TP = 2 engine
    costs ~40 s to start on a 2-core machine."""
    from _vllm_util import float_logprob_diff, generate, state_dict_of

    from flashrl_kernels.integrations.vllm import sync_weights

    kw = {**kw, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    out = {}
    for quant in ("flashrl_fp8", "flashrl_int8"):
        llm = vllm.LLM(str(root / "base"), quantization=quant, **kw)
        diff = float_logprob_diff(llm, root / "base")
        out[quant] = {"mean": float(diff.mean()), "max": float(diff.max()),
                      "dtypes": [sorted({v[3] for n, v in st.items() if n.endswith("proj.weight")})
                                 for st in _rank_states(llm)]}
        if quant == "flashrl_fp8":
            _shutdown(llm)
    # llm: the TP = 2 int8 engine as loaded from `base`; a perturbed sync, the bad ones, then `base` again
    ids0 = generate(llm)
    fresh = _rank_states(llm)
    sd = state_dict_of(root / "perturbed")
    res = sync_weights(llm, sd)
    after = _rank_states(llm)
    synced = generate(llm)
    out["sync"] = {
        "n_tensors": res.n_tensors, "n_sent": len(sd), "bytes": res.bytes_written,
        "bytes_stored": sum(v[1] for st in after for v in st.values()),
        "ptrs_kept": [{n: v[2] for n, v in b.items()} == {n: v[2] for n, v in a.items()}
                      for b, a in zip(fresh, after)],
        "changed": synced != ids0, "unchanged_tensors": _unchanged(fresh, after),
        "codes_total": res.codes_total, "codes_changed": res.codes_changed, "max_scale_change": res.max_scale_change,
        "codes_stored": sum(v[1] for st in after for v in st.values() if v[3] == "torch.int8"),
    }
    out["bad"] = {}
    for case, tensors in _bad_sets(sd).items():
        try:
            sync_weights(llm, tensors)
            out["bad"][case] = {"raised": None}
        except (ValueError, TypeError) as e:
            out["bad"][case] = {"raised": type(e).__name__, "message": str(e)}
        now = _rank_states(llm)
        out["bad"][case]["unchanged"] = all(_same_bytes(a, b) for a, b in zip(after, now)) and generate(llm) == synced
    sync_weights(llm, state_dict_of(root / "base"))
    out["sync"]["equals_fresh"] = generate(llm) == ids0
    out["sync"]["state_equals_fresh"] = [_same_bytes(a, b) for a, b in zip(fresh, _rank_states(llm))]
    _shutdown(llm)
    return out


def mp1(root: Path, vllm, kw):
    """vLLM's default multi-process engine at TP = 1, without insecure serialization: a perturbed sync changes the
    rollout, a bad one changes nothing, a sync back to the base weights gives the fresh engine's rollout again."""
    from _vllm_util import generate, state_dict_of

    from flashrl_kernels.integrations.vllm import sync_weights

    assert os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "0") == "0"
    llm = vllm.LLM(str(root / "base"), quantization="flashrl_int8", **kw)
    ids0 = generate(llm)
    sd = state_dict_of(root / "perturbed")
    res = sync_weights(llm, sd)
    synced = generate(llm)
    try:
        sync_weights(llm, _bad_sets(sd)["nan"])
        bad = None
    except ValueError as e:
        bad = str(e)
    out = {"n_tensors": res.n_tensors, "bytes": res.bytes_written, "changed": synced != ids0, "bad": bad,
           "changed_share": res.changed_share, "max_scale_change": res.max_scale_change,
           "unchanged_after_bad": generate(llm) == synced}
    sync_weights(llm, state_dict_of(root / "base"))
    out["equals_fresh"] = generate(llm) == ids0
    _shutdown(llm)
    return out


def main():
    scenario, root, dst = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    sys.path.insert(0, str(Path(__file__).parent))
    import vllm
    from _vllm_util import engine_kwargs

    result = {"tp2": tp2, "mp1": mp1}[scenario](root, vllm, engine_kwargs())
    Path(dst).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
