"""float64 reference of the clipped policy loss: readable, slow, differentiable. The spec.

`policy_loss_spec` takes the public inputs (padded [B, T] + mask, or packed
[total] + cu_seqlens, optionally with a mask too), walks the sequences one by
one in Python, and builds the loss from torch ops in float64 so that autograd
gives the reference gradient. Nothing here is shared with the fast backends.

`policy_loss_forward` / `policy_loss_backward` adapt the spec to the backend
interface (flat token tensors + cu_seqlens, see ops/policy_loss.py): the
gradient comes from autograd and is returned whole in `g_tok`.
"""
from __future__ import annotations

import torch

from ..loss_config import METRIC_NAMES, LossConfig


def _split(x, mask, cu_seqlens, nseq):
    """Per-sequence 1-D float64 tensors holding the valid tokens of `x` (None stays None)."""
    if x is None:
        return [None] * nseq
    x = x.double()
    out = []
    for i in range(nseq):
        if cu_seqlens is None:
            row = x[i]
            keep = torch.ones_like(row, dtype=torch.bool) if mask is None else mask[i].bool()
        else:
            a, b = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
            row = x[a:b]
            keep = torch.ones_like(row, dtype=torch.bool) if mask is None else mask[a:b].bool()
        out.append(row[keep])
    return out


def _advantages(advantages, mask, cu_seqlens, nseq, ntok_shape):
    adv = advantages.double()
    if cu_seqlens is None:
        if adv.dim() == 2 and adv.shape[1] == 1:
            adv = adv[:, 0]
        if adv.dim() == 1:  # one advantage per sequence
            adv = adv[:, None].expand(ntok_shape)
    elif (adv.dim() == 2 and adv.shape == (nseq, 1)) or (adv.numel() == nseq and adv.numel() != ntok_shape[0]):
        adv = adv.reshape(nseq)  # per sequence: [S, 1], or [S] where S differs from the token count
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        adv = torch.repeat_interleave(adv, lengths)
    return _split(adv, mask, cu_seqlens, nseq)


def tis_weight(log_rho, cfg: LossConfig):
    """(applied weight, outside [tis_min, tis_max]) for log-ratios log_rho (no gradient)."""
    rho = torch.exp(log_rho)
    outside = (rho < cfg.tis_min) | (rho > cfg.tis_max)
    if cfg.tis_mode.endswith("truncate"):
        w = rho.clamp(cfg.tis_min, cfg.tis_max)
    else:
        w = torch.where(outside, torch.zeros_like(rho), rho)
    return w, outside


