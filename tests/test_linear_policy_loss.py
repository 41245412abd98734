"""linear_policy_loss: the policy head from hidden states to the loss, against the float64 spec and the
composition policy_loss(linear_token_logprobs(...)); chunking, GSPO's two-pass path, layouts, gradients,
on-policy, grad scaling, bad inputs, opcheck, torch.compile, vocab-parallel and the bench cases."""
import os
import sys

import pytest
import torch
from conftest import DEVICE, available_backends

import flashrl_kernels as fk
from flashrl_kernels import LossConfig
from flashrl_kernels.reference.linear_policy_loss import linear_policy_loss_spec

BACKENDS = [b for b in available_backends(DEVICE, op="linear_policy_loss_forward") if b != "reference"]

CONFIGS = {
    "grpo": LossConfig(),
    "dapo_dual": LossConfig(eps_high=0.28, dual_clip=3.0, loss_agg_mode="token-mean"),
    "tis_token_kl_entropy": LossConfig(tis_mode="token_truncate", tis_max=1.5, beta=0.05, entropy_coef=0.01),
    "tis_sequence_seqmean": LossConfig(tis_mode="sequence_mask", tis_min=0.8, tis_max=1.25,
                                       loss_agg_mode="seq-mean-token-mean"),
    "gspo": LossConfig(importance_sampling_level="sequence", eps_low=3e-3, eps_high=4e-3,
                       loss_agg_mode="seq-mean-token-mean"),
    "gspo_kl_entropy": LossConfig(importance_sampling_level="sequence", entropy_coef=0.02, beta=0.01),
    "vapo_nll_token_sum": LossConfig(nll_coef=0.1, loss_agg_mode="token-sum"),
    "dr_grpo": LossConfig(loss_agg_mode="seq-mean-token-sum-norm"),
}


