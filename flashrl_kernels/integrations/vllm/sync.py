"""sync_weights: validate every trainer tensor, then write them all into the engine in place.

Order of work, so that a failed sync leaves the engine serving the previous
weights untouched:
  1. index the model's loadable names (vLLM names plus the checkpoint names
     its packed modules accept: q_proj/k_proj/v_proj -> qkv_proj, gate_proj/
     up_proj -> gate_up_proj; the second name of a tied embedding is mapped
     to the first) with the exact shape each expects;
  2. check every tensor: a torch.Tensor, a floating dtype, a known name, the
     expected shape, no duplicates (nor a fused name with one of its parts);
     then their values at once (one read of each, one host sync; see
     abs_max_tensors): finite, and within the range of the dtype the load
     converts them to (fp32 for the quantizer, the parameter's dtype for the
     rest: 1e300 in fp64, or 3.4e38 in fp32 sent to a bf16 norm, would load
     as inf);
  3. only then model.load_weights(...), vLLM's own loading path, whose
     parameter loaders (see quant.py) quantize linear weights (and, with
     quantize_lm_head, the LM head table) into their existing int8/fp8 storage
     and copy the rest (norms, biases, model-dtype embeddings);
     an engine without flashrl quantization (bf16) goes through vLLM's
     reload_weights instead, which also redoes its post-load weight processing
     (that path may re-allocate: the in-place guarantee is the flashrl
     methods');
  4. reset the engine's prefix cache (its KV blocks were computed with the old
     weights).
"""
from __future__ import annotations

import asyncio
import difflib
import math
import time
from dataclasses import dataclass

import torch

from . import SyncResult

_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True)
class _Target:
    shape: tuple[int, ...]  # shape the trainer tensor must have
    bytes: int  # bytes written into engine storage when it is loaded
    dtype: torch.dtype  # what the load converts the tensor's values to (they must be finite in it)
    alias_of: str | None = None  # a tied embedding's second name: the name vLLM loads it under
    rows: tuple[str, int, int] | None = None  # a fused linear's name or part: (parameter, first row, end row)


_QUANT_METHODS = ("FlashRLLinearMethod", "FlashRLQuantizedEmbeddingMethod")


def _is_quantized(module) -> bool:
    return type(getattr(module, "quant_method", None)).__name__ in _QUANT_METHODS


def _stored_dtype(param: torch.Tensor, quantized: bool) -> torch.dtype:
    """The dtype a tensor loaded into `param` is converted to: fp32 for a flashrl-quantized weight (the quantizer's
    input: bf16 / fp16 / fp32 as sent, fp64 converted), else the parameter's own float dtype (another method's
    int / fp8 storage is its loader's business: checked as fp32)."""
    return param.dtype if not quantized and param.dtype in _FLOATS else torch.float32


def _checkpoint_out_sizes(module) -> list[int]:
    """The full (unsharded) output rows of each part of a linear layer, as a checkpoint stores them."""
    if all(hasattr(module, a) for a in ("total_num_heads", "total_num_kv_heads", "head_size")):  # QKV
        v_head = getattr(module, "v_head_size", module.head_size)
        return [module.total_num_heads * module.head_size, module.total_num_kv_heads * module.head_size,
                module.total_num_kv_heads * v_head]
    return list(getattr(module, "output_sizes", None) or [module.output_size])