def policy_loss_spec(logp, old_logp, advantages, *, mask=None, cu_seqlens=None, rollout_logp=None, ref_logp=None,
                     entropy=None, config: LossConfig | None = None, normalizer=None, positive=None):
    """Returns (loss, metrics) in float64; differentiable w.r.t. logp and entropy.

    positive: one flag per sequence (nonzero = positively rewarded), for VAPO's NLL term.
    """
    cfg = LossConfig() if config is None else config
    nseq = logp.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    lp = _split(logp, mask, cu_seqlens, nseq)
    old = _split(old_logp, mask, cu_seqlens, nseq)
    adv = _advantages(advantages, mask, cu_seqlens, nseq, logp.shape)
    roll = _split(rollout_logp, mask, cu_seqlens, nseq)
    ref = _split(ref_logp, mask, cu_seqlens, nseq)
    ent = _split(entropy, mask, cu_seqlens, nseq)
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high

    seq_sums, ratios, seq_ratios, weights, outside, mkl, kls, ents = [], [], [], [], [], [], [], []
    clip_low = clip_high = clip_dual = 0.0
    for i in range(nseq):
        n = lp[i].numel()
        a = adv[i]
        log_ratio = lp[i] - old[i]
        s = torch.exp(log_ratio.sum() / max(n, 1))
        if cfg.importance_sampling_level == "token":
            r = torch.exp(log_ratio)
        elif cfg.importance_sampling_level == "sequence":
            r = s.expand(n)
        else:  # sequence_token: value s, gradient of exp(logp_t) scaled by s
            r = s.detach() * torch.exp(lp[i] - lp[i].detach())
        pg = -torch.min(r * a, r.clamp(lo, hi) * a)
        if cfg.dual_clip is not None:
            pg = torch.where(a < 0, torch.min(pg, -cfg.dual_clip * a), pg)
        rd = r.detach()
        clip_low += float(((a < 0) & (rd < lo)).sum())
        clip_high += float(((a > 0) & (rd > hi)).sum())
        if cfg.dual_clip is not None:
            clip_dual += float(((a < 0) & (rd > cfg.dual_clip)).sum())

        with torch.no_grad():
            if cfg.tis_mode == "none":
                w = torch.ones(n, dtype=torch.float64, device=pg.device)
                out = torch.zeros(n, dtype=torch.bool, device=pg.device)
            elif cfg.tis_mode.startswith("token"):
                w, out = tis_weight(old[i] - roll[i], cfg)
            else:
                d = (old[i] - roll[i]).sum()
                if cfg.tis_sequence_reduce == "mean":
                    d = d / max(n, 1)
                w, out = tis_weight(d, cfg)
                w, out = w.expand(n), out.expand(n)
        per_token = w * pg
        if ref[i] is not None:
            y = ref[i] - lp[i]
            kl = torch.exp(y) - y - 1.0
            kls.append(kl.detach())
            per_token = per_token + cfg.beta * kl
        if ent[i] is not None:
            ents.append(ent[i].detach())
            per_token = per_token - cfg.entropy_coef * ent[i]
        if roll[i] is not None:
            x = old[i] - roll[i]
            mkl.append(torch.exp(x) - 1.0 - x)
        total = per_token.sum()
        if cfg.loss_agg_mode == "seq-mean-token-mean":
            total = total / max(n, 1)
        seq_sums.append(total)
        ratios.append(torch.exp(log_ratio.detach()))
        if n > 0:
            seq_ratios.append(s.detach())
        weights.append(w)
        outside.append(out)

    ntok = sum(x.numel() for x in lp)
    nonempty = len(seq_ratios)
    if normalizer is not None:
        divisor = normalizer
    elif cfg.normalizer is not None:
        divisor = cfg.normalizer
    elif cfg.loss_agg_mode == "token-mean":
        divisor = max(ntok, 1)
    elif cfg.loss_agg_mode == "token-sum":  # verl's token-sum: the plain sum over all valid tokens
        divisor = 1.0
    elif cfg.loss_agg_mode == "seq-mean-token-sum-norm":
        if cu_seqlens is not None:
            raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' with packed inputs needs a normalizer")
        divisor = logp.shape[1]
    else:
        divisor = max(nonempty, 1)
    loss = sum(seq_sums, torch.zeros((), dtype=torch.float64)) / divisor

    # VAPO positive-example LM loss: its own token mean over the positive sequences' valid tokens
    nll_sum, n_pos = torch.zeros((), dtype=torch.float64), 0
    if positive is not None:
        flags = positive.reshape(-1)
        for i in range(nseq):
            if bool(flags[i] != 0):
                nll_sum = nll_sum - lp[i].sum()
                n_pos += lp[i].numel()
    nll_mean = nll_sum / n_pos if n_pos else torch.zeros((), dtype=torch.float64)
    if cfg.nll_coef != 0.0:
        loss = loss + cfg.nll_coef * nll_mean

    def cat(xs):
        return torch.cat([x.reshape(-1) for x in xs]) if xs else torch.zeros(0, dtype=torch.float64)

    def mean(x):
        return float(x.sum()) / x.numel() if x.numel() else 0.0

    def mn(x):
        return float(x.min()) if x.numel() else 0.0

    def mx(x):
        return float(x.max()) if x.numel() else 0.0

    r_all, s_all, w_all = cat(ratios), torch.stack(seq_ratios) if seq_ratios else cat([]), cat(weights)
    frac = (lambda c: c / ntok) if ntok else (lambda c: 0.0)
    metrics = {
        "clip_frac_low": frac(clip_low),
        "clip_frac_high": frac(clip_high),
        "clip_frac_dual": frac(clip_dual),
        "ratio_mean": mean(r_all), "ratio_min": mn(r_all), "ratio_max": mx(r_all),
        "seq_ratio_mean": mean(s_all), "seq_ratio_min": mn(s_all), "seq_ratio_max": mx(s_all),
        "tis_weight_mean": mean(w_all), "tis_weight_min": mn(w_all), "tis_weight_max": mx(w_all),
        "tis_frac_clipped": frac(float(cat(outside).double().sum())),
        "mismatch_kl": mean(cat(mkl)),
        "kl_mean": mean(cat(kls)),
        "entropy_mean": mean(cat(ents)),
        "num_tokens": float(ntok),
        "num_seqs": float(nonempty),
        "nll_mean": float(nll_mean.detach()),
        "num_positive_tokens": float(n_pos),
    }
    assert tuple(metrics) == METRIC_NAMES
    return loss, {k: torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()}


