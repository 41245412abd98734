"""float64 spec of the CPU token sampler of the flashrl vLLM engines (csrc/cpu/sample.cpp).

One token per row drawn from softmax(logits) by inverting the row's CDF with one uniform number per row:

    e_k = exp(x_k - max x),  S = sum_k e_k,  u = (splitmix64(seed) >> 11) / 2^53  in [0, 1)
    token = min { k : e_0 + ... + e_k > u S }

Entries of -inf (top-k / top-p masks) have e_k = 0 and are never drawn. A row holding a NaN, or whose maximum is not
finite (all -inf, or a +inf entry), returns the first maximum of its non-NaN entries (0 if it has none).

`token_logprob_rank` is what the engines return for a sampled token with logprobs=0: log softmax(x)_t and the rank
#{k : x_k >= x_t} (vLLM counts on its float32 log-probabilities, which can only merge entries that differ by less
than their rounding).
"""
from __future__ import annotations

import torch

__all__ = ["sample_categorical", "splitmix64", "token_logprob_rank", "uniform01"]

_M64 = (1 << 64) - 1


def splitmix64(seed: int) -> int:
    """SplitMix64's output for state `seed` (two's complement of a negative int64), as an unsigned 64-bit int."""
    z = (seed + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def uniform01(seed: int) -> float:
    """The row's uniform number: the top 53 bits of splitmix64(seed), in [0, 1)."""
    return (splitmix64(seed & _M64) >> 11) * 2.0 ** -53


def _first_max(row: torch.Tensor) -> int:
    finite = row[~torch.isnan(row)]
    if finite.numel() == 0:
        return 0
    idx = torch.nonzero(~torch.isnan(row)).flatten()
    return int(idx[int(torch.argmax(finite))])  # torch.argmax returns the first maximum


def sample_categorical(logits: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: one token per row of `logits` [rows, vocab], drawn with the row's int64 seed."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    if seeds.dtype != torch.int64 or seeds.shape != (logits.shape[0],):
        raise ValueError(f"seeds must be int64 [rows={logits.shape[0]}], got {seeds.dtype} {tuple(seeds.shape)}")
    x = logits.detach().to(device="cpu", dtype=torch.float64)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    for r in range(x.shape[0]):
        row = x[r]
        m = row.max() if not torch.isnan(row).any() else torch.tensor(float("nan"), dtype=torch.float64)
        if not torch.isfinite(m):
            out[r] = _first_max(row)
            continue
        cum = torch.cumsum(torch.exp(row - m), 0)
        target = uniform01(int(seeds[r])) * float(cum[-1])
        out[r] = int(torch.searchsorted(cum, torch.tensor([target], dtype=torch.float64), right=True)[0])
    return out


def token_logprob_rank(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 [rows], int64 [rows]): log softmax(logits)[r, tokens[r]] and #{k : logits[r, k] >= logits[r, tokens[r]]};
    NaN log-probability for a row with a NaN or without a finite maximum."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    if tokens.dtype != torch.int64 or tokens.shape != (logits.shape[0],):
        raise ValueError(f"tokens must be int64 [rows={logits.shape[0]}], got {tokens.dtype} {tuple(tokens.shape)}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= logits.shape[1]):
        raise ValueError(f"tokens must lie in [0, {logits.shape[1]})")
    x = logits.detach().to(device="cpu", dtype=torch.float64)
    xt = x.gather(1, tokens[:, None].cpu())
    rank = (x >= xt).sum(1)
    m = x.max(1).values
    bad = torch.isnan(x).any(1) | ~torch.isfinite(m)
    lse = m + torch.log(torch.exp(x - m[:, None]).sum(1))
    lp = torch.where(bad, torch.full_like(m, float("nan")), xt[:, 0] - lse)
    return lp, rank