def loadable_index(model: torch.nn.Module) -> dict[str, _Target]:
    """Every name model.load_weights accepts, with the full (checkpoint) shape it expects.

    At tensor-parallel size > 1 the trainer still sends full tensors: every rank
    validates them against the full shapes, and its loaders take their shard.
    `bytes` is what this rank writes.
    """
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from .quant import is_packed

    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    index: dict[str, _Target] = {}
    canonical: dict[int, str] = {}  # id(embedding parameter) -> first name, in vLLM's traversal order
    modules = dict(model.named_modules(remove_duplicate=False))
    for pname, param in model.named_parameters(remove_duplicate=False):
        mod_name, _, attr = pname.rpartition(".")
        module = modules.get(mod_name)
        shape = tuple(param.shape)
        elt = param.element_size()
        if isinstance(module, LinearBase) and attr in ("weight", "bias"):
            quant = _is_quantized(module) and attr == "weight"
            # this rank's bytes per stored row: its input columns (+ the fp32 row scale when quantized, + the
            # int32 row code sum when packed) (from the layer's partition sizes: vLLM's CPU repacking may change
            # a bf16 weight's own shape)
            local_in = getattr(module, "input_size_per_partition", module.input_size)
            extra = (4 + (4 if is_packed(module) else 0)) if quant else 0
            row_bytes = (local_in * elt + extra) if attr == "weight" else elt
            out_sizes = _checkpoint_out_sizes(module)
            local_sizes = list(getattr(module, "output_partition_sizes", None) or [module.output_size])
            if len(local_sizes) != len(out_sizes):  # a layer type whose parts vLLM does not list per rank
                local_sizes = [sum(local_sizes) * n // max(sum(out_sizes), 1) for n in out_sizes]
            # the fused name itself (e.g. a checkpoint that stores qkv_proj fused)
            full = (sum(out_sizes), module.input_size) if attr == "weight" else (sum(out_sizes),)
            dtype = _stored_dtype(param, quant)
            index[pname] = _Target(full, sum(local_sizes) * row_bytes, dtype, rows=(pname, 0, full[0]))
            leaf = mod_name.rpartition(".")[2]
            parts = packed.get(leaf)
            if parts and len(parts) == len(out_sizes):
                base = mod_name[: len(mod_name) - len(leaf)]
                start = 0
                for part, rows, local in zip(parts, out_sizes, local_sizes):
                    shp = (rows, module.input_size) if attr == "weight" else (rows,)
                    index[f"{base}{part}.{attr}"] = _Target(shp, local * row_bytes, dtype,
                                                            rows=(pname, start, start + rows))
                    start += rows
        elif isinstance(module, VocabParallelEmbedding) and attr == "weight":
            # the trainer sends the unpadded, unsharded vocabulary; the loader writes every row of this
            # rank's padded shard (padding rows as zeros), plus an fp32 scale per row when quantized
            quant = _is_quantized(module)
            row_bytes = shape[1] * elt + ((4 + (4 if is_packed(module) else 0)) if quant else 0)
            first = canonical.setdefault(id(param), pname)
            # a tied alias (lm_head.weight of a model that ties it to embed_tokens.weight): vLLM's
            # loader skips that name, so it writes nothing (see prepare)
            index[pname] = _Target((module.org_vocab_size, shape[1]), 0 if first != pname else shape[0] * row_bytes,
                                   _stored_dtype(param, quant), alias_of=None if first == pname else first)
        else:
            index[pname] = _Target(shape, param.numel() * elt, _stored_dtype(param, False))
    return index


def prepare(model: torch.nn.Module, tensors: list[tuple[str, torch.Tensor]], absmax: list[float] | None = None):
    """Validate every tensor (raise ValueError/TypeError naming the first bad one), then return
    (bytes a load writes, the (name, tensor) list to hand to model.load_weights).

    absmax: the tensors' finite_abs_max, when the caller already read them (the two-phase driver); else
    read here.

    A tied embedding's second name (lm_head.weight when the model ties it to
    model.embed_tokens.weight) is accepted: vLLM's loader would skip that name,
    so it is loaded under the first name, unless the first name is sent too
    (then it is dropped, as vLLM drops it).
    """
    index = loadable_index(model)
    seen: set[str] = set()
    written: dict[str, list[tuple[int, int, str]]] = {}  # fused parameter -> (first row, end row, name) sent
    _check_pairs(tensors)
    for name, t in tensors:
        target = index.get(name)
        if target is None:
            # a missing or extra prefix (`model.`, a wrapper's `module.`), else the most similar full names
            close = sorted(k for k in index if k.endswith("." + name) or name.endswith("." + k))[:3] \
                or difflib.get_close_matches(name, list(index), n=3)
            raise ValueError(f"unknown weight name {name!r}: the engine's model has no such weight"
                             + (f" (closest known names: {close})" if close else ""))
        if tuple(t.shape) != target.shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, the engine expects {target.shape}")
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        seen.add(name)
        if target.rows is not None:  # a fused name and one of its parts: both would write the same rows
            param, lo, hi = target.rows
            for a, b, other in written.get(param, ()):
                if lo < b and a < hi:
                    raise ValueError(f"tensors {other!r} and {name!r} both write rows of {param!r}: send the fused "
                                     "tensor or its parts, not both")
            written.setdefault(param, []).append((lo, hi, name))
    if absmax is None:
        absmax = finite_abs_max(tensors)
    for (name, _), amax in zip(tensors, absmax):
        dtype = index[name].dtype
        if amax > torch.finfo(dtype).max:
            raise ValueError(f"tensor {name!r} holds a value of magnitude {amax:.4g}, beyond the largest finite "
                             f"{str(dtype).removeprefix('torch.')} ({torch.finfo(dtype).max:.4g}) the engine "
                             "converts it to: it would load as inf")
    load: list[tuple[str, torch.Tensor]] = []
    for name, t in tensors:
        alias_of = index[name].alias_of
        if alias_of is not None:
            if alias_of in seen:
                continue
            name = alias_of
        load.append((name, t))
    return sum(index[name].bytes for name, _ in load), load


def validate(model: torch.nn.Module, tensors: list[tuple[str, torch.Tensor]]) -> int:
    """Raise ValueError/TypeError naming the first bad tensor; return the bytes a load would write."""
    return prepare(model, tensors)[0]


def abs_max_tensors(tensors: list[torch.Tensor]) -> list[float]:
    """max |x| of every tensor (NaN when it holds a NaN, 0 when empty); one host sync per device.

    torch.aminmax reads a tensor once in its own dtype with no temporary and propagates NaN (see
    _checks.nonfinite_tensors); its two values in fp64 give max |x| exactly, to compare with any dtype's range.
    """
    out = [0.0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        ext = torch.stack([torch.stack(torch.aminmax(tensors[i].detach())).to(torch.float64) for i in idx])
        for i, amax in zip(idx, ext.abs().amax(dim=1).cpu().tolist()):
            out[i] = amax
    return out


def finite_abs_max(tensors: list[tuple[str, torch.Tensor]]) -> list[float]:
    """abs_max_tensors of the (name, tensor) pairs; raise ValueError naming the first that holds a NaN or +-inf."""
    absmax = abs_max_tensors([t for _, t in tensors])
    bad = [name for (name, _), amax in zip(tensors, absmax) if not math.isfinite(amax)]
    if bad:
        raise ValueError(f"tensor {bad[0]!r} contains NaN or +-inf ({len(bad)} bad tensor(s): {bad[:5]})")
    return absmax



def _write_quantized(model: torch.nn.Module, load, vllm_config=None) -> tuple[int, int, float]:
    """model.load_weights(load); returns (codes changed, codes written, largest relative row-scale change)."""
    from .quant import collect_sync_stats

    with torch.no_grad(), collect_sync_stats() as stats:
        if vllm_config is not None:
            from vllm.config import set_current_vllm_config

            with set_current_vllm_config(vllm_config):
                model.load_weights(iter(load))
        else:
            model.load_weights(iter(load))
    if any(t.is_cuda for _, t in load) or next(model.parameters()).is_cuda:
        torch.cuda.synchronize()
    return stats.codes_changed, stats.codes_total, stats.max_rel_scale_change()


def load_into_model(model: torch.nn.Module, named_tensors, vllm_config=None) -> SyncResult:
    """Validate all, then write all into `model` (a vLLM model module, e.g. inside a worker)."""
    t0 = time.perf_counter()
    tensors = list(named_tensors.items()) if isinstance(named_tensors, dict) else list(named_tensors)
    nbytes, load = prepare(model, tensors)
    stats = _write_quantized(model, load, vllm_config)
    return SyncResult(nbytes, time.perf_counter() - t0, len(tensors), *stats)


def write_prepared(worker, load: list[tuple[str, torch.Tensor]]) -> tuple[int, int, float]:
    """Write a list `prepare` accepted into a worker's model (every rank writes its own shard); returns the
    quantized-code statistics of _write_quantized (zeros for a bf16 engine)."""
    model = worker.get_model()
    if any(_is_quantized(m) for m in model.modules()):
        return _write_quantized(model, load, worker.vllm_config)
    # A plain (bf16) engine: vLLM post-processes unquantized weights after loading (on CPU it repacks
    # the linear layers, and those parameters lose their weight loaders), so model.load_weights cannot
    # write them again: vLLM's own reload path, which redoes that processing.
    worker.reload_weights(weights_iterator=iter(load))
    return 0, 0, 0.0


def _worker_load(worker, tensors):
    t0 = time.perf_counter()
    nbytes, load = prepare(worker.get_model(), tensors)
    stats = write_prepared(worker, load)
    return SyncResult(nbytes, time.perf_counter() - t0, len(tensors), *stats)


def _in_process_executor(llm) -> bool:
    """Whether llm's only worker runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one rank): then
    collective_rpc calls a function with the tensors themselves, no serialization."""
    executor = getattr(llm.llm_engine, "model_executor", None)
    return executor is not None and type(executor).__name__ == "UniProcExecutor"


_ERRORS = {"TypeError": TypeError, "ValueError": ValueError}


def _two_phase(owner, tensors):
    """Stage in shared memory, validate on every rank, and write only if every rank agreed.

    A generator, so that a blocking engine (LLM) and an asyncio one (AsyncLLM) run the same protocol: it
    yields (method, args) for the engine's collective_rpc, receives each call's per-rank results, and returns
    (bytes written, tensors, codes changed, codes written, largest row-scale change)."""
    from .worker import stage_tensors

    # read once here (every rank would read the same values); each rank checks the ranges against its own model
    absmax = finite_abs_max(tensors)
    # the staging file lives with the engine object (reused by its next sync, removed with it)
    handle, owner._flashrl_staging = stage_tensors(tensors, getattr(owner, "_flashrl_staging", None))
    handle["absmax"] = absmax
    verdicts = yield "flashrl_sync_stage", (handle,)
    refused = [v for v in verdicts if v]
    if refused:
        yield "flashrl_sync_abort", ()
        kind, message = refused[0]
        raise _ERRORS.get(kind, ValueError)(message)
    results = yield "flashrl_sync_commit", ()  # per rank: [bytes, tensors, changed, total, max scale]
    return (sum(int(r[0]) for r in results), int(results[0][1]), sum(int(r[2]) for r in results),
            sum(int(r[3]) for r in results), max(float(r[4]) for r in results))


_NO_WORKER_METHODS = (
    "sync_weights: the engine's workers lack the flashrl sync methods, which the flashrl_quant vLLM plugin adds in "
    "every worker process: is flashrl_kernels installed in the workers' environment, and does VLLM_PLUGINS (if set) "
    "include flashrl_quant?")


def _two_phase_sync(llm, tensors) -> tuple[int, int, int, int, float]:
    protocol, reply = _two_phase(llm, tensors), None
    try:
        while True:
            method, args = protocol.send(reply)
            try:
                reply = llm.collective_rpc(method, args=args)
            except NotImplementedError as e:
                raise RuntimeError(_NO_WORKER_METHODS) from e
    except StopIteration as done:
        return done.value


async def sync_weights_async(engine, named_tensors) -> SyncResult:
    """sync_weights for vLLM's AsyncLLM (the asyncio engine: its core in its own process, any tensor-parallel
    size): the same validation on every rank and two-phase commit, awaited on the engine's event loop; the
    engine keeps serving (or stays paused) meanwhile. Pause it first (`await engine.pause_generation(...)`)
    for a consistent switch of the weights in-flight requests see."""
    t0 = time.perf_counter()
    tensors = list(named_tensors.items()) if isinstance(named_tensors, dict) else list(named_tensors)
    _check_pairs(tensors)
    # one sync at a time per engine: two in flight would share its staging file (the second staging while the
    # workers still read the first's tensors)
    lock = getattr(engine, "_flashrl_sync_lock", None)
    if lock is None:
        lock = engine._flashrl_sync_lock = asyncio.Lock()
    async with lock:
        protocol, reply = _two_phase(engine, tensors), None
        try:
            while True:
                method, args = protocol.send(reply)
                try:
                    reply = await engine.collective_rpc(method, args=args)
                except NotImplementedError as e:
                    raise RuntimeError(_NO_WORKER_METHODS) from e
        except StopIteration as done:
            nbytes, n, changed, total, scale = done.value
        await engine.reset_prefix_cache()
    return SyncResult(nbytes, time.perf_counter() - t0, n, changed, total, scale)


def _check_pairs(tensors) -> None:
    """The checks that need no model (before anything is staged or sent)."""
    for i, item in enumerate(tensors):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"named_tensors[{i}] must be a (name, tensor) pair, got {type(item).__name__}")
        name, t = item
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {name!r} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"tensor {name!r} must be floating point (bf16/fp16/fp32/fp64), got {t.dtype}")