# ---- backend interface (flat tokens + cu_seqlens; see ops/policy_loss.py) ----

def _autograd_enabled():
    """Undo the autograd-key exclusion that custom-op implementations run under (reference backend only)."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in ("AutogradCPU", "AutogradCUDA", "ADInplaceOrView", "AutogradOther", "AutogradFunctionality"):
        k = getattr(torch._C.DispatchKey, key, None)
        if k is not None:
            exclude = exclude.remove(k)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def spec_normalizer(normalizer, divisor, agg):
    """The spec's `normalizer` from the op's (tensor normalizer or None, float divisor or 0)."""
    if normalizer is not None:
        return normalizer.double()
    if divisor > 0:
        return divisor
    if agg == "seq-mean-token-sum-norm":
        raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' needs a normalizer")
    return None


def _config(eps_low, eps_high, dual_clip, level, tis_mode, tis_min, tis_max, tis_reduce, agg, beta, entropy_coef,
            nll_coef):
    return LossConfig(
        eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip if dual_clip > 0 else None,
        importance_sampling_level=level, tis_mode=tis_mode, tis_min=tis_min, tis_max=tis_max,
        tis_sequence_reduce=tis_reduce, loss_agg_mode=agg, beta=beta, entropy_coef=entropy_coef, nll_coef=nll_coef,
    )


def policy_loss_forward(logp, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp, entropy, normalizer,
                        eps_low, eps_high, dual_clip, level, tis_mode, tis_min, tis_max, tis_reduce, agg, beta,
                        entropy_coef, divisor, uniform_len, positive=None, nll_coef=0.0):
    cfg = _config(eps_low, eps_high, dual_clip, level, tis_mode, tis_min, tis_max, tis_reduce, agg, beta, entropy_coef,
                  nll_coef)
    norm = spec_normalizer(normalizer, divisor, agg)
    lp = logp.detach().double().requires_grad_(True)
    ent = entropy.detach().double().requires_grad_(True) if entropy is not None else None
    # A custom op runs below the autograd dispatch keys; re-enable them to differentiate the spec here.
    with _autograd_enabled(), torch.enable_grad():
        loss, metrics = policy_loss_spec(
            lp, old_logp, advantages, mask=mask, cu_seqlens=cu_seqlens, rollout_logp=rollout_logp,
            ref_logp=ref_logp, entropy=ent, config=cfg, normalizer=norm, positive=positive,
        )
        inputs = [lp] + ([ent] if ent is not None else [])
        grads = torch.autograd.grad(loss, inputs, allow_unused=True) if loss.requires_grad else [None] * len(inputs)
    g_tok = torch.zeros_like(lp) if grads[0] is None else grads[0]
    g_ent = logp.new_zeros(0, dtype=torch.float32)
    if ent is not None:
        g_ent = (torch.zeros_like(ent) if grads[1] is None else grads[1]).float()
    loss = loss.detach()
    mvec = torch.stack([metrics[k] for k in METRIC_NAMES]).float().to(logp.device)
    one = torch.ones((), dtype=torch.float32, device=logp.device)
    nseq = cu_seqlens.numel() - 1
    has_seq = level == "sequence" or (positive is not None and nll_coef != 0.0)
    seq_coef = logp.new_zeros(nseq if has_seq else 0, dtype=torch.float32)  # all of it is in g_tok
    return loss.detach().float().to(logp.device), mvec, g_tok.float(), g_ent, seq_coef, one


def policy_loss_backward(grad_loss, g_tok, g_ent, seq_coef, mask, cu_seqlens, scale, uniform_len):
    g = grad_loss.double() * scale.double()
    grad_logp = g_tok.double() * g
    if seq_coef.numel() and bool(seq_coef.ne(0).any()):
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        per_tok = torch.repeat_interleave(seq_coef.double(), lengths)
        if mask is not None:
            per_tok = per_tok * mask.double()
        grad_logp = grad_logp + per_tok * g
    grad_ent = g_ent.double() * g if g_ent.numel() else g_tok.new_zeros(0)
    return grad_logp.float(), grad_ent.float()


__all__ = ["policy_loss_backward", "policy_loss_forward", "policy_loss_spec", "spec_normalizer", "tis_weight"]
