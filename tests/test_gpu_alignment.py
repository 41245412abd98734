"""The aligned streaming loops of the Triton kernels (docs/gpu.md, "Load width"), against the float64 spec.

Every row or sequence loop starts at its first element rounded down to a multiple of ALIGN (16) elements: tiles
inside the row load without a mask (128-bit loads on a GPU), the first and the last with one. Here the block sizes
are lowered to 16 so that, at interpreter sizes, rows and packed sequences starting at arbitrary offsets go through
masked heads, unmasked middles and masked tails, with NaN at masked-out positions that the unmasked loads now
read (they must never reach a result). Rows of 37 / 45 elements: every start offset modulo 16 occurs.
"""
import pytest
import torch
from conftest import DEVICE, available_backends

import flashrl_kernels as fk

pytestmark = [
    pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's block sizes are lowered"),
    pytest.mark.skipif("triton" not in available_backends("cpu", op="policy_loss_forward"),
                       reason="needs TRITON_INTERPRET=1 for the triton backend"),
]


@pytest.fixture(autouse=True)
def _eager_torch(monkeypatch):
    monkeypatch.setenv("FLASHRL_TORCH_COMPILE", "0")


def test_same_phase():
    from flashrl_kernels.triton_impl.logprobs import ALIGN, same_phase

    v = 32003
    assert same_phase([(3 * v, 2), (v, 3)], [(3 * v, 2), (v, 3)])              # contiguous logits: own grad rows
    assert not same_phase([(4 * v, 2), (v, 3)], [(3 * v, 2), (v, 3)])          # logits[:, :-1]: rows drift
    assert same_phase([(4 * v, 1), (v, 3)], [(3 * v, 1), (v, 3)])              # one batch row: its stride is moot
    assert same_phase([(4 * 32000, 2), (32000, 3)], [(3 * 32000, 2), (32000, 3)])  # V a multiple of ALIGN
    assert ALIGN == 16


