"""token_logprobs on every available backend vs the float64 spec.

Tolerances. Every backend accumulates in fp32 on inputs that are exact in
their dtype, so the logprob/entropy error is that of fp32 arithmetic on
values of size max|z|/T: |err| <= 1e-5 + 4 * eps32 * max|z/T|. Gradients are
rounded to the logits dtype on output: |err| <= (round(dtype) + the above) *
max|grad|, with round = 2^-8 (bf16), 2^-11 (fp16), 1e-6 (fp32). Triton's
interpreter truncates fp32 -> bf16 instead of rounding to nearest (the GPU
rounds), so under TRITON_INTERPRET the bf16 allowance is one ulp, 2^-7.
"""
import pytest
import torch
from conftest import DEVICE, available_backends

import flashrl_kernels as fk
from flashrl_kernels import _backend
from flashrl_kernels.reference import token_logprobs_spec

BACKENDS = available_backends(DEVICE)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS32 = torch.finfo(torch.float32).eps
ROUND = {torch.float32: 1e-6, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def make_logits(shape, dtype, scale=3.0, neg_inf_frac=0.0):
    x = torch.randn(shape, device=DEVICE) * scale
    if neg_inf_frac:
        x[torch.rand(shape, device=DEVICE) < neg_inf_frac] = float("-inf")
    return x.to(dtype)


def value_tol(x, temperature):
    finite = x[torch.isfinite(x)].float()
    return 1e-5 + 4 * EPS32 * float(finite.abs().max()) / temperature


def run_case(backend, logits, targets, temperature=1.0, ignore_index=None, entropy=True):
    """(logp, ent, grad) from the backend and (logp, ent, grad) from the float64 spec."""
    x = logits.detach().clone().requires_grad_(True)
    with fk.use_backend(backend):
        out = fk.token_logprobs(x, targets, temperature=temperature, return_entropy=entropy, ignore_index=ignore_index)
        lp, ent = out if entropy else (out, None)
        g_lp = torch.randn_like(lp)
        g_h = torch.randn_like(lp)
        loss = (lp * g_lp).sum() + ((ent * g_h).sum() if entropy else 0.0)
        loss.backward()
    xr = logits.detach().double().requires_grad_(True)
    rlp, rent = token_logprobs_spec(xr, targets, temperature, ignore_index)
    rloss = (rlp * g_lp.double()).sum() + ((rent * g_h.double()).sum() if entropy else 0.0)
    rloss.backward()
    return (lp, ent, x.grad), (rlp, rent if entropy else None, xr.grad)


def grad_rounding(dtype, backend):
    if backend == "triton" and dtype == torch.bfloat16 and _backend.triton_interpret():
        return 2.0**-7
    return ROUND[dtype]


def assert_close_to_spec(got, ref, logits, temperature, backend=None):
    lp, ent, grad = got
    rlp, rent, rgrad = ref
    tol = value_tol(logits, temperature)
    assert lp.dtype == torch.float32 and lp.shape == rlp.shape
    torch.testing.assert_close(lp.double(), rlp, atol=tol, rtol=0)
    if ent is not None:
        assert ent.dtype == torch.float32
        torch.testing.assert_close(ent.double(), rent, atol=tol, rtol=0)
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    gmax = float(rgrad.abs().max())
    torch.testing.assert_close(grad.double(), rgrad, atol=(grad_rounding(logits.dtype, backend) + tol) * gmax + 1e-12, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [50, 32003])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_reference(backend, dtype, vocab, temperature):
    logits = make_logits((3, 5, vocab), dtype)
    targets = torch.randint(0, vocab, (3, 5), device=DEVICE)
    got, ref = run_case(backend, logits, targets, temperature)
    assert_close_to_spec(got, ref, logits, temperature, backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", [151936, 129920])
def test_large_vocab(backend, vocab):
    logits = make_logits((2, vocab), torch.bfloat16, scale=4.0)
    targets = torch.randint(0, vocab, (2,), device=DEVICE)
    got, ref = run_case(backend, logits, targets, 1.3)
    assert_close_to_spec(got, ref, logits, 1.3, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_huge_logits(backend, dtype):
    logits = make_logits((6, 257), dtype, scale=1.0)
    logits = (logits.float() / logits.float().abs().amax(-1, keepdim=True) * 1e4).to(dtype)  # values up to +-1e4
    targets = torch.randint(0, 257, (6,), device=DEVICE)
    got, ref = run_case(backend, logits, targets, 0.9)
    assert_close_to_spec(got, ref, logits, 0.9, backend)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[2]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_neg_inf_entries(backend, dtype):
    logits = make_logits((7, 203), dtype, neg_inf_frac=0.3)
    logits[2, 5:] = float("-inf")  # a row with only 5 finite entries
    targets = torch.randint(0, 5, (7,), device=DEVICE)
    targets[3] = int(torch.nonzero(torch.isneginf(logits[3]))[0, 0])  # a target whose logit is -inf
    got, ref = run_case(backend, logits, targets, 1.0)
    assert got[0][3] == float("-inf") and ref[0][3] == float("-inf")
    keep = torch.ones(7, dtype=torch.bool)
    keep[3] = False
    assert_close_to_spec(
        (got[0][keep], got[1], got[2]), (ref[0][keep], ref[1], ref[2]), logits, 1.0, backend
    )
    assert torch.isfinite(got[2].float()).all(), "gradient must stay finite next to -inf logits"


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignore_index(backend):
    logits = make_logits((4, 9, 50), torch.float32)
    targets = torch.randint(0, 50, (4, 9), device=DEVICE)
    targets[torch.rand(4, 9, device=DEVICE) < 0.3] = -100
    targets[0, 0] = -100
    got, ref = run_case(backend, logits, targets, 1.0, ignore_index=-100)
    assert_close_to_spec(got, ref, logits, 1.0, backend)
    ignored = targets == -100
    assert (got[0][ignored] == 0).all() and (got[1][ignored] == 0).all()
    assert (got[2][ignored] == 0).all(), "ignored positions get no gradient"
    assert (got[2][~ignored].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_strided_rows_and_int32_targets(backend, index_dtype):
    full = make_logits((3, 8, 77), torch.bfloat16)
    logits = full[:, :-1, :]  # as trainers slice model outputs: rows are strided
    assert not logits.is_contiguous()
    targets = torch.randint(0, 77, (3, 7), device=DEVICE, dtype=index_dtype)
    got, ref = run_case(backend, logits, targets, 1.0)
    assert_close_to_spec(got, ref, logits, 1.0, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprob_only_and_entropy_only_gradients(backend):
    logits = make_logits((5, 61), torch.float32)
    targets = torch.randint(0, 61, (5,), device=DEVICE)
    got, ref = run_case(backend, logits, targets, 1.0, entropy=False)
    assert_close_to_spec(got, ref, logits, 1.0, backend)
    x = logits.clone().requires_grad_(True)
    with fk.use_backend(backend):
        _, ent = fk.token_logprobs(x, targets, return_entropy=True)
        ent.sum().backward()
    xr = logits.double().requires_grad_(True)
    token_logprobs_spec(xr, targets)[1].sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_caller_logits_untouched(backend):
    logits = make_logits((4, 100), torch.float32)
    before = logits.clone()
    x = logits.requires_grad_(True)
    with fk.use_backend(backend):
        lp = fk.token_logprobs(x, torch.randint(0, 100, (4,), device=DEVICE), temperature=0.5)
        lp.sum().backward()
    assert torch.equal(logits.detach(), before)


def test_backends_agree_with_each_other():
    logits = make_logits((4, 6, 1000), torch.bfloat16)
    targets = torch.randint(0, 1000, (4, 6), device=DEVICE)
    outs = {}
    for b in BACKENDS:
        with fk.use_backend(b):
            outs[b] = fk.token_logprobs(logits, targets, return_entropy=True)
    for b, (lp, ent) in outs.items():
        torch.testing.assert_close(lp, outs["reference"][0], atol=2e-5, rtol=0, msg=b)
        torch.testing.assert_close(ent, outs["reference"][1], atol=2e-5, rtol=0, msg=b)