def _problem(b=3, t=7, h=16, v=37, packed=False, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5
    bias_t = torch.randn(v, generator=g) if bias else None
    targets = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[0, :2] = True
    targets[~mask] = -100  # padding ids at masked positions are never read
    old = torch.randn(b, t, generator=g) * 0.3 - 3.0
    p = {"hidden": hidden, "weight": weight, "bias": bias_t, "targets": targets, "mask": mask, "old": old,
         "rollout": old + 0.1 * torch.randn(b, t, generator=g), "ref": old + 0.1 * torch.randn(b, t, generator=g),
         "adv": torch.randn(b, generator=g), "positive": torch.rand(b, generator=g) > 0.5, "cu": None}
    if packed:  # ragged sequences: keep the mask's valid tokens... and a few masked ones inside
        lengths = [t, 3, t - 2][:b]
        keep = torch.zeros(b, t, dtype=torch.bool)
        for i, n in enumerate(lengths):
            keep[i, :n] = True
        for k in ("targets", "mask", "old", "rollout", "ref"):
            p[k] = p[k][keep]
        p["hidden"] = hidden[keep]
        p["cu"] = torch.tensor([0] + lengths).cumsum(0)
    return p


def _leaves(p, dtype):
    h = p["hidden"].to(dtype, copy=True).requires_grad_(True)
    w = p["weight"].to(dtype, copy=True).requires_grad_(True)
    b = None if p["bias"] is None else p["bias"].to(dtype, copy=True).requires_grad_(True)
    return h, w, b


def _spec(p, cfg, temperature=1.0, old_none=False):
    h, w, b = (x.double().requires_grad_(True) if x is not None else None for x in (p["hidden"], p["weight"], p["bias"]))
    loss, metrics, logp, ent = linear_policy_loss_spec(
        h, w, p["targets"], None if old_none else p["old"], p["adv"], bias=b, mask=p["mask"], cu_seqlens=p["cu"],
        rollout_logp=p["rollout"], ref_logp=p["ref"], temperature=temperature, config=cfg,
        normalizer=7.0 if cfg.loss_agg_mode == "seq-mean-token-sum-norm" else None, positive=p["positive"],
    )
    loss.backward()
    return loss, metrics, logp, ent, h.grad, w.grad, None if b is None else b.grad


def _fused(p, cfg, dtype=torch.float32, temperature=1.0, old_none=False, **kw):
    h, w, b = _leaves(p, dtype)
    out, logp, ent = fk.linear_policy_loss(
        h, w, p["targets"], None if old_none else p["old"], p["adv"], bias=b, mask=p["mask"], cu_seqlens=p["cu"],
        rollout_logp=p["rollout"], ref_logp=p["ref"], temperature=temperature, config=cfg,
        normalizer=7.0 if cfg.loss_agg_mode == "seq-mean-token-sum-norm" else None, positive=p["positive"],
        return_logprobs=True, **kw,
    )
    out.loss.backward()
    return out, logp, ent, h.grad, w.grad, None if b is None else b.grad


def _close(a, b, tol, what):
    a, b = a.double(), b.double()
    scale = max(float(b.abs().max()), 1e-2)
    err = float((a - b).abs().max()) / scale
    assert err <= tol, f"{what}: max error {err:.2e} (relative to {scale:.2e}) > {tol}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("chunk", ["1000", "3"])  # one chunk; chunks of 3 rows (GSPO: 7-token sequences take 2 passes)
@pytest.mark.parametrize("packed", [False, True])
def test_matches_spec(backend, name, chunk, packed, monkeypatch):
    monkeypatch.setenv("FLASHRL_POLICY_CHUNK_ROWS", chunk)
    cfg = CONFIGS[name]
    p = _problem(packed=packed)
    temperature = 0.7 if name == "gspo" else 1.0
    ref = _spec(p, cfg, temperature)
    with fk.use_backend(backend):
        out, logp, ent, gh, gw, gb = _fused(p, cfg, temperature=temperature)
    _close(out.loss, ref[0], 3e-5, "loss")
    for k in fk.LINEAR_METRIC_NAMES[:-1]:
        assert abs(float(out.metrics[k]) - float(ref[1][k])) <= 1e-4 * max(1.0, abs(float(ref[1][k]))), k
    valid = p["mask"]
    torch.testing.assert_close(logp[valid].double(), ref[2].detach()[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[valid].double(), ref[3].detach()[valid], atol=1e-5, rtol=0)
    assert float(out.metrics["logp_mean"]) == pytest.approx(float(ref[2].detach()[valid].mean()), abs=1e-5)
    assert bool((logp[~valid] == 0).all())
    _close(gh, ref[4], 1e-5, "grad_hidden")
    _close(gw, ref[5], 1e-5, "grad_weight")
    _close(gb, ref[6], 1e-5, "grad_bias")
    assert float(ref[5].abs().max()) > 0  # the check is not vacuous


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["grpo", "gspo", "tis_token_kl_entropy"])
def test_on_policy_without_old_logp(backend, name, monkeypatch):
    monkeypatch.setenv("FLASHRL_POLICY_CHUNK_ROWS", "4")
    p = _problem(seed=3)
    ref = _spec(p, CONFIGS[name], old_none=True)
    with fk.use_backend(backend):
        out, _, _, gh, gw, _ = _fused(p, CONFIGS[name], old_none=True)
    _close(out.loss, ref[0], 1e-5, "loss")
    assert float(out.metrics["ratio_mean"]) == pytest.approx(1.0, abs=1e-6)
    _close(gh, ref[4], 1e-5, "grad_hidden")
    _close(gw, ref[5], 1e-5, "grad_weight")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp32_acc", [False, True])
def test_bf16_equals_composition(backend, fp32_acc, monkeypatch):
    """bf16 inputs: the fused op against policy_loss(linear_token_logprobs(...)) on the same backend."""
    monkeypatch.setenv("FLASHRL_POLICY_CHUNK_ROWS", "5")  # several chunks: grad_weight accumulates
    cfg = LossConfig(eps_high=0.28, tis_mode="token_truncate", beta=0.02, entropy_coef=0.01)
    p = _problem(b=4, t=9, h=32, v=301, seed=5)
    with fk.use_backend(backend):
        out, logp, ent, gh, gw, gb = _fused(p, cfg, dtype=torch.bfloat16, fp32_grad_accumulation=fp32_acc)
        h, w, b = _leaves(p, torch.bfloat16)
        lp, en = fk.linear_token_logprobs(h, w, p["targets"].clamp(min=0), bias=b, return_entropy=True)
        ref = fk.policy_loss(lp, p["old"], p["adv"], mask=p["mask"], rollout_logp=p["rollout"], ref_logp=p["ref"],
                             entropy=en, config=cfg)
        ref.loss.backward()
    _close(out.loss, ref.loss, 1e-3, "loss")
    torch.testing.assert_close(logp[p["mask"]], lp.detach()[p["mask"]], atol=2e-3, rtol=0)
    torch.testing.assert_close(ent[p["mask"]], en.detach()[p["mask"]], atol=2e-3, rtol=0)
    _close(gh, h.grad, 2e-2, "grad_hidden")
    _close(gw, w.grad, 2e-2, "grad_weight")
    _close(gb, b.grad, 2e-2, "grad_bias")
    assert gh.dtype == gw.dtype == gb.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
def test_widened_bf16_gemm_path(backend, monkeypatch):
    """CPUs without fast bf16 GEMMs widen the chunk GEMMs to fp32: same results as the spec."""
    monkeypatch.setenv("FLASHRL_CPU_GEMM_DTYPE", "fp32")
    monkeypatch.setenv("FLASHRL_POLICY_CHUNK_ROWS", "4")
    p = _problem(seed=11)
    for k in ("hidden", "weight", "bias"):  # bf16 values: the spec sees the kernel's inputs exactly
        p[k] = p[k].bfloat16().float()
    cfg = CONFIGS["tis_token_kl_entropy"]
    ref = _spec(p, cfg)
    with fk.use_backend(backend):
        for acc in (False, True):
            out, _, _, gh, gw, gb = _fused(p, cfg, dtype=torch.bfloat16, fp32_grad_accumulation=acc)
            _close(out.loss, ref[0], 2e-2, "loss")
            _close(gh, ref[4], 3e-2, "grad_hidden")
            _close(gw, ref[5], 3e-2, "grad_weight")
            _close(gb, ref[6], 3e-2, "grad_bias")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "native"])  # native keeps bf16 logits
