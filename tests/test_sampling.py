"""The native CPU token sampler (csrc/cpu/sample.cpp) against its float64 spec (flashrl_kernels/reference/sampling.py),
and the distribution it draws from. The vLLM side (which engines use it) is in test_vllm_plugin.py."""
import math

import pytest
import torch

from flashrl_kernels import _native
from flashrl_kernels.reference.sampling import sample_categorical as reference
from flashrl_kernels.reference.sampling import splitmix64, uniform01

pytestmark = pytest.mark.skipif(not _native.load(), reason="the native CPU library did not build")


def native(logits, seeds):
    return torch.ops.flashrl_native.sample_categorical(logits, seeds)


def seeds_for(n, gen):
    return torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.long, generator=gen)


def assert_matches_reference(logits, seeds):
    """Same token as the spec in every row, except where the row's uniform number falls within fp32 rounding of a
    boundary of the CDF (the kernel sums fp32 exponentials of relative error ~2e-7)."""
    got, want = native(logits, seeds), reference(logits, seeds)
    x = logits.double()
    for r in torch.nonzero(got != want).flatten().tolist():
        cum = torch.cumsum(torch.exp(x[r] - x[r].max()), 0)
        target = uniform01(int(seeds[r])) * float(cum[-1])
        lo, hi = sorted((int(got[r]), int(want[r])))
        gap = max(abs(float(cum[lo]) - target), abs(float(cum[hi - 1]) - target))
        assert gap <= 1e-5 * float(cum[-1]), (r, int(got[r]), int(want[r]), gap)
    assert int((got != want).sum()) <= max(1, got.numel() // 500)
    return got


def test_splitmix64_is_the_standard_generator():
    # the first outputs of SplitMix64 from state 0 (Vigna's reference implementation)
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4
    assert 0.0 <= uniform01(-1) < 1.0 and uniform01(0) == (0xE220A8397B1DCDAF >> 11) * 2.0**-53


@pytest.mark.parametrize("vocab", [1, 5, 511, 512, 513, 4099, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_matches_reference(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab * 7 + len(str(dtype)))
    rows = 24 if vocab > 100000 else 300
    scale = torch.tensor([0.1, 2.0, 20.0]).repeat(rows // 3 + 1)[:rows, None]  # flat, typical, peaked rows
    logits = (torch.randn(rows, vocab, generator=gen) * scale).to(dtype)
    if vocab > 1:  # top-k / top-p style masks on a third of the entries, one finite entry kept per row
        mask = torch.rand(rows, vocab, generator=gen) < 0.33
        mask[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=gen)] = False
        logits = logits.masked_fill(mask, float("-inf"))
    got = assert_matches_reference(logits, seeds_for(rows, gen))
    assert got.dtype == torch.int64 and bool(((got >= 0) & (got < vocab)).all())
    assert bool(torch.isfinite(logits.gather(1, got[:, None]).float()).all())  # a masked entry is never drawn


def test_rows_with_a_stride_and_thread_counts():
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(64, 3000, generator=gen) * 3
    logits, seeds = wide[:, :2999], seeds_for(64, gen)  # row stride 3000, vocabulary 2999
    one = assert_matches_reference(logits, seeds)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native(logits, seeds), one)  # each row is drawn by one thread in a fixed order
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(native(logits.contiguous(), seeds), one)


def test_degenerate_rows():
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([
        [-inf, -inf, -inf, -inf],     # nothing finite: 0
        [-inf, -inf, 3.0, -inf],      # one finite entry: always it
        [0.0, nan, 5.0, 1.0],         # a NaN: the first maximum of the other entries
        [0.0, inf, 5.0, inf],         # +inf: the first one
        [nan, nan, nan, nan],         # all NaN: 0
    ])
    for seed in (0, 1, -5, 2**62):
        seeds = torch.full((5,), seed, dtype=torch.long)
        assert native(logits, seeds).tolist() == [0, 2, 2, 1, 0]
        assert reference(logits, seeds).tolist() == [0, 2, 2, 1, 0]


def test_draws_follow_the_softmax():
    """40000 draws of one 50-token row with random seeds: Pearson's chi-square against softmax(logits) stays in the
    bulk of its 49-degree distribution (mean 49, sd 9.9): not biased, and not too regular either."""
    gen = torch.Generator().manual_seed(11)
    n, vocab = 40000, 50
    row = torch.randn(vocab, generator=gen) * 1.5
    counts = torch.bincount(native(row.expand(n, vocab).contiguous(), seeds_for(n, gen)), minlength=vocab).double()
    expected = torch.softmax(row.double(), 0) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert 49 - 4 * math.sqrt(98) < chi2 < 49 + 5 * math.sqrt(98), chi2


def test_bad_inputs_raise():
    x, s = torch.randn(3, 10), torch.zeros(3, dtype=torch.long)
    with pytest.raises(RuntimeError, match="logits must be \\[rows, vocab\\]"):
        native(x[None], s)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        native(x.double(), s)
    with pytest.raises(RuntimeError, match="unit stride"):
        native(x.t(), torch.zeros(10, dtype=torch.long))
    with pytest.raises(RuntimeError, match="seeds must be a contiguous int64 vector"):
        native(x, s.int())
    with pytest.raises(RuntimeError, match="seeds must be a contiguous int64 vector"):
        native(x, torch.zeros(4, dtype=torch.long))
    with pytest.raises(RuntimeError, match="empty vocabulary"):
        native(torch.empty(3, 0), s)


# ---- the sampled token's logprob and rank (token_logprob_rank: the flashrl engines' rollout logprobs) ----

def _logprob_rank(logits, tokens):
    return torch.ops.flashrl_native.token_logprob_rank(logits, tokens)


@pytest.mark.parametrize("vocab", [1, 7, 15, 16, 17, 513, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_token_logprob_rank_matches_reference(vocab, dtype):
    """Against float64 on fresh random rows (flat, typical, peaked; -inf masks as top-k leaves them; ties from the
    low-precision dtypes), the tokens drawn by the sampler and arbitrary ones; also against torch's float32
    log_softmax, which is what vLLM returns."""
    from flashrl_kernels.reference.sampling import token_logprob_rank

    gen = torch.Generator().manual_seed(vocab + len(str(dtype)))
    rows = 9 if vocab > 100000 else 60
    scale = torch.tensor([0.1, 2.0, 20.0]).repeat(rows // 3 + 1)[:rows, None]
    x = torch.randn(rows, vocab, generator=gen) * scale
    if vocab > 4:
        x[::4, torch.randperm(vocab, generator=gen)[: vocab // 2]] = float("-inf")
    x = x.to(dtype)
    drawn = native(x, seeds_for(rows, gen))
    anywhere = torch.randint(0, vocab, (rows,), generator=gen)
    tokens = torch.where(torch.isinf(x.float().gather(1, anywhere[:, None]))[:, 0], drawn, anywhere)
    for t in (drawn, tokens):
        lp, rank = _logprob_rank(x, t)
        want_lp, want_rank = token_logprob_rank(x, t)
        assert lp.dtype == torch.float32 and rank.dtype == torch.int64
        assert torch.equal(rank, want_rank)
        torch.testing.assert_close(lp.double(), want_lp, rtol=0, atol=2e-5)
        torch.testing.assert_close(lp, x.float().log_softmax(-1).gather(1, t[:, None])[:, 0], rtol=0, atol=5e-5)
        assert ((rank >= 1) & (rank <= vocab)).all()


def test_token_logprob_rank_degenerate_rows_and_bad_inputs():
    from flashrl_kernels.reference.sampling import token_logprob_rank

    inf = float("inf")
    x = torch.tensor([[0.0, float("nan"), 1.0], [-inf, -inf, -inf], [1.0, inf, 0.0], [2.0, 2.0, -inf], [3.0, -inf, 1.0]])
    t = torch.tensor([2, 0, 1, 1, 0])
    lp, rank = _logprob_rank(x, t)
    want_lp, want_rank = token_logprob_rank(x, t)
    assert torch.isnan(lp[:3]).all() and torch.isnan(want_lp[:3]).all()
    torch.testing.assert_close(lp[3:].double(), want_lp[3:], rtol=0, atol=1e-6)
    assert torch.equal(rank, want_rank) and rank.tolist()[3:] == [2, 1]
    strided = torch.randn(4, 40)[:, ::2]
    with pytest.raises(RuntimeError, match="unit stride"):
        _logprob_rank(strided, torch.zeros(4, dtype=torch.long))
    with pytest.raises(RuntimeError, match="outside"):
        _logprob_rank(torch.randn(2, 5), torch.tensor([0, 5]))
    with pytest.raises(RuntimeError, match="int64"):
        _logprob_rank(torch.randn(2, 5), torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        _logprob_rank(torch.randn(2, 5).double(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="tokens must lie"):
        token_logprob_rank(torch.randn(2, 5), torch.tensor([0, 5]))
