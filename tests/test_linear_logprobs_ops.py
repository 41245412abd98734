"""linear_token_logprobs as torch ops: opcheck, torch.compile, bad inputs, vocab-parallel, bench cases."""
import os
import socket
import sys

import pytest
import torch
from conftest import DEVICE, available_backends

import flashrl_kernels as fk
from flashrl_kernels.reference import linear_token_logprobs_spec

# backends that implement this op (native: torch_impl tile loops with the C++ epilogues)
BACKENDS = available_backends(DEVICE, op="linear_logprobs_stats")


def _inputs(n=6, h=20, v=37, dtype=torch.float32, bias=True):
    hidden = torch.randn(n, h, device=DEVICE, dtype=dtype)
    weight = (torch.randn(v, h, device=DEVICE) / h**0.5).to(dtype)
    b = torch.randn(v, device=DEVICE, dtype=dtype) if bias else None
    return hidden, weight, b, torch.randint(0, v, (n,), device=DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("return_entropy", [False, True])
def test_opcheck(backend, return_entropy):
    hidden, weight, bias, targets = _inputs()
    targets[1] = -100
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    bias.requires_grad_(True)
    with fk.use_backend(backend):
        torch.library.opcheck(
            torch.ops.flashrl.linear_token_logprobs.default,
            (hidden, weight, bias, targets, 0.8, -100, return_entropy, True),
        )
        torch.library.opcheck(
            torch.ops.flashrl.linear_logprobs_stats.default, (hidden.detach(), weight.detach(), None, targets - 5, 0.8, True)
        )
        with torch.no_grad():
            _, ent, lse = torch.ops.flashrl.linear_token_logprobs(
                hidden, weight, bias, targets, 0.8, -100, True, True
            )
        g = torch.randn_like(lse)
        for need in [(True, True, True), (True, False, False), (False, True, True)]:
            torch.library.opcheck(
                torch.ops.flashrl.linear_token_logprobs_backward.default,
                (g, g * 0.5, hidden.detach(), weight.detach(), bias.detach(), targets, lse, ent, 0.8, *need, True),
            )


def test_compile_fullgraph_forward_backward():
    torch._dynamo.reset()

    def loss_fn(hidden, weight, bias, targets, adv):
        lp, ent = fk.linear_token_logprobs(
            hidden, weight, targets, bias=bias, temperature=0.9, return_entropy=True, ignore_index=-100
        )
        return -(lp * adv).mean() - 0.01 * ent.mean()

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    hidden, weight, bias, targets = _inputs(n=14, h=24, v=61)
    hidden = hidden.view(2, 7, 24)
    targets = targets.view(2, 7)
    targets[1, 3] = -100
    adv = torch.randn(2, 7, device=DEVICE)
    a = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    b = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    l1 = compiled(*a, targets, adv)
    l1.backward()
    l2 = loss_fn(*b, targets, adv)
    l2.backward()
    torch.testing.assert_close(l1, l2)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad)


@pytest.mark.skipif(DEVICE != "cpu", reason="inductor CPU codegen check")
def test_compile_inductor():
    torch._dynamo.reset()

    def f(hidden, weight, targets):
        return fk.linear_token_logprobs(hidden * 2.0, weight, targets, fp32_grad_accumulation=False).sum()

    hidden, weight, _, targets = _inputs(bias=False)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    out = torch.compile(f, fullgraph=True)(hidden, weight, targets)
    out.backward()
    ref = linear_token_logprobs_spec(hidden.detach().double() * 2.0, weight.detach().double(), targets)[0].sum()
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=0)
    assert torch.isfinite(hidden.grad).all() and hidden.grad.abs().sum() > 0
    assert torch.isfinite(weight.grad).all() and weight.grad.abs().sum() > 0


# ---- bad inputs ----