# ---- token_logprobs and the fused linear's tile epilogues: rows at every offset modulo 16 ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "sliced"])
def test_token_logprobs_aligned_tiles(monkeypatch, dtype, strided):
    from test_token_logprobs import assert_close_to_spec, make_logits, run_case

    from flashrl_kernels.triton_impl import logprobs as tlp

    monkeypatch.setattr(tlp, "block_v", lambda v: 16)
    full = make_logits((3, 8, 37), dtype, neg_inf_frac=0.05)
    logits = full[:, :-1, :] if strided else full  # sliced: gradient rows out of phase with the logits rows
    targets = torch.randint(0, 37, logits.shape[:2])
    got, ref = run_case("triton", logits, targets, 0.8, ignore_index=None)
    assert_close_to_spec(got, ref, logits, 0.8, "triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_tiles_aligned(monkeypatch, dtype, bias):
    from test_linear_logprobs import assert_close_to_spec, make_inputs, run_case

    from flashrl_kernels.triton_impl import linear_logprobs as tll

    monkeypatch.setattr(tll, "block_v", lambda v: 16)
    monkeypatch.setenv("FLASHRL_LINEAR_TILE", "5x37")  # tile rows of 37 columns; the last vocab block has 19
    hidden, weight, b = make_inputs(9, 24, 93, dtype, bias=bias)
    targets = torch.randint(0, 93, (9,))
    got, ref = run_case("triton", hidden, weight, targets, bias=b, temperature=0.9)
    assert_close_to_spec(got, ref, hidden, weight, b, 0.9)


def test_fused_policy_head_aligned(monkeypatch):
    from flashrl_kernels.triton_impl import linear_logprobs as tll

    monkeypatch.setattr(tll, "block_v", lambda v: 16)
    monkeypatch.setenv("FLASHRL_LINEAR_TILE", "4x37")
    hidden = torch.randn(2, 5, 16)
    weight = torch.randn(77, 16) / 4
    targets = torch.randint(0, 77, (2, 5))
    old = torch.randn(2, 5) * 0.1 - 3.0
    adv = torch.randn(2)
    outs = {}
    for backend in ("triton", "torch"):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        with fk.use_backend(backend):
            out = fk.linear_policy_loss(h, w, targets, old, adv)
            out.loss.backward()
        outs[backend] = (out.loss.detach(), h.grad, w.grad)
    for a, b in zip(outs["triton"], outs["torch"]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


# ---- policy_loss / value_loss / gae: sequences at runtime cu_seqlens offsets ----

@pytest.mark.parametrize("level,tis_mode,agg", [("token", "token_truncate", "token-mean"),
                                                ("sequence", "sequence_mask", "seq-mean-token-mean"),
                                                ("sequence_token", "token_mask", "seq-mean-token-sum")])
@pytest.mark.parametrize("layout", ["padded", "packed_mask"])
def test_policy_loss_aligned_tiles(monkeypatch, level, tis_mode, agg, layout):
    from _policy_loss_util import assert_close_masked, make_inputs, run, spec, to_packed

    from flashrl_kernels.triton_impl import policy_loss as tp

    monkeypatch.setattr(tp, "_block", lambda n, nseq, uniform_len: (16, 1))
    inp = make_inputs(b=5, t=45, per_token_adv=True)  # rows start at 45 * i: every phase; NaN in the padding
    if layout == "packed_mask":
        inp = to_packed(inp)
        keep = torch.rand(inp["logp"].shape) > 0.25
        inp["mask"] = keep
        for k in ("logp", "old_logp", "rollout_logp", "ref_logp", "entropy", "advantages"):
            inp[k] = torch.where(keep, inp[k], float("nan"))  # masked-out tokens: loaded unmasked, never used
    cfg = fk.LossConfig(importance_sampling_level=level, tis_mode=tis_mode, loss_agg_mode=agg, beta=0.05,
                        entropy_coef=0.01, dual_clip=3.0)
    loss, metrics, gl, ge = run(inp, cfg, "triton")
    e_loss, e_metrics, e_gl, e_ge = spec(inp, cfg)
    torch.testing.assert_close(loss.double(), e_loss, atol=2e-5, rtol=2e-5)
    assert_close_masked(gl, e_gl, inp.get("mask"), atol=2e-6)
    assert_close_masked(ge, e_ge, inp.get("mask"), atol=2e-6)
    for k in metrics:
        torch.testing.assert_close(metrics[k].double(), e_metrics[k], atol=2e-5, rtol=2e-5, msg=k)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("split", [1, 3])
def test_value_loss_aligned_tiles(monkeypatch, agg, split):
    from test_value_loss import CLIP, assert_matches_spec, make_padded, to_packed

    from flashrl_kernels.triton_impl import value_loss as tv

    monkeypatch.setattr(tv, "_launch_config", lambda n, nseq, uniform_len, device: (16, split, 1))
    inp = make_padded(b=5, t=45)
    assert_matches_spec(inp, "triton", clip_range=CLIP, loss_agg_mode=agg)
    assert_matches_spec(to_packed(inp), "triton", clip_range=CLIP, loss_agg_mode=agg)


def test_value_loss_backward_full_blocks():
    # N = 4500 tokens: two full 2048-token blocks of the flat backward kernel (unmasked) and a masked tail
    from test_value_loss import assert_matches_spec, to_packed

    lengths = torch.tensor([1499, 1, 3000])
    t = 3000
    mask = torch.arange(t)[None, :] < lengths[:, None]
    ret = torch.randn(3, t)
    val = ret + 0.3 * torch.randn(3, t)
    inp = {"values": val, "old_values": val + 0.1, "returns": ret, "mask": mask, "lengths": lengths}
    assert_matches_spec(to_packed(inp), "triton", clip_range=0.2, loss_agg_mode="token-mean")


@pytest.mark.parametrize("whiten", [False, True])
def test_gae_aligned_blocks(monkeypatch, whiten):
    from test_gae import assert_valid_close, padded_inputs, run, to_packed

    from flashrl_kernels.reference import gae_spec
    from flashrl_kernels.triton_impl import gae as tg

    monkeypatch.setattr(tg, "MAX_BLOCK", 16)
    r, v, mask, _, _ = padded_inputs(4, 45)
    lam = torch.rand(4)
    out = run("triton", r, v, mask=mask, gamma=0.97, lam=lam, critic_lam=0.9, whiten=whiten)
    e_adv, e_ret = gae_spec(r, v, mask=mask, gamma=0.97, lam=lam, critic_lam=0.9, whiten=whiten)
    assert_valid_close(out.advantages, e_adv, mask, atol=2e-5)
    assert_valid_close(out.returns, e_ret, mask)
    # packed: sequences at the cumulative offsets of the valid counts, blocks ending at multiples of 16
    rp, cu = to_packed(r, mask)
    vp, _ = to_packed(v, mask)
    out = run("triton", rp, vp, cu_seqlens=cu, gamma=0.97, lam=lam, critic_lam=0.9, whiten=whiten)
    valid = torch.ones_like(mask).cumsum(1) <= mask.sum(1, keepdim=True)  # each row's first count positions
    e_adv, e_ret = gae_spec(torch.zeros_like(r).masked_scatter(valid, rp), torch.zeros_like(v).masked_scatter(valid, vp),
                            mask=valid, gamma=0.97, lam=lam, critic_lam=0.9, whiten=whiten)
    torch.testing.assert_close(out.advantages.double(), e_adv[valid], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out.returns.double(), e_ret[valid], atol=1e-5, rtol=1e-5)


def test_gae_whiten_full_blocks():
    # 2100 tokens: two full 1024-token blocks of the flat whitening kernel and a masked tail
    from test_gae import assert_valid_close, padded_inputs, run

    from flashrl_kernels.reference import gae_spec

    r, v, mask, _, _ = padded_inputs(3, 700)
    out = run("triton", r, v, mask=mask, gamma=0.99, lam=0.95, whiten=True)
    e_adv, _ = gae_spec(r, v, mask=mask, gamma=0.99, lam=0.95, whiten=True)
    assert_valid_close(out.advantages, e_adv, mask, atol=5e-5)
