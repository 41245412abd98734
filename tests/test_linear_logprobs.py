"""linear_token_logprobs on every available backend vs the float64 spec.

Tolerances. The spec is float64 (hidden @ weight.T + bias) then token_logprobs.
fp32 inputs: the tile GEMM is fp32 (error ~ H * eps32 * |h| |w|), the epilogue
fp32: |err| <= 1e-5 + 8 * eps32 * max|z/T| * sqrt(H). bf16/fp16 inputs: on
CPU the logits tile is rounded to the input dtype (as the unfused
`hidden @ weight.T` is; see docs/linear_logprobs.md), which moves z_y and lse
by up to half an ulp each: allowance 2 * 2^-8 (bf16) / 2^-11 (fp16) * max|z/T|.
Gradients: dZ is rounded to the input dtype before the two GEMMs, the GEMM
products are rounded too and the logits error above propagates through p, so
|err| <= (4 * round(dtype) + 2 * value_tol) * max|grad| per entry.
"""
import pytest
import torch
from conftest import DEVICE, available_backends

import flashrl_kernels as fk
from flashrl_kernels.reference import linear_token_logprobs_spec

# backends that implement this op (native: torch_impl tile loops with the C++ epilogues)
BACKENDS = available_backends(DEVICE, op="linear_logprobs_stats")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS32 = torch.finfo(torch.float32).eps
ROUND = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def make_inputs(n, h, v, dtype, bias=False, scale=3.0):
    hidden = torch.randn(n, h, device=DEVICE).to(dtype)
    weight = (torch.randn(v, h, device=DEVICE) * scale / h**0.5).to(dtype)
    b = (torch.randn(v, device=DEVICE)).to(dtype) if bias else None
    return hidden, weight, b


def value_tol(hidden, weight, bias, temperature):
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    zmax = float(z.abs().max()) / temperature
    h = hidden.shape[-1]
    return 1e-5 + 8 * EPS32 * zmax * h**0.5 + 2 * ROUND[hidden.dtype] * zmax


def run_case(backend, hidden, weight, targets, bias=None, temperature=1.0, ignore_index=None, entropy=True,
             **kwargs):
    leaves = [x.detach().clone().requires_grad_(True) if x is not None else None for x in (hidden, weight, bias)]
    with fk.use_backend(backend):
        out = fk.linear_token_logprobs(
            leaves[0], leaves[1], targets, bias=leaves[2], temperature=temperature, return_entropy=entropy,
            ignore_index=ignore_index, **kwargs,
        )
        lp, ent = out if entropy else (out, None)
        g_lp, g_h = torch.randn_like(lp), torch.randn_like(lp)
        loss = (lp * g_lp).sum() + ((ent * g_h).sum() if entropy else 0.0)
        loss.backward()
    refs = [x.detach().double().requires_grad_(True) if x is not None else None for x in (hidden, weight, bias)]
    rlp, rent = linear_token_logprobs_spec(refs[0], refs[1], targets, refs[2], temperature, ignore_index)
    rloss = (rlp * g_lp.double()).sum() + ((rent * g_h.double()).sum() if entropy else 0.0)
    rloss.backward()
    got = (lp, ent, [x.grad if x is not None else None for x in leaves])
    ref = (rlp, rent if entropy else None, [x.grad if x is not None else None for x in refs])
    return got, ref


def assert_close_to_spec(got, ref, hidden, weight, bias, temperature):
    lp, ent, grads = got
    rlp, rent, rgrads = ref
    tol = value_tol(hidden, weight, bias, temperature)
    assert lp.dtype == torch.float32 and lp.shape == rlp.shape
    torch.testing.assert_close(lp.double(), rlp, atol=tol, rtol=0)
    if ent is not None:
        assert ent.dtype == torch.float32 and ent.shape == rent.shape
        torch.testing.assert_close(ent.double(), rent, atol=tol, rtol=0)
    for name, g, rg, x in zip(("hidden", "weight", "bias"), grads, rgrads, (hidden, weight, bias)):
        if x is None:
            continue
        assert g is not None, f"no gradient for {name}"
        assert g.dtype == x.dtype and g.shape == x.shape, name
        gmax = float(rg.abs().max())
        atol = (4 * max(ROUND[x.dtype], 1e-6) + 2 * tol) * gmax + 1e-12
        torch.testing.assert_close(g.double(), rg, atol=atol, rtol=0, msg=lambda m, name=name: f"grad {name}: {m}")


