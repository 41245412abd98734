"""Configuration and output types of `flashrl_kernels.policy_loss`.

`LossConfig` is frozen and validated when it is built, so a bad setting fails
at construction with a ValueError/TypeError naming the field, not deep inside
a training step. See docs/policy_loss.md for the formulas and for the mapping
to TRL, verl and OpenRLHF options.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_token")
TIS_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
TIS_SEQUENCE_REDUCES = ("sum", "mean")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

# Names (and order) of the metrics every backend returns. Stable: renaming one is an API change.
METRIC_NAMES = (
    "clip_frac_low",      # share of valid tokens with A < 0 and r < 1 - eps_low (lower clip active)
    "clip_frac_high",     # share of valid tokens with A > 0 and r > 1 + eps_high (upper clip active)
    "clip_frac_dual",     # share of valid tokens with A < 0 and r > dual_clip (dual clip active)
    "ratio_mean",         # token ratio exp(logp - old_logp) over valid tokens
    "ratio_min",
    "ratio_max",
    "seq_ratio_mean",     # GSPO ratio s_i = exp(mean log-ratio) over non-empty sequences
    "seq_ratio_min",
    "seq_ratio_max",
    "tis_weight_mean",    # applied TIS weight (after truncation / masking) over valid tokens
    "tis_weight_min",
    "tis_weight_max",
    "tis_frac_clipped",   # share of valid tokens whose raw TIS ratio fell outside [tis_min, tis_max]
    "mismatch_kl",        # k3 estimate of KL(rollout || old) per valid token, mean
    "kl_mean",            # k3 KL to the reference policy per valid token, mean
    "entropy_mean",       # mean entropy over valid tokens
    "num_tokens",         # number of valid tokens
    "num_seqs",           # number of sequences with at least one valid token
    "nll_mean",           # VAPO positive-example NLL: mean -logp over the valid tokens of positive sequences
    "num_positive_tokens",  # valid tokens in sequences flagged positive (0 without `positive`)
)


class LossOutput(NamedTuple):
    """`loss`: 0-d fp32 tensor, differentiable. `metrics`: dict name -> 0-d fp32 tensor (detached)."""

    loss: torch.Tensor
    metrics: dict


def _choice(name, value, allowed):
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")


def _number(name, value, *, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a Python float{' or None' if allow_none else ''}, got {type(value).__name__}")
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} must be finite, got {value}")


@dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters of the clipped policy loss.

    eps_low / eps_high: PPO clip range [1 - eps_low, 1 + eps_high] (DAPO clip-higher: eps_high > eps_low).
    dual_clip: c > 1 caps the loss of A < 0 tokens at -c * A (None: off).
    importance_sampling_level: "token" (PPO/GRPO), "sequence" (GSPO, gradient through the
        sequence ratio), "sequence_token" (GSPO-token: same forward, stop-gradient form).
    tis_mode: truncated importance sampling between the rollout engine and the trainer,
        rho = exp(old_logp - rollout_logp); "none" | "token_truncate" | "token_mask" |
        "sequence_truncate" | "sequence_mask". Truncate clamps rho to [tis_min, tis_max];
        mask zeroes weights outside [tis_min, tis_max] (bounds inclusive).
    tis_sequence_reduce: for sequence modes, "sum" (product of token ratios) or "mean"
        (geometric mean of token ratios).
    loss_agg_mode: "token-mean" | "token-sum" | "seq-mean-token-mean" | "seq-mean-token-sum" |
        "seq-mean-token-sum-norm". "token-sum" (verl's) is the plain sum of the per-token losses (divisor 1).
    normalizer: if set, the divisor of the aggregated loss (overrides the mode's default divisor).
    beta: weight of the k3 KL to ref_logp. entropy_coef: weight of the entropy bonus (subtracted).
    nll_coef: VAPO's positive-example LM loss weight (mu, 0.1 in the paper): adds
        nll_coef * mean(-logp) over the valid tokens of the sequences flagged by `positive`
        (its own token mean, whatever loss_agg_mode and normalizer say; 0 when no token is positive).
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    importance_sampling_level: str = "token"
    tis_mode: str = "none"
    tis_min: float = 0.0
    tis_max: float = 2.0
    tis_sequence_reduce: str = "sum"
    loss_agg_mode: str = "token-mean"
    normalizer: float | None = None
    beta: float = 0.0
    entropy_coef: float = 0.0
    nll_coef: float = 0.0

    def __post_init__(self):
        for name in ("eps_low", "eps_high", "tis_min", "tis_max", "beta", "entropy_coef", "nll_coef"):
            _number(name, getattr(self, name))
        _number("dual_clip", self.dual_clip, allow_none=True)
        _number("normalizer", self.normalizer, allow_none=True)
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"eps_low must lie in [0, 1), got {self.eps_low}")
        if self.eps_high < 0.0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 (it caps the loss of negative-advantage tokens), got {self.dual_clip}")
        _choice("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        _choice("tis_mode", self.tis_mode, TIS_MODES)
        _choice("tis_sequence_reduce", self.tis_sequence_reduce, TIS_SEQUENCE_REDUCES)
        _choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        if self.tis_min < 0.0:
            raise ValueError(f"tis_min must be >= 0, got {self.tis_min}")
        if self.tis_min > self.tis_max:
            raise ValueError(f"tis_min ({self.tis_min}) must not exceed tis_max ({self.tis_max})")
        if self.tis_max <= 0.0:
            raise ValueError(f"tis_max must be > 0, got {self.tis_max}")
        if self.nll_coef < 0.0:
            raise ValueError(f"nll_coef must be >= 0 (it weighs an NLL term that is minimised), got {self.nll_coef}")
        if self.normalizer is not None and not self.normalizer > 0.0:
            raise ValueError(f"normalizer must be > 0, got {self.normalizer}")

    @property
    def uses_rollout(self) -> bool:
        return self.tis_mode != "none"
