"""The loss ops' one-launch merge + finalize on a GPU (flashrl_kernels/triton_impl/loss_finalize.py) against the torch
path it replaces (combine_stats + finalize), on random statistics rows, in Triton's interpreter on a CPU."""
import pytest
import torch
from conftest import DEVICE, available_backends

from flashrl_kernels.torch_impl import policy_loss as tp
from flashrl_kernels.torch_impl import value_loss as tv

pytestmark = pytest.mark.skipif(
    "triton" not in available_backends(DEVICE, op="policy_loss_forward"),
    reason="needs CUDA or TRITON_INTERPRET=1 for the triton backend")

AGGS = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum")


def lf():
    from flashrl_kernels.triton_impl import loss_finalize

    return loss_finalize


def _policy_rows(r, seed, empty_every=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(r, tp.N_STATS, generator=g).abs() * 10
    rows[:, 0] = torch.randint(0, 300, (r,), generator=g).float()  # n_tok
    rows[:, 1] = (rows[:, 0] > 0).float()
    if empty_every:
        rows[::empty_every] = 0.0
        rows[::empty_every, list(tp._MAX_COLS)] = float("-inf")  # what an empty program writes
        rows[::empty_every, list(tp._MIN_COLS)] = float("inf")
    return rows.to(DEVICE)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("norm", [None, "tensor", 1000.5])
@pytest.mark.parametrize("r", [1, 7, 200])
def test_policy_finalize_equals_the_torch_path(agg, norm, r):
    rows = _policy_rows(r, seed=r, empty_every=3 if r > 3 else 0)
    normalizer = torch.tensor(37.25, device=DEVICE) if norm == "tensor" else None
    divisor = norm if isinstance(norm, float) else 0.0
    loss, metrics, scale = lf().policy_finalize(rows, normalizer, divisor, agg)
    ref_loss, ref_metrics, ref_scale = tp._finalize_tensors(tp.combine_stats(rows), normalizer, divisor, agg, None, 0.0)
    assert loss.shape == () and scale.shape == () and metrics.shape == ref_metrics.shape
    assert loss.dtype == metrics.dtype == scale.dtype == torch.float32
    torch.testing.assert_close(scale, ref_scale, rtol=0, atol=0)  # the same fp32 divisor and reciprocal
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)  # fp32 sums in another order
    torch.testing.assert_close(metrics, ref_metrics, rtol=1e-6, atol=0)


def test_policy_finalize_propagates_nan_like_torch():
    rows = _policy_rows(20, seed=3)
    rows[5, 7] = float("nan")  # max_r of one program
    rows[6, 2] = float("nan")  # the loss sum
    loss, metrics, _ = lf().policy_finalize(rows, None, 0.0, "token-mean")
    ref_loss, ref_metrics, _ = tp._finalize_tensors(tp.combine_stats(rows), None, 0.0, "token-mean", None, 0.0)
    assert torch.isnan(loss) and torch.isnan(ref_loss)
    assert torch.equal(torch.isnan(metrics), torch.isnan(ref_metrics))
    assert bool(torch.isnan(metrics).any())


def _value_rows(nseq, group, seed):
    g = torch.Generator().manual_seed(seed)
    r = nseq * group
    rows = torch.randn(r, tv.N_STATS, generator=g)
    n = torch.randint(0, 50, (r,), generator=g).float()
    n[::5] = 0.0  # empty parts (and with group 1, empty sequences)
    rows[:, 0] = n
    rows[:, 1] = 0.0
    rows[:, 2:4] = rows[:, 2:4].abs() * n[:, None]
    rows[:, 7] = rows[:, 7].abs() * n  # second moments are >= 0
    rows[:, 9] = rows[:, 9].abs() * n
    rows[n == 0, 2:] = 0.0
    return rows.to(DEVICE)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("norm", [None, "tensor", 1000.1])
@pytest.mark.parametrize("nseq,group", [(1, 1), (5, 3), (70, 1), (33, 4)])
def test_value_finalize_equals_the_torch_path(agg, norm, nseq, group):
    rows = _value_rows(nseq, group, seed=nseq * 10 + group)
    normalizer = torch.tensor(37.25, device=DEVICE) if norm == "tensor" else None
    divisor = norm if isinstance(norm, float) else 0.0
    loss, metrics, scale = lf().value_finalize(rows, group, normalizer, divisor, agg)
    ref_loss, ref_metrics, ref_scale = tv._finalize_tensors(tv.combine_stats(rows, group=group), normalizer,
                                                            divisor, agg)
    assert metrics.shape == ref_metrics.shape == (lf().N_VALUE_METRICS,)
    # float64 throughout: the fp32 outputs agree up to the last bit's rounding (sums in another order)
    for got, want in ((loss, ref_loss), (metrics, ref_metrics), (scale, ref_scale)):
        torch.testing.assert_close(got, want, rtol=2e-7, atol=1e-12)


def test_value_metric_count_matches_the_public_names():
    from flashrl_kernels.ops.value_loss import VALUE_METRIC_NAMES

    assert lf().N_VALUE_METRICS == len(VALUE_METRIC_NAMES)


def test_value_divisor_is_carried_in_float64():
    # a divisor that fp32 cannot hold: the hi + lo halves give the torch path's float64 divisor
    rows = _value_rows(4, 1, seed=1)
    d = 1000.0 + 1e-5
    _, _, scale = lf().value_finalize(rows, 1, None, d, "token-mean")
    _, _, ref = tv._finalize_tensors(tv.combine_stats(rows, group=1), None, d, "token-mean")
    assert float(scale) == float(ref)