def test_fp32_logits_straight_from_the_gemm(backend, monkeypatch):
    """The GPU form (fp32 chunk logits as the GEMM's own output, no chunk buffer), forced on the CPU."""
    from flashrl_kernels.torch_impl import linear_policy_loss as impl

    monkeypatch.setattr(impl, "_DIRECT_F32_DEVICES", ("cuda", "cpu"))
    monkeypatch.setenv("FLASHRL_CPU_GEMM_DTYPE", "input")
    monkeypatch.setenv("FLASHRL_POLICY_CHUNK_ROWS", "5")
    cfg = CONFIGS["tis_token_kl_entropy"]
    p = _problem(b=4, t=9, h=32, v=301, seed=13)
    with fk.use_backend(backend):
        out, logp, _, gh, gw, gb = _fused(p, cfg, dtype=torch.bfloat16)
        monkeypatch.setattr(impl, "_DIRECT_F32_DEVICES", ("cuda",))
        ref, ref_logp, _, rgh, rgw, rgb = _fused(p, cfg, dtype=torch.bfloat16)
    _close(out.loss, ref.loss, 1e-5, "loss")
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    for a, r, what in ((gh, rgh, "grad_hidden"), (gw, rgw, "grad_weight"), (gb, rgb, "grad_bias")):
        _close(a, r, 1e-2, what)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_not_a_block_multiple(backend, monkeypatch):
    monkeypatch.setenv("FLASHRL_POLICY_CHUNK_ROWS", "6")
    p = _problem(b=2, t=8, h=24, v=4099, seed=2)  # one gradient block of 4096 vocab rows plus 3
    cfg = CONFIGS["tis_token_kl_entropy"]
    ref = _spec(p, cfg)
    with fk.use_backend(backend):
        out, _, _, gh, gw, gb = _fused(p, cfg)
    _close(out.loss, ref[0], 1e-5, "loss")
    _close(gh, ref[4], 1e-5, "grad_hidden")
    _close(gw, ref[5], 1e-5, "grad_weight")
    _close(gb, ref[6], 1e-5, "grad_bias")


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_flags_no_grad_and_frozen_weight(backend):
    p = _problem(seed=4)
    cfg = CONFIGS["grpo"]
    ref = _spec(p, cfg)
    with fk.use_backend(backend):
        with torch.no_grad():
            h, w, b = _leaves(p, torch.float32)
            out = fk.linear_policy_loss(h, w, p["targets"], p["old"], p["adv"], bias=b, mask=p["mask"], config=cfg)
        assert not out.loss.requires_grad
        _close(out.loss, ref[0], 1e-5, "no_grad loss")
        h, _, _ = _leaves(p, torch.float32)
        w = p["weight"].clone()  # frozen lm_head: only grad_hidden
        out = fk.linear_policy_loss(h, w, p["targets"], p["old"], p["adv"], bias=p["bias"], mask=p["mask"],
                                    config=cfg)
        out.loss.backward()
    _close(h.grad, ref[4], 1e-5, "grad_hidden")
    assert w.grad is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_loss_scaling_and_second_backward(backend):
    p = _problem(seed=6)
    cfg = CONFIGS["grpo"]
    with fk.use_backend(backend):
        h, w, b = _leaves(p, torch.float32)
        out = fk.linear_policy_loss(h, w, p["targets"], p["old"], p["adv"], bias=b, mask=p["mask"], config=cfg)
        out.loss.backward(retain_graph=True)
        g1 = w.grad.clone()
        out.loss.backward(retain_graph=True)  # grad_loss = 1 twice: nothing was scaled in place
        torch.testing.assert_close(w.grad, 2 * g1)
        h2, w2, b2 = _leaves(p, torch.float32)
        out2 = fk.linear_policy_loss(h2, w2, p["targets"], p["old"], p["adv"], bias=b2, mask=p["mask"], config=cfg)
        (2.5 * out2.loss + h2.sum() * 0).backward(retain_graph=True)
        torch.testing.assert_close(w2.grad, 2.5 * g1, rtol=1e-5, atol=1e-7)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # scaled in place above
            (2.5 * out2.loss).backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_everything_masked(backend):
    p = _problem(seed=8)
    p["mask"] = torch.zeros_like(p["mask"])
    p["targets"] = torch.full_like(p["targets"], -1)
    with fk.use_backend(backend):
        out, logp, _, gh, gw, gb = _fused(p, CONFIGS["tis_token_kl_entropy"])
    assert float(out.loss) == 0.0 and float(out.metrics["num_tokens"]) == 0.0
    assert not gh.any() and not gw.any() and not gb.any() and not logp.any()