H, V = torch.randn(3, 8), torch.randn(11, 8)
T3 = torch.tensor([1, 2, 3])


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((H, V, torch.tensor([1, 2])), {}, ValueError, "targets must have shape"),
        ((H, torch.randn(11, 9), T3), {}, ValueError, "hidden size mismatch.*H = 8.*H = 9"),
        ((H, torch.randn(11, 8, 1), T3), {}, ValueError, "weight must be 2-D"),
        ((H, V.bfloat16(), T3), {}, TypeError, "weight dtype bfloat16 must equal hidden dtype float32"),
        ((H.double(), V.double(), T3), {}, TypeError, "hidden must have dtype"),
        ((H, V, T3.float()), {}, TypeError, "targets must have dtype"),
        ((H, V, T3), {"bias": torch.randn(10)}, ValueError, r"bias must have shape \[V\]"),
        ((H, V, T3), {"bias": torch.randn(11).half()}, TypeError, "bias dtype"),
        ((H, V, T3), {"bias": [0.0] * 11}, TypeError, "bias must be a torch.Tensor"),
        ((torch.randn(0, 8), V, torch.zeros(0, dtype=torch.long)), {}, ValueError, "empty batch"),
        ((H, torch.randn(0, 8), T3), {}, ValueError, "V = 0"),
        ((H, V, T3), {"temperature": -1.0}, ValueError, "temperature"),
        ((H, V, T3), {"ignore_index": "x"}, TypeError, "ignore_index"),
        (([[1.0]], V, T3), {}, TypeError, "hidden must be a torch.Tensor"),
    ],
)
def test_bad_metadata(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fk.linear_token_logprobs(*args, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [-1, 11, 50])
def test_target_out_of_range(backend, bad):
    targets = torch.tensor([1, bad, 2])
    with fk.use_backend(backend), pytest.raises(ValueError, match=rf"\[0, 11\).*flat position 1 holds {bad}"):
        fk.linear_token_logprobs(H, V, targets)
    with fk.use_backend(backend):  # an ignored position may hold the ignore value
        out = fk.linear_token_logprobs(H, V, torch.tensor([1, -100, 2]), ignore_index=-100)
    assert out[1] == 0 and torch.isfinite(out).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_row_is_named(backend):
    hidden = torch.randn(3, 8)
    hidden[2, 3] = float("nan")
    with fk.use_backend(backend), pytest.raises(ValueError, match="row 2"):
        fk.linear_token_logprobs(hidden, V, T3 - 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_value_checks_off_gives_nan_not_a_crash(backend):
    fk.set_value_checks(False)
    try:
        with fk.use_backend(backend):
            out = fk.linear_token_logprobs(H, V, torch.tensor([1, 99, -3]))
    finally:
        fk.set_value_checks(True)
    assert torch.isfinite(out[0]) and torch.isnan(out[1]) and torch.isnan(out[2])


# ---- vocab-parallel: 2 processes, gloo ----

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vp_worker(rank, world, port, backend, split, result_dir):
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(__file__))
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(7)  # same full inputs on every rank
        n, h, v = 10, 24, 45
        hidden = torch.randn(n, h)
        weight = torch.randn(v, h) * 0.4
        bias = torch.randn(v)
        targets = torch.randint(0, v, (n,))
        targets[3] = -100
        targets[4] = split - 1  # last row of rank 0's slice
        targets[5] = split      # first row of rank 1's slice
        g_lp, g_h = torch.randn(n), torch.randn(n)
        lo, hi = (0, split) if rank == 0 else (split, v)

        def run(hd, w, b, group):
            with fk.use_backend(backend):
                lp, ent = fk.linear_token_logprobs(
                    hd, w, targets, bias=b, temperature=0.8, return_entropy=True, ignore_index=-100,
                    process_group=group,
                )
            ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
            return lp.detach(), ent.detach()

        ref_leaves = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
        ref_lp, ref_ent = run(*ref_leaves, None)
        leaves = [hidden.clone().requires_grad_(True), weight[lo:hi].clone().requires_grad_(True),
                  bias[lo:hi].clone().requires_grad_(True)]
        lp, ent = run(*leaves, dist.group.WORLD)
        torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=0)
        torch.testing.assert_close(ent, ref_ent, atol=2e-5, rtol=0)
        torch.testing.assert_close(leaves[0].grad, ref_leaves[0].grad, atol=2e-5, rtol=0)
        torch.testing.assert_close(leaves[1].grad, ref_leaves[1].grad[lo:hi], atol=2e-5, rtol=0)
        torch.testing.assert_close(leaves[2].grad, ref_leaves[2].grad[lo:hi], atol=2e-5, rtol=0)
        # out-of-range global target: same ValueError on every rank
        bad = targets.clone()
        bad[0] = v
        try:
            fk.linear_token_logprobs(hidden, weight[lo:hi], bad, process_group=dist.group.WORLD)
            raise AssertionError("no error for an out-of-range global target")
        except ValueError as e:
            assert f"[0, {v})" in str(e), e
        with open(os.path.join(result_dir, f"ok{rank}"), "w") as f:
            f.write("ok")
        dist.barrier()  # neither rank tears gloo down while the other is still inside a collective
    finally:
        dist.destroy_process_group()
    # Success: leave without running C++ static destructors. torch 2.13's gloo teardown at interpreter
    # exit aborts now and then ("terminate called without an active exception", no Python frame),
    # after all the work above has passed; the results are in the ok files the test checks.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# uneven slices: 20 + 25 rows, and 44 + 1 row
@pytest.mark.parametrize(
    "backend, split",
    [("torch", 20)]
    + ([("triton", 44)] if "triton" in BACKENDS else [("torch", 44)])
    + ([("native", 44)] if "native" in BACKENDS else []),
)
def test_vocab_parallel_two_processes(backend, split, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_vp_worker, args=(2, _free_port(), backend, split, str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


# ---- benchmark cases run at tiny sizes ----

def _bench_module():
    from flashrl_kernels.benchmarks import linear_logprobs

    return linear_logprobs


def test_bench_cases_run_at_tiny_size():
    mod = _bench_module()
    cases = mod.cases(quick=True, device=torch.device("cpu"))
    expected = {"unfused eager", "flashrl[torch]"} | ({"flashrl[native]"} if "native" in BACKENDS else set())
    assert {c.impl for c in cases} >= expected and any(c.baseline for c in cases)
    assert {c.mode for c in cases} == {"fwd", "fwd+bwd"}
    outs = {}
    for impl, fn in [("unfused", mod.unfused_logprobs), ("fused", mod.fused_logprobs)]:
        for mode in ("fwd", "fwd+bwd"):
            run = mod._maker(fn, 5, 16, 33, torch.float32, torch.device("cpu"), mode)()
            outs[impl, mode] = run()
    torch.testing.assert_close(outs["unfused", "fwd"], outs["fused", "fwd"], atol=1e-5, rtol=0)
    torch.testing.assert_close(outs["unfused", "fwd+bwd"], outs["fused", "fwd+bwd"], atol=1e-5, rtol=0)
