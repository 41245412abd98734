"""Native CPU policy_loss beyond the shared suite: long sequences (several tiles, ragged tails),
batches split into several parallel blocks, mixed input dtypes, thread-count independence."""

import pytest
import torch
from _policy_loss_util import assert_close_masked, make_inputs, run, spec, to_packed

import flashrl_kernels as fk
from flashrl_kernels import _backend
from flashrl_kernels.loss_config import METRIC_NAMES

needs_native = pytest.mark.skipif(not _backend.native_built(), reason="native CPU kernels not built here")

CONFIGS = [
    fk.LossConfig(eps_low=0.2, eps_high=0.28, tis_mode="token_truncate", beta=0.04, entropy_coef=0.01),
    fk.LossConfig(importance_sampling_level="sequence", tis_mode="sequence_mask", tis_min=0.5, tis_max=1.5,
                  tis_sequence_reduce="mean", loss_agg_mode="seq-mean-token-mean", dual_clip=3.0),
    fk.LossConfig(importance_sampling_level="sequence_token", tis_mode="token_mask", tis_min=0.8, tis_max=1.2,
                  loss_agg_mode="seq-mean-token-sum", beta=0.1),
    fk.LossConfig(importance_sampling_level="sequence", tis_mode="token_truncate", tis_max=1.5,
                  loss_agg_mode="token-sum", beta=0.02, entropy_coef=0.01, dual_clip=2.0),
]
IDS = ["token-tis", "gspo-seqtis", "gspo-token", "gspo-token-sum"]


def _check(inp, cfg, *, atol_loss=2e-5, atol_grad=2e-6, rtol_grad=1e-5):
    loss, metrics, gl, ge = run(inp, cfg, "native")
    e_loss, e_metrics, e_gl, e_ge = spec(inp, cfg)
    mask = inp.get("mask")
    torch.testing.assert_close(loss.double(), e_loss, atol=atol_loss, rtol=2e-5)
    assert_close_masked(gl, e_gl, mask, atol=atol_grad, rtol=rtol_grad)
    assert_close_masked(ge, e_ge, mask, atol=atol_grad, rtol=rtol_grad)
    for k in METRIC_NAMES:
        torch.testing.assert_close(metrics[k].double(), e_metrics[k], atol=2e-5, rtol=2e-5, msg=k)


@needs_native
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
@pytest.mark.parametrize("packed", [False, True])
def test_long_sequences_and_several_blocks_vs_spec(cfg, packed):
    # T = 1100: two full 512-token tiles and a 76-token tail (not a multiple of the vector width);
    # 24 x 1100 tokens span two of the kernel's ~16k-token parallel blocks
    inp = make_inputs(b=24, t=1100, per_token_adv=packed)
    _check(to_packed(inp) if packed else inp, cfg)


@needs_native
@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=["token-tis", "gspo-seqtis"])
def test_mixed_input_dtypes_vs_spec(cfg):
    inp = make_inputs(b=6, t=70)
    dtypes = {"logp": torch.bfloat16, "old_logp": torch.float16, "rollout_logp": torch.float32,
              "ref_logp": torch.bfloat16, "entropy": torch.float16, "advantages": torch.bfloat16}
    for k, dt in dtypes.items():
        inp[k] = inp[k].to(dt)  # the spec reads the same rounded values in float64
    _check(inp, cfg, rtol_grad=2.0**-8)  # gradients come back in the inputs' 16-bit dtypes


@needs_native
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_thread_count_does_not_change_results(cfg):
    inp = to_packed(make_inputs(b=40, t=900))
    old = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            loss, metrics, gl, ge = run(inp, cfg, "native")
            results.append((loss, torch.stack([metrics[k] for k in METRIC_NAMES]), gl, ge))
    finally:
        torch.set_num_threads(old)
    for a, b in zip(*results):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


@needs_native
def test_matches_torch_backend_on_a_large_batch(monkeypatch):
    """Both CPU backends on one 64 x 2000 batch, every term on: they agree to fp32 rounding."""
    monkeypatch.setenv("FLASHRL_TORCH_COMPILE", "0")  # eager torch math; its compiled form is tested elsewhere
    inp = make_inputs(b=64, t=2000)
    cfg = CONFIGS[0]
    out = {b: run(inp, cfg, b) for b in ("native", "torch")}
    torch.testing.assert_close(out["native"][0], out["torch"][0], atol=1e-6, rtol=1e-5)
    mask = inp["mask"]
    assert_close_masked(out["native"][2], out["torch"][2], mask, atol=1e-7)
    for k in METRIC_NAMES:
        torch.testing.assert_close(out["native"][1][k], out["torch"][1][k], atol=1e-6, rtol=1e-5, msg=k)


def test_backward_with_grad_loss_and_gspo_sequence_coefficients():
    """The backward scales by the upstream gradient and adds seq_coef only at valid tokens."""
    if not _backend.native_built():
        pytest.skip("native CPU kernels not built here")
    inp = make_inputs(b=5, t=40)
    cfg = CONFIGS[1]
    lp = inp["logp"].clone().requires_grad_(True)
    with fk.use_backend("native"):
        out = fk.policy_loss(lp, inp["old_logp"], inp["advantages"], mask=inp["mask"],
                             rollout_logp=inp["rollout_logp"], config=cfg)
        (out.loss * 3.5).backward()
    _, _, e_g, _ = spec(inp, cfg, keys=("rollout_logp",))
    assert_close_masked(lp.grad, e_g * 3.5, inp["mask"], atol=1e-5)
    assert (lp.grad[~inp["mask"]] == 0).all()