def sync_weights(llm, named_tensors) -> SyncResult:
    """Validate every tensor on every rank, then quantize-and-write them all into `llm`'s weights, in place.

    llm: a vllm.LLM, in-process or multi-process, any tensor-parallel size.
    named_tensors: a dict or an iterable of (name, tensor) with checkpoint
    (Hugging Face) names and full (unsharded) shapes, e.g.
    model.state_dict().items(); bf16/fp16/fp32 tensors, on the CPU or the
    engine's device. A subset of the weights is fine (only those are written).
    Raises ValueError / TypeError naming the tensor (nothing written on any
    rank) on an unknown name, a wrong shape, a non-float dtype, a duplicate
    (or a fused name, e.g. qkv_proj, sent with one of its parts),
    NaN/inf anywhere, or a value beyond the range of the dtype it is stored in
    or quantized from (fp32 for quantized weights, the model dtype for the rest).

    The in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, one rank: the
    colocated RL setup) calls straight into its worker with the tensors
    themselves. Other engines get the tensors through one shared-memory file
    and a two-phase commit (see worker.py); bytes_written sums all ranks.

    The result also says how far the sync moved the quantized weights: codes_changed / codes_total (and
    changed_share) over every int8 / fp8 code written on every rank, and max_scale_change, the largest
    relative change of a row scale. Counting is done inside the quantizing write (see quant.SyncStats).
    """
    t0 = time.perf_counter()
    tensors = list(named_tensors.items()) if isinstance(named_tensors, dict) else list(named_tensors)
    _check_pairs(tensors)
    if _in_process_executor(llm):
        r = llm.collective_rpc(_worker_load, args=(tensors,))[0]
        nbytes, n, changed, total, scale = r.bytes_written, r.n_tensors, r.codes_changed, r.codes_total, \
            r.max_scale_change
    else:
        nbytes, n, changed, total, scale = _two_phase_sync(llm, tensors)
    llm.reset_prefix_cache()
    return SyncResult(nbytes, time.perf_counter() - t0, n, changed, total, scale)