@pytest.fixture(params=["auto", "3x16"], ids=["tile-auto", "tile-3x16"])
def tiles(request, monkeypatch):
    """Default tiles (one tile at these sizes) and tiny tiles (many row and vocab tiles, ragged tails)."""
    if request.param != "auto":
        monkeypatch.setenv("FLASHRL_LINEAR_TILE", request.param)
    return request.param


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [24, 64])
@pytest.mark.parametrize("v", [50, 37])
def test_matches_reference(backend, dtype, h, v, tiles):
    hidden, weight, _ = make_inputs(8, h, v, dtype)
    targets = torch.randint(0, v, (8,), device=DEVICE)
    got, ref = run_case(backend, hidden, weight, targets, temperature=1.0)
    assert_close_to_spec(got, ref, hidden, weight, None, 1.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_temperature_ignore_index(backend, dtype, tiles):
    hidden, weight, bias = make_inputs(2 * 5, 40, 53, dtype, bias=True)
    hidden = hidden.view(2, 5, 40)  # leading dims are flattened and restored
    targets = torch.randint(0, 53, (2, 5), device=DEVICE)
    targets[0, 2] = -100
    targets[1, 4] = -100
    got, ref = run_case(backend, hidden, weight, targets, bias=bias, temperature=0.7, ignore_index=-100)
    assert got[0].shape == (2, 5) and got[0][0, 2] == 0 and got[1][1, 4] == 0
    assert_close_to_spec(got, ref, hidden, weight, bias, 0.7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp32_acc", [True, False])
@pytest.mark.parametrize("n, v", [(8, 50), (40, 21)])  # N <= V: vocab outer; N > V: rows outer
def test_loop_orders_and_accumulation(backend, fp32_acc, n, v, monkeypatch):
    monkeypatch.setenv("FLASHRL_LINEAR_TILE", "7x8")
    hidden, weight, bias = make_inputs(n, 24, v, torch.bfloat16, bias=True)
    targets = torch.randint(0, v, (n,), device=DEVICE)
    got, ref = run_case(backend, hidden, weight, targets, bias=bias, temperature=1.3,
                        fp32_grad_accumulation=fp32_acc)
    assert_close_to_spec(got, ref, hidden, weight, bias, 1.3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_only_and_frozen_weight(backend):
    hidden, weight, _ = make_inputs(6, 33, 45, torch.float32)
    targets = torch.randint(0, 45, (6,), device=DEVICE)
    h = hidden.clone().requires_grad_(True)
    with fk.use_backend(backend):
        lp = fk.linear_token_logprobs(h, weight, targets)  # weight does not require grad
        lp.sum().backward()
    hr = hidden.double().requires_grad_(True)
    rlp, _ = linear_token_logprobs_spec(hr, weight.double(), targets)
    rlp.sum().backward()
    torch.testing.assert_close(lp.double(), rlp, atol=1e-5, rtol=0)
    torch.testing.assert_close(h.grad.double(), hr.grad, atol=1e-5, rtol=0)
    assert weight.grad is None


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("v, h", [(32003, 40), (151936, 24)])
def test_large_vocab(backend, v, h):
    hidden, weight, bias = make_inputs(3, h, v, torch.bfloat16, bias=True, scale=4.0)
    targets = torch.randint(0, v, (3,), device=DEVICE)
    targets[1] = v - 1  # the last vocabulary row (ragged tail tile)
    got, ref = run_case(backend, hidden, weight, targets, bias=bias, temperature=1.1)
    assert_close_to_spec(got, ref, hidden, weight, bias, 1.1)


def test_equals_token_logprobs_of_materialised_logits():
    # fp32: the fused result is token_logprobs(hidden @ weight.T + bias) up to fp32 summation order
    hidden, weight, bias = make_inputs(9, 48, 77, torch.float32, bias=True)
    targets = torch.randint(0, 77, (9,), device=DEVICE)
    with fk.use_backend("torch"):
        a = fk.linear_token_logprobs(hidden, weight, targets, bias=bias, temperature=0.8, return_entropy=True)
        b = fk.token_logprobs(hidden @ weight.T + bias, targets, temperature=0.8, return_entropy=True)
    torch.testing.assert_close(a[0], b[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(a[1], b[1], atol=2e-5, rtol=0)