def test_bad_inputs():
    p = _problem()
    h, w, _ = _leaves(p, torch.float32)
    args = (h, w, p["targets"], p["old"], p["adv"])
    bad = p["targets"].clone()
    bad[0, 0] = 37  # a kept position
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 37\)"):
        fk.linear_policy_loss(h, w, bad, p["old"], p["adv"], mask=p["mask"])
    with pytest.raises(TypeError, match="weight dtype"):
        fk.linear_policy_loss(h, w.bfloat16(), p["targets"], p["old"], p["adv"], mask=p["mask"])
    with pytest.raises(ValueError, match="hidden size mismatch"):
        fk.linear_policy_loss(h[..., :5], w, p["targets"], p["old"], p["adv"], mask=p["mask"])
    with pytest.raises(ValueError, match="targets must have shape"):
        fk.linear_policy_loss(h, w, p["targets"][:, :3], p["old"], p["adv"], mask=p["mask"])
    with pytest.raises(ValueError, match="old_logp must have the shape of targets"):
        fk.linear_policy_loss(h, w, p["targets"], p["old"][:, :3], p["adv"], mask=p["mask"])
    with pytest.raises(ValueError, match="needs rollout_logp"):
        fk.linear_policy_loss(*args, mask=p["mask"], config=LossConfig(tis_mode="token_truncate"))
    with pytest.raises(ValueError, match="needs positive"):
        fk.linear_policy_loss(*args, mask=p["mask"], config=LossConfig(nll_coef=0.1))
    with pytest.raises(TypeError, match="LossConfig"):
        fk.linear_policy_loss(*args, mask=p["mask"], config={"eps_low": 0.2})
    nan_h = h.detach().clone()
    nan_h[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        fk.linear_policy_loss(nan_h, w, p["targets"], p["old"], p["adv"], mask=p["mask"])


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
def test_opcheck(backend):
    p = _problem(packed=True, seed=9)
    h, w, b = _leaves(p, torch.float32)
    cfg = CONFIGS["tis_token_kl_entropy"]
    args = (h, w, b, p["targets"].clamp(min=0), p["old"], p["adv"], p["mask"], p["cu"], p["rollout"], p["ref"], None,
            None, cfg.eps_low, cfg.eps_high, 0.0, "token", cfg.tis_mode, cfg.tis_min, cfg.tis_max, "mean",
            "token-mean", cfg.beta, cfg.entropy_coef, 0.0, 0.0, 0, 0.9, True, True, True, False)
    with fk.use_backend(backend):
        torch.library.opcheck(torch.ops.flashrl.linear_policy_loss.default, args,
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
def test_torch_compile(backend):
    p = _problem(seed=10)
    cfg = CONFIGS["dapo_dual"]

    def step(h, w, b):
        out = fk.linear_policy_loss(h, w, p["targets"], p["old"], p["adv"], bias=b, mask=p["mask"], config=cfg)
        return out.loss * 1.5

    with fk.use_backend(backend):
        leaves = _leaves(p, torch.float32)
        step(*leaves).backward()
        ref = [x.grad.clone() for x in leaves]
        leaves2 = _leaves(p, torch.float32)
        loss = torch.compile(step, fullgraph=False)(*leaves2)
        loss.backward()
    for a, r in zip(leaves2, ref):
        torch.testing.assert_close(a.grad, r, rtol=1e-5, atol=1e-6)


# ---- vocab-parallel: 2 processes, gloo ----

def _vp_worker(rank, world, port, backend, result_dir):
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(__file__))
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["FLASHRL_POLICY_CHUNK_ROWS"] = "4"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for name in ("tis_token_kl_entropy", "gspo_kl_entropy"):
            cfg = CONFIGS[name]
            p = _problem(b=3, t=7, h=16, v=45, seed=12)  # same full inputs on every rank
            split = 20
            lo, hi = (0, split) if rank == 0 else (split, 45)
            ref = _spec(p, cfg, temperature=0.8)
            h = p["hidden"].clone().requires_grad_(True)
            w = p["weight"][lo:hi].clone().requires_grad_(True)
            b = p["bias"][lo:hi].clone().requires_grad_(True)
            with fk.use_backend(backend):
                out = fk.linear_policy_loss(h, w, p["targets"], p["old"], p["adv"], bias=b, mask=p["mask"],
                                            rollout_logp=p["rollout"], ref_logp=p["ref"], temperature=0.8, config=cfg,
                                            positive=p["positive"], process_group=dist.group.WORLD)
            out.loss.backward()
            _close(out.loss, ref[0], 1e-5, "loss")
            _close(out.metrics["entropy_mean"], ref[1]["entropy_mean"], 1e-5, "entropy_mean")
            _close(h.grad, ref[4], 1e-5, "grad_hidden")
            _close(w.grad, ref[5][lo:hi], 1e-5, "grad_weight slice")
            _close(b.grad, ref[6][lo:hi], 1e-5, "grad_bias slice")
        with open(os.path.join(result_dir, f"ok{rank}"), "w") as f:
            f.write("ok")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see test_linear_logprobs_ops: gloo teardown at interpreter exit can abort after success


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
def test_vocab_parallel_two_processes(backend, tmp_path):
    import torch.multiprocessing as mp
    from test_linear_logprobs_ops import _free_port

    mp.spawn(_vp_worker, args=(2, _free_port(), backend, str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


# ---- benchmark cases ----

def test_bench_cases_run_at_tiny_size():
    from flashrl_kernels.benchmarks import linear_policy_loss as mod

    cases = mod.cases(quick=True, device=torch.device("cpu"))
    impls = {c.impl for c in cases}
    assert "unfused eager" in impls and any(c.baseline for c in cases)
    assert {"flashrl fused[torch]", "flashrl composed[torch]"} <= impls
    grads = {}
    for impl, fn in [("unfused", mod.unfused_loss), ("composed", mod._composed("torch")), ("fused", mod._fused("torch"))]:
        grads[impl] = mod._maker(fn, 2, 6, 16, 45, torch.float32, torch.device("cpu"))()()
    torch.testing.assert_close(grads["fused"], grads["unfused"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grads["composed"], grads["unfused"], atol=1e-5, rtol=1e-4)
