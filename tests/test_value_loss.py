"""value_loss on every backend vs the float64 spec and vs verl's formula written out; layouts, dtypes, errors."""
import pytest
import torch
from conftest import available_backends

import flashrl_kernels as fk
from flashrl_kernels.loss_config import LOSS_AGG_MODES
from flashrl_kernels.reference import value_loss_spec

BACKENDS = available_backends("cpu", op="value_loss_forward")  # reference, torch, native, triton (interpreter)
FAST = [b for b in BACKENDS if b != "reference"]
NAMES = fk.VALUE_METRIC_NAMES
CLIP = 0.2


@pytest.fixture(autouse=True)
def _eager_torch(monkeypatch):
    # the compiled CPU path of the torch backend is checked once, in test_compiled_cpu_torch_path
    monkeypatch.setenv("FLASHRL_TORCH_COMPILE", "0")


def make_padded(b=5, t=12, *, values_dtype=torch.float32, other_dtype=torch.float32, offset=0.0, holes=True):
    """[B, T] inputs with right padding and holes; row 0 full, row 1 one token, row 2 empty; NaN in padding."""
    lengths = torch.randint(2, t + 1, (b,))
    lengths[0], lengths[1], lengths[2] = t, 1, 0
    mask = torch.arange(t)[None, :] < lengths[:, None]
    if holes:
        hole = torch.rand(b, t) < 0.15
        hole[0, 0] = hole[1, 0] = False
        mask &= ~hole
    ret = torch.randn(b, t) + offset
    old = ret + 0.5 * torch.randn(b, t)
    val = old + 0.4 * torch.randn(b, t)  # often farther than CLIP from old: some tokens clip, some do not
    for x in (ret, old, val):
        x[~mask] = float("nan")  # padding values must never matter
    return {"values": val.to(values_dtype), "old_values": old.to(other_dtype), "returns": ret.to(other_dtype),
            "mask": mask, "lengths": lengths}


def to_packed(inp):
    """The same batch as packed [total] tensors: each row's first `length` positions (holes stay in the mask)."""
    t = inp["values"].shape[1]
    keep = torch.arange(t)[None, :] < inp["lengths"][:, None]
    out = {k: inp[k][keep] for k in ("values", "old_values", "returns", "mask")}
    out["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.int32), inp["lengths"].cumsum(0).to(torch.int32)])
    return out


def run(inp, backend, *, grad_scale=3.0, **kw):
    """value_loss on `backend`; (loss, metrics, grad of grad_scale * loss w.r.t. values)."""
    x = inp["values"].clone().requires_grad_(True)
    extra = {k: inp[k] for k in ("mask", "cu_seqlens") if k in inp}
    with fk.use_backend(backend):
        out = fk.value_loss(x, inp["old_values"], inp["returns"], **extra, **kw)
        (out.loss * grad_scale).backward()  # grad_loss != 1
    return out.loss, out.metrics, x.grad


def spec(inp, *, grad_scale=3.0, **kw):
    x = inp["values"].double().requires_grad_(True)
    extra = {k: inp[k] for k in ("mask", "cu_seqlens") if k in inp}
    loss, metrics = value_loss_spec(x, inp["old_values"], inp["returns"], **extra, **kw)
    (g,) = torch.autograd.grad(loss * grad_scale, [x])
    return loss, metrics, g


def assert_matches_spec(inp, backend, *, atol=2e-6, **kw):
    loss, metrics, g = run(inp, backend, **kw)
    e_loss, e_metrics, e_g = spec(inp, **kw)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss.double(), e_loss, atol=atol, rtol=2e-5)
    m = inp.get("mask")
    assert g.dtype == inp["values"].dtype
    if m is not None:
        assert torch.all(g[~m] == 0), "masked positions must get a zero gradient"
    # the gradient is rounded once to the values' dtype at the end
    rtol = {torch.bfloat16: 2**-8, torch.float16: 2**-11}.get(g.dtype, 2e-5)
    torch.testing.assert_close(torch.where(m, g.double(), 0.0) if m is not None else g.double(),
                               torch.where(m, e_g, 0.0) if m is not None else e_g, atol=atol, rtol=rtol)
    assert list(metrics) == list(NAMES)
    for k in NAMES:
        assert metrics[k].dim() == 0 and metrics[k].dtype == torch.float32 and not metrics[k].requires_grad
        torch.testing.assert_close(metrics[k].double(), e_metrics[k], atol=atol, rtol=2e-5, msg=k)
    return loss, metrics, g


