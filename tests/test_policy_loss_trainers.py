"""One test per row of the trainer mapping table in docs/policy_loss.md.

Each test writes, independently and in plain torch, the loss a trainer computes as its
documentation describes it (our own code, not the trainer's), and checks that policy_loss with
the mapped LossConfig gives the same loss and the same gradient.
"""
import pytest
import torch

import flashrl_kernels as fk


@pytest.fixture(autouse=True)
def _eager_torch(monkeypatch):
    monkeypatch.setenv("FLASHRL_TORCH_COMPILE", "0")


B, T = 5, 12


@pytest.fixture
def batch():
    lengths = torch.randint(3, T + 1, (B,))
    lengths[0] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = torch.randn(B, T) * 0.5 - 1.2
    old = logp + torch.randn(B, T) * 0.3   # off-policy enough that clipping happens
    roll = old + torch.randn(B, T) * 0.3
    ref = logp + torch.randn(B, T) * 0.2
    ent = torch.rand(B, T) * 2
    adv = torch.randn(B)
    return {"logp": logp, "old": old, "roll": roll, "ref": ref, "ent": ent, "adv": adv, "mask": mask}


def _ours(b, cfg, *, normalizer=None, roll=False, ref=False, ent=False):
    lp = b["logp"].clone().requires_grad_(True)
    out = fk.policy_loss(lp, b["old"], b["adv"], mask=b["mask"], rollout_logp=b["roll"] if roll else None,
                         ref_logp=b["ref"] if ref else None, entropy=b["ent"] if ent else None, config=cfg,
                         normalizer=normalizer)
    (g,) = torch.autograd.grad(out.loss, [lp])
    return out.loss, g


def _theirs(b, fn):
    lp = b["logp"].clone().requires_grad_(True)
    loss = fn(lp)
    (g,) = torch.autograd.grad(loss, [lp])
    return loss, g


def _same(ours, theirs, mask):
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours[1] * mask, theirs[1] * mask, atol=1e-7, rtol=1e-5)


# ---------------- TRL GRPOTrainer ----------------