# ---- verl 0.9.1 compute_value_loss + agg_loss (dp_size=1), and the metrics, written out plainly ----

def verl_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode):
    mask = response_mask.float()
    vf_losses1 = (vpreds - returns) ** 2
    if cliprange_value is None:
        clipped_vf_losses = vf_losses1
        vf_losses2 = vf_losses1
    else:
        vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
        vf_losses2 = (vpredclipped - returns) ** 2
        clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    loss_mat = torch.where(mask.bool(), clipped_vf_losses, 0.0)
    if loss_agg_mode == "token-mean":
        agg = loss_mat.sum() / mask.sum()
    elif loss_agg_mode == "token-sum":
        agg = loss_mat.sum()
    elif loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = loss_mat.sum(-1)
        seq_mask = (mask.sum(-1) > 0).float()
        agg = (seq_losses * seq_mask).sum() / seq_mask.sum()
        if loss_agg_mode == "seq-mean-token-sum-norm":
            agg = agg / mask.shape[-1]
    else:  # seq-mean-token-mean
        count = mask.sum(-1)
        seq_losses = loss_mat.sum(-1) / (count + 1e-8)
        seq_mask = (count > 0).float()
        agg = (seq_losses * seq_mask).sum() / seq_mask.sum()
    vf_loss = 0.5 * agg
    clipfrac = (torch.gt(vf_losses2, vf_losses1).float() * mask).sum() / (mask.sum() + 1e-8)
    v, r = vpreds.detach()[response_mask], returns[response_mask]
    metrics = {
        "vf_clip_frac": clipfrac,
        "explained_variance": 1.0 - torch.var(r - v, unbiased=False) / torch.var(r, unbiased=False),
        "value_mean": v.mean(), "return_mean": r.mean(), "value_error_mean": ((v - r) ** 2).mean(),
        "num_tokens": mask.sum(),
    }
    return vf_loss, metrics


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("clip", [None, CLIP])
@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_padded_vs_spec_and_verl(backend, clip, agg):
    inp = make_padded()
    loss, metrics, g = assert_matches_spec(inp, backend, clip_range=clip, loss_agg_mode=agg)
    if clip is not None:
        assert 0.0 < float(metrics["vf_clip_frac"]) < 1.0, "the inputs must exercise both branches"
    else:
        assert float(metrics["vf_clip_frac"]) == 0.0

    # verl, on finite padding (its masked sums would turn padded NaN into NaN gradients)
    m = inp["mask"]
    vals = [torch.nan_to_num(inp[k], nan=7.0) for k in ("values", "old_values", "returns")]
    x = vals[0].clone().requires_grad_(True)
    v_loss, v_metrics = verl_value_loss(x, vals[2], vals[1], m, clip, agg)
    (v_loss * 3.0).backward()
    # verl 0.9.1's seq-mean-token-sum-norm divides by (non-empty sequences * T): flashrl's T-only default times n_seq
    n_seq = float((m.sum(-1) > 0).sum())
    expect = v_loss * (n_seq if agg == "seq-mean-token-sum-norm" else 1.0)
    torch.testing.assert_close(loss, expect.detach(), atol=2e-6, rtol=2e-5)
    g_expect = x.grad * (n_seq if agg == "seq-mean-token-sum-norm" else 1.0)
    torch.testing.assert_close(torch.where(m, g, 0.0), torch.where(m, g_expect, 0.0), atol=2e-6, rtol=2e-5)
    for k in NAMES:
        torch.testing.assert_close(metrics[k], v_metrics[k].float(), atol=2e-5, rtol=2e-5, msg=k)
    if agg == "seq-mean-token-sum-norm":  # with verl's divisor passed as the normalizer, no rescaling at all
        loss_n, _, g_n = run(inp, backend, clip_range=clip, loss_agg_mode=agg, normalizer=n_seq * m.shape[1])
        torch.testing.assert_close(loss_n, v_loss.detach(), atol=2e-6, rtol=2e-5)
        torch.testing.assert_close(torch.where(m, g_n, 0.0), torch.where(m, x.grad, 0.0), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_packed_with_empty_and_single_token_sequences(backend, agg):
    inp = make_padded(b=6, t=9)
    packed = to_packed(inp)
    assert (packed["cu_seqlens"][1:] - packed["cu_seqlens"][:-1]).tolist()[1:3] == [1, 0]
    norm = 9.0 if agg == "seq-mean-token-sum-norm" else None  # packed needs the padded default spelled out
    loss, metrics, g = assert_matches_spec(packed, backend, clip_range=CLIP, loss_agg_mode=agg, normalizer=norm)
    loss_p, metrics_p, g_p = run(inp, backend, clip_range=CLIP, loss_agg_mode=agg)
    torch.testing.assert_close(loss, loss_p, atol=1e-6, rtol=1e-5)
    keep = torch.arange(9)[None, :] < inp["lengths"][:, None]
    torch.testing.assert_close(g, g_p[keep], atol=1e-6, rtol=1e-5)
    for k in NAMES:
        torch.testing.assert_close(metrics[k], metrics_p[k], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_without_mask(backend):
    lens = torch.tensor([5, 0, 1, 7, 3])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    n = int(lens.sum())
    ret = torch.randn(n)
    old = ret + 0.5 * torch.randn(n)
    inp = {"values": old + 0.4 * torch.randn(n), "old_values": old, "returns": ret, "cu_seqlens": cu}
    for agg in ("token-mean", "seq-mean-token-mean"):
        assert_matches_spec(inp, backend, clip_range=CLIP, loss_agg_mode=agg)


@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_values_and_mixed_dtypes(backend):
    inp = make_padded(b=4, t=33, values_dtype=torch.bfloat16, other_dtype=torch.float16)
    inp["returns"] = inp["returns"].double()  # any float dtype for the targets
    _, _, g = assert_matches_spec(inp, backend, clip_range=CLIP, loss_agg_mode="seq-mean-token-mean", atol=1e-5)
    assert g.dtype == torch.bfloat16
    inp = make_padded(b=3, t=17, values_dtype=torch.float16)
    _, _, g = assert_matches_spec(inp, backend, clip_range=0.3, atol=1e-5)
    assert g.dtype == torch.float16


@pytest.mark.parametrize("backend", BACKENDS)
def test_normalizer_float_and_tensor(backend):
    inp = make_padded()
    for agg in ("token-mean", "seq-mean-token-mean"):
        for norm in (37.0, torch.tensor(37.0)):
            assert_matches_spec(inp, backend, clip_range=CLIP, loss_agg_mode=agg, normalizer=norm)
    loss, _, _ = run(inp, backend, loss_agg_mode="token-sum")
    loss_n, _, _ = run(inp, backend, loss_agg_mode="token-sum", normalizer=torch.tensor(4.0))
    torch.testing.assert_close(loss_n, loss / 4.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_explained_variance_at_a_large_offset(backend):
    """returns around 1000 with unit spread: E[x^2] - E[x]^2 in fp32 would be noise; the centred moments are not."""
    inp = make_padded(b=6, t=40, offset=1000.0)
    _, metrics, _ = run(inp, backend, clip_range=CLIP)
    _, e_metrics, _ = spec(inp, clip_range=CLIP)
    assert 0.0 < float(e_metrics["explained_variance"]) < 1.0 or float(e_metrics["explained_variance"]) < 0.0
    torch.testing.assert_close(metrics["explained_variance"].double(), e_metrics["explained_variance"],
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_degenerate_cases(backend):
    # constant returns: Var(R) = 0, explained_variance is defined as 0
    inp = make_padded(b=3, t=8)
    inp["returns"] = torch.where(inp["mask"], 0.5, float("nan"))
    _, metrics, _ = assert_matches_spec(inp, backend, clip_range=CLIP)
    assert float(metrics["explained_variance"]) == 0.0
    # an all-masked batch: loss 0, zero gradient, every metric finite (0)
    inp["mask"] = torch.zeros_like(inp["mask"])
    for agg in LOSS_AGG_MODES:
        loss, metrics, g = run(inp, backend, clip_range=CLIP, loss_agg_mode=agg)
        assert float(loss.detach()) == 0.0 and torch.all(g == 0)
        assert all(float(v) == 0.0 for v in metrics.values())
    # packed with no tokens at all
    x = torch.zeros(0, requires_grad=True)
    with fk.use_backend(backend):
        out = fk.value_loss(x, torch.zeros(0), torch.zeros(0), cu_seqlens=torch.tensor([0, 0, 0]), clip_range=CLIP,
                            loss_agg_mode="seq-mean-token-mean")
        out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and x.grad.shape == (0,)
    assert all(float(v) == 0.0 for v in out.metrics.values())
    # without clip_range old_values is never read
    inp = make_padded(b=3, t=8)
    inp["old_values"] = torch.full_like(inp["old_values"], float("nan"))
    loss, _, g = run(inp, backend)
    assert torch.isfinite(loss) and torch.isfinite(g).all()


def test_triton_multi_part_programs(monkeypatch):
    """Force several tiles per program and several programs per sequence: the Chan merges and the n_seq recount."""
    if "triton" not in BACKENDS:
        pytest.skip("triton unavailable")
    from flashrl_kernels.triton_impl import value_loss as tv

    monkeypatch.setattr(tv, "_launch_config", lambda n, nseq, uniform_len, device: (16, 3, 1))
    inp = make_padded(b=4, t=100, offset=3.0)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert_matches_spec(inp, "triton", clip_range=CLIP, loss_agg_mode=agg)
        assert_matches_spec(to_packed(inp), "triton", clip_range=CLIP, loss_agg_mode=agg)


@pytest.mark.parametrize("backend", [b for b in FAST if b != "triton"])
def test_long_sequences_split_over_work_items(backend):
    """Sequences longer than the native kernel's 16384-token work items, next to short ones."""
    lens = torch.tensor([17000, 0, 1, 2500, 16384])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    n = int(lens.sum())
    ret = torch.randn(n) + 2.0
    old = ret + 0.5 * torch.randn(n)
    inp = {"values": old + 0.4 * torch.randn(n), "old_values": old, "returns": ret, "cu_seqlens": cu,
           "mask": torch.rand(n) > 0.1}
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert_matches_spec(inp, backend, clip_range=CLIP, loss_agg_mode=agg, atol=1e-5)


# ---- the torch op: opcheck, torch.compile ----

def _op_args(packed, need_grad=True):
    b, t = 3, 6
    v = torch.randn(b * t)
    cu = torch.tensor([0, 6, 6, 18]) if packed else torch.arange(b + 1) * t
    return (v.requires_grad_(True), v.detach() + 0.3 * torch.randn(b * t), torch.randn(b * t),
            torch.rand(b * t) > 0.3, cu, None, CLIP, "seq-mean-token-mean", 0.0, 0 if packed else t, need_grad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packed", [False, True])
def test_opcheck(backend, packed):
    args = _op_args(packed)
    with fk.use_backend(backend):
        torch.library.opcheck(torch.ops.flashrl.value_loss.default, args)
        with torch.no_grad():
            _, _, g_tok, scale = torch.ops.flashrl.value_loss(*args)
        torch.library.opcheck(torch.ops.flashrl.value_loss_backward.default,
                              (torch.tensor(1.3), g_tok, scale, torch.bfloat16))
        with torch.no_grad():
            out = torch.ops.flashrl.value_loss(*_op_args(packed, need_grad=False))
        assert out[2].shape == (0,)  # no gradient wanted: g_tok is never written


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_without_gradient(backend):
    """Under no_grad (or for values without requires_grad) the op skips g_tok; loss and metrics are unchanged."""
    inp = make_padded()
    loss, metrics, _ = run(inp, backend, clip_range=CLIP, loss_agg_mode="seq-mean-token-mean")
    with fk.use_backend(backend):
        with torch.no_grad():
            out = fk.value_loss(inp["values"].clone().requires_grad_(True), inp["old_values"], inp["returns"],
                                mask=inp["mask"], clip_range=CLIP, loss_agg_mode="seq-mean-token-mean")
        out2 = fk.value_loss(inp["values"], inp["old_values"], inp["returns"], mask=inp["mask"], clip_range=CLIP,
                             loss_agg_mode="seq-mean-token-mean")
    for o in (out, out2):
        assert not o.loss.requires_grad
        torch.testing.assert_close(o.loss, loss.detach())
        for k in NAMES:
            torch.testing.assert_close(o.metrics[k], metrics[k])


def _loss_fn(v, old, ret, mask, norm):
    out = fk.value_loss(v, old, ret, mask=mask, clip_range=CLIP, loss_agg_mode="seq-mean-token-sum",
                        normalizer=norm)
    return out.loss * 2.0, out.metrics["vf_clip_frac"], out.metrics["explained_variance"]


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(compile_backend):
    torch._dynamo.reset()
    inp = make_padded(b=3, t=7)
    args = (inp["old_values"], inp["returns"], inp["mask"], torch.tensor(5.0))
    x1 = inp["values"].clone().requires_grad_(True)
    x2 = inp["values"].clone().requires_grad_(True)
    out1 = torch.compile(_loss_fn, fullgraph=True, backend=compile_backend)(x1, *args)
    out1[0].backward()
    out2 = _loss_fn(x2, *args)
    out2[0].backward()
    for a, b in zip(out1, out2):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(x1.grad, x2.grad, equal_nan=True)


def test_compiled_cpu_torch_path(monkeypatch):
    """The torch backend compiles its token math with Inductor on CPU; it must equal the spec, padded and packed."""
    monkeypatch.setenv("FLASHRL_TORCH_COMPILE", "1")
    from flashrl_kernels.torch_impl import value_loss as tv

    before = len(tv._compiled)
    for b, t in ((4, 9), (5, 13)):  # two shapes: dynamic, one compile per layout
        inp = make_padded(b=b, t=t)
        for layout in (inp, to_packed(inp)):
            assert_matches_spec(layout, "torch", clip_range=CLIP, loss_agg_mode="seq-mean-token-mean")
    assert not tv._compile_broken, tv._compile_broken
    assert len(tv._compiled) == before + 1


# ---- bad inputs ----

def _good():
    inp = make_padded(b=3, t=5, holes=False)  # row 0 valid throughout
    return inp["values"], inp["old_values"], inp["returns"], inp["mask"]


def test_bad_shapes_dtypes_devices():
    v, old, ret, mask = _good()
    with pytest.raises(ValueError, match="old_values must have the shape"):
        fk.value_loss(v, old[:, :4], ret, mask=mask)
    with pytest.raises(ValueError, match="returns must have the shape"):
        fk.value_loss(v, old, ret[:2], mask=mask)
    with pytest.raises(ValueError, match="mask must have the shape"):
        fk.value_loss(v, old, ret, mask=mask[:, :4])
    with pytest.raises(ValueError, match="padded inputs must be"):
        fk.value_loss(v.reshape(-1), old.reshape(-1), ret.reshape(-1))
    with pytest.raises(ValueError, match="empty batch"):
        fk.value_loss(v[:0], old[:0], ret[:0])
    with pytest.raises(TypeError, match="values must have dtype"):
        fk.value_loss(v.double(), old, ret, mask=mask)
    with pytest.raises(TypeError, match="returns must have dtype"):
        fk.value_loss(v, old, ret.long(), mask=mask)
    with pytest.raises(TypeError, match="old_values must be a torch.Tensor"):
        fk.value_loss(v, 0.5, ret, mask=mask)
    with pytest.raises(ValueError, match="returns is on meta"):
        fk.value_loss(v, old, ret.to("meta"), mask=mask)


def test_bad_options():
    v, old, ret, mask = _good()
    for bad in (0.0, -0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="clip_range"):
            fk.value_loss(v, old, ret, mask=mask, clip_range=bad)
    for bad in ("0.2", True, torch.tensor(0.2)):
        with pytest.raises(TypeError, match="clip_range"):
            fk.value_loss(v, old, ret, mask=mask, clip_range=bad)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        fk.value_loss(v, old, ret, mask=mask, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="normalizer"):
        fk.value_loss(v, old, ret, mask=mask, normalizer=0)
    with pytest.raises(ValueError, match="normalizer"):
        fk.value_loss(v, old, ret, mask=mask, normalizer=torch.ones(2))
    with pytest.raises(TypeError, match="normalizer"):
        fk.value_loss(v, old, ret, mask=mask, normalizer="10")


def test_bad_cu_seqlens():
    x = torch.randn(10)
    for cu, match in ((torch.tensor([1, 4, 6, 10]), "start at 0"), (torch.tensor([0, 4, 6, 9]), "end at"),
                      (torch.tensor([0, 6, 4, 10]), "non-decreasing"), (torch.tensor([0]), "at least 2")):
        with pytest.raises(ValueError, match=match):
            fk.value_loss(x, x, x, cu_seqlens=cu)
    with pytest.raises(TypeError, match="cu_seqlens"):
        fk.value_loss(x, x, x, cu_seqlens=torch.tensor([0.0, 4.0, 6.0, 10.0]))
    with pytest.raises(ValueError, match="packed"):
        fk.value_loss(x.view(2, 5), x.view(2, 5), x.view(2, 5), cu_seqlens=torch.tensor([0, 4, 10]))
    with pytest.raises(ValueError, match="normalizer"):
        fk.value_loss(x, x, x, cu_seqlens=torch.tensor([0, 4, 10]), loss_agg_mode="seq-mean-token-sum-norm")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,bad", [("values", float("nan")), ("old_values", float("nan")),
                                      ("old_values", float("inf")), ("returns", float("-inf"))])
def test_non_finite_valid_input_is_named(backend, name, bad):
    v, old, ret, mask = _good()
    inp = {"values": v.clone(), "old_values": old.clone(), "returns": ret.clone()}
    inp[name][0, 1] = bad  # row 0 is full: a valid position
    with fk.use_backend(backend):
        with pytest.raises(ValueError, match=f"^{name} holds a non-finite value"):
            fk.value_loss(inp["values"], inp["old_values"], inp["returns"], mask=mask, clip_range=CLIP)
        # value checks off: no sync, no error, a non-finite loss
        fk.set_value_checks(False)
        try:
            out = fk.value_loss(inp["values"], inp["old_values"], inp["returns"], mask=mask, clip_range=CLIP)
            assert not torch.isfinite(out.loss)
        finally:
            fk.set_value_checks(True)
        # NaN in the padding (make_padded puts it there) is ignored
        assert torch.isfinite(fk.value_loss(v, old, ret, mask=mask, clip_range=CLIP).loss)


def test_default_backend_and_output_type():
    v, old, ret, mask = _good()
    out = fk.value_loss(v.requires_grad_(True), old, ret, mask=mask.int(), clip_range=CLIP)
    assert isinstance(out, fk.LossOutput)
    assert list(out.metrics) == list(NAMES)
    assert out.loss.requires_grad and out.loss.dtype == torch.float32 and out.loss.dim() == 0
    out.loss.backward()
    assert v.grad.shape == v.shape and torch.isfinite(v.grad).all()