def _trl_per_token(lp, b, *, eps=0.2, eps_high=None, delta=None, level="token", beta=0.0, tis=None, cap=2.0):
    m = b["mask"].float()
    eps_high = eps if eps_high is None else eps_high
    log_ratio = lp - b["old"]
    if level == "sequence":
        log_w = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
    else:
        log_w = log_ratio
    c1 = torch.exp(log_w)
    c2 = torch.clamp(c1, 1 - eps, 1 + eps_high)
    if delta is not None:
        c1 = torch.clamp(c1, max=delta)
    a = b["adv"][:, None]
    loss = -torch.min(c1 * a, c2 * a)
    if tis is not None:
        diff = (b["old"] - b["roll"]) * m
        if tis.startswith("sequence"):
            diff = diff.sum(-1, keepdim=True)
        ratio = torch.exp(diff)
        ratio = ratio.clamp(max=cap) if tis.endswith("truncate") else ratio.masked_fill(ratio > cap, 0.0)
        loss = loss * ratio
    if beta:
        d = b["ref"] - lp
        loss = loss + beta * (torch.exp(d) - d - 1)
    return loss, m


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_loss_type_grpo(batch, level):
    def theirs(lp):
        ptl, m = _trl_per_token(lp, batch, eps_high=0.28, level=level, beta=0.04)
        return ((ptl * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()

    cfg = fk.LossConfig(eps_low=0.2, eps_high=0.28, importance_sampling_level=level, beta=0.04,
                        loss_agg_mode="seq-mean-token-mean")
    _same(_ours(batch, cfg, ref=True), _theirs(batch, theirs), batch["mask"])


def test_trl_loss_type_bnpo(batch):
    def theirs(lp):
        ptl, m = _trl_per_token(lp, batch)
        return (ptl * m).sum() / m.sum().clamp(min=1.0)

    _same(_ours(batch, fk.LossConfig(loss_agg_mode="token-mean")), _theirs(batch, theirs), batch["mask"])


def test_trl_loss_type_dr_grpo(batch):
    max_completion_length = 16  # a constant, larger than any row here

    def theirs(lp):
        ptl, m = _trl_per_token(lp, batch)
        return (ptl * m).sum() / (ptl.size(0) * max_completion_length)

    cfg = fk.LossConfig(loss_agg_mode="seq-mean-token-sum-norm", normalizer=float(B * max_completion_length))
    _same(_ours(batch, cfg), _theirs(batch, theirs), batch["mask"])


def test_trl_loss_type_dapo(batch):
    num_items_in_batch, num_processes = torch.tensor(173.0), 4  # global token count of the accumulated batch

    def theirs(lp):
        ptl, m = _trl_per_token(lp, batch, eps_high=0.28)
        return (ptl * m).sum() / (num_items_in_batch / num_processes)

    cfg = fk.LossConfig(eps_high=0.28, loss_agg_mode="token-mean")
    _same(_ours(batch, cfg, normalizer=num_items_in_batch / num_processes), _theirs(batch, theirs), batch["mask"])


def test_trl_delta_is_dual_clip(batch):
    def theirs(lp):
        ptl, m = _trl_per_token(lp, batch, delta=1.5)
        return (ptl * m).sum() / m.sum().clamp(min=1.0)

    _same(_ours(batch, fk.LossConfig(dual_clip=1.5)), _theirs(batch, theirs), batch["mask"])


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_trl_vllm_importance_sampling(batch, mode):
    cap = 1.3

    def theirs(lp):
        ptl, m = _trl_per_token(lp, batch, tis=mode, cap=cap)
        return ((ptl * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()

    cfg = fk.LossConfig(tis_mode=mode, tis_min=0.0, tis_max=cap, tis_sequence_reduce="sum",
                        loss_agg_mode="seq-mean-token-mean")
    _same(_ours(batch, cfg, roll=True), _theirs(batch, theirs), batch["mask"])


# ---------------- verl actor (compute_policy_loss + agg_loss) ----------------

def _verl_agg(x, m, mode, scale_factor=None):
    if mode == "token-mean":
        return (x * m).sum() / m.sum()
    seq_sum = (x * m).sum(-1)
    if mode == "seq-mean-token-sum":
        return seq_sum.mean()
    if mode == "seq-mean-token-mean":
        return (seq_sum / m.sum(-1)).mean()
    if mode == "seq-mean-token-sum-norm":
        return seq_sum.sum() / (m.shape[-1] if scale_factor is None else scale_factor)
    raise ValueError(mode)


def _verl_vanilla(lp, b, clip_low, clip_high, clip_c):
    ratio = torch.exp(torch.clamp(lp - b["old"], -20.0, 20.0))
    a = b["adv"][:, None]
    l1 = -a * ratio
    l2 = -a * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip1 = torch.maximum(l1, l2)
    clip2 = torch.minimum(-a * clip_c, clip1)
    return torch.where(a < 0, clip2, clip1)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_verl_loss_agg_mode(batch, agg):
    ent_coeff, kl_coef = 0.01, 0.05

    def theirs(lp):
        m = batch["mask"].float()
        pg = _verl_agg(_verl_vanilla(lp, batch, 0.2, 0.28, 3.0), m, agg)
        ent = _verl_agg(batch["ent"], m, agg)
        d = batch["ref"] - lp  # low_var_kl: k3, clamped to [-10, 10] (not reached here)
        kl = torch.clamp(torch.exp(d) - d - 1, -10, 10)
        return pg - ent_coeff * ent + kl_coef * _verl_agg(kl, m, agg)

    cfg = fk.LossConfig(eps_low=0.2, eps_high=0.28, dual_clip=3.0, loss_agg_mode=agg, entropy_coef=ent_coeff,
                        beta=kl_coef)
    _same(_ours(batch, cfg, ref=True, ent=True), _theirs(batch, theirs), batch["mask"])


def test_verl_gspo_loss_mode(batch):
    # sequence ratio with stop-gradient token form: exp(logp - sg(logp) + sg(mean log-ratio))
    per_token_adv = torch.randn(B, T)
    b = dict(batch, adv=per_token_adv)

    def theirs(lp):
        m = b["mask"].float()
        seq_lr = ((lp - b["old"]) * m).sum(-1) / m.sum(-1)
        log_r = lp - lp.detach() + seq_lr.detach()[:, None]
        ratio = torch.exp(torch.clamp(log_r, max=10.0))
        a = b["adv"]
        loss = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - 3e-4, 1 + 4e-4))
        return _verl_agg(loss, m, "seq-mean-token-mean")

    cfg = fk.LossConfig(eps_low=3e-4, eps_high=4e-4, importance_sampling_level="sequence_token",
                        loss_agg_mode="seq-mean-token-mean")
    _same(_ours(b, cfg), _theirs(b, theirs), b["mask"])


@pytest.mark.parametrize("level,mode", [("token", "truncate"), ("token", "mask"), ("sequence", "truncate"),
                                        ("geometric", "mask")])
def test_verl_rollout_importance_sampling(batch, level, mode):
    lower, upper = 0.5, 1.6

    def theirs(lp):
        m = batch["mask"].float()
        lr = (batch["old"] - batch["roll"]) * m
        if level == "sequence":
            lr = lr.sum(-1, keepdim=True)
        elif level == "geometric":
            lr = lr.sum(-1, keepdim=True) / m.sum(-1, keepdim=True)
        w = torch.exp(lr)
        if mode == "truncate":
            w = w.clamp(lower, upper)
        else:
            w = w * ((w >= lower) & (w <= upper)).float()
        return _verl_agg(_verl_vanilla(lp, batch, 0.2, 0.2, 3.0) * w, m, "token-mean")

    tis_mode = ("token_" if level == "token" else "sequence_") + mode
    cfg = fk.LossConfig(dual_clip=3.0, tis_mode=tis_mode, tis_min=lower, tis_max=upper,
                        tis_sequence_reduce="mean" if level == "geometric" else "sum")
    _same(_ours(batch, cfg, roll=True), _theirs(batch, theirs), batch["mask"])


# ---------------- OpenRLHF PolicyLoss ----------------

@pytest.mark.parametrize("token_level_loss", [True, False])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_openrlhf_policy_loss(batch, token_level_loss, dual_clip):
    eps_low, eps_high, cap, ent_coef, kl_coef = 0.2, 0.27, 1.5, 0.003, 0.02

    def masked_mean(x, m, dim=None):
        return (x * m).sum() / m.sum() if dim is None else (x * m).sum(dim) / m.sum(dim)

    def theirs(lp):
        m = batch["mask"].float()
        a = batch["adv"][:, None]
        ratio = torch.exp(lp - batch["old"])
        s1 = ratio * a
        s2 = ratio.clamp(1 - eps_low, 1 + eps_high) * a
        if dual_clip is None:
            loss = -torch.min(s1, s2)
        else:
            c1 = torch.min(s1, s2)
            c2 = torch.max(c1, dual_clip * a)
            loss = -torch.where(a < 0, c2, c1)
        loss = loss * torch.exp(batch["old"] - batch["roll"]).clamp(max=cap)  # vLLM IS correction
        log_ratio = -(lp - batch["ref"])                                     # k3 estimator
        k3 = log_ratio.exp() - 1 - log_ratio
        loss = loss + kl_coef * k3 - ent_coef * batch["ent"]
        return masked_mean(loss, m) if token_level_loss else masked_mean(loss, m, -1).mean()

    cfg = fk.LossConfig(eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, tis_mode="token_truncate",
                        tis_min=0.0, tis_max=cap, beta=kl_coef, entropy_coef=ent_coef,
                        loss_agg_mode="token-mean" if token_level_loss else "seq-mean-token-mean")
    _same(_ours(batch, cfg, roll=True, ref=True, ent=True), _theirs(batch, theirs), batch["mask"])
