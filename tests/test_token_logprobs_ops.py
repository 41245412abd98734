"""token_logprobs as a torch op: opcheck, torch.compile, backend selection, bad inputs."""
import pytest
import torch
from conftest import DEVICE, available_backends

import flashrl_kernels as fk
from flashrl_kernels import _backend
from flashrl_kernels.reference import token_logprobs_spec

BACKENDS = available_backends(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("return_entropy", [False, True])
def test_opcheck(backend, return_entropy):
    logits = torch.randn(2, 3, 41, device=DEVICE, requires_grad=True)
    targets = torch.randint(0, 41, (2, 3), device=DEVICE)
    targets[0, 1] = -100
    with fk.use_backend(backend):
        torch.library.opcheck(
            torch.ops.flashrl.token_logprobs.default, (logits, targets, 0.8, -100, return_entropy)
        )
        with torch.no_grad():
            lp, ent, lse = torch.ops.flashrl.token_logprobs(logits, targets, 0.8, -100, True)
        torch.library.opcheck(
            torch.ops.flashrl.token_logprobs_backward.default,
            (torch.randn_like(lp), torch.randn_like(lp), logits.detach(), targets, lse, ent, 0.8, -100),
        )


def test_compile_fullgraph_forward_backward():
    torch._dynamo.reset()

    def loss_fn(logits, targets, adv):
        lp, ent = fk.token_logprobs(logits, targets, temperature=0.9, return_entropy=True, ignore_index=-100)
        return -(lp * adv).mean() - 0.01 * ent.mean()

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    logits = torch.randn(2, 7, 300, device=DEVICE)
    targets = torch.randint(0, 300, (2, 7), device=DEVICE)
    targets[1, 3] = -100
    adv = torch.randn(2, 7, device=DEVICE)
    x1 = logits.clone().requires_grad_(True)
    x2 = logits.clone().requires_grad_(True)
    l1 = compiled(x1, targets, adv)
    l1.backward()
    l2 = loss_fn(x2, targets, adv)
    l2.backward()
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(x1.grad, x2.grad)


@pytest.mark.skipif(DEVICE != "cpu", reason="inductor CPU codegen check")
def test_compile_inductor():
    torch._dynamo.reset()

    def f(logits, targets):
        return fk.token_logprobs(logits * 2.0, targets).sum()

    logits = torch.randn(4, 100, requires_grad=True)
    targets = torch.randint(0, 100, (4,))
    out = torch.compile(f, fullgraph=True)(logits, targets)
    out.backward()
    ref = token_logprobs_spec(logits.detach().double() * 2.0, targets)[0].sum()
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=0)
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


# ---- backend selection ----

def test_default_backend_on_cpu():
    assert _backend.selected_backend(torch.device("cpu")) in ("torch", "native")


def test_env_override(monkeypatch):
    monkeypatch.setenv("FLASHRL_BACKEND", "reference")
    assert _backend.selected_backend(torch.device("cpu")) == "reference"
    with fk.use_backend("torch"):  # the context manager wins over the environment
        assert _backend.selected_backend(torch.device("cpu")) == "torch"
    monkeypatch.setenv("FLASHRL_BACKEND", "bogus")
    with pytest.raises(ValueError, match="unknown backend 'bogus'"):
        fk.token_logprobs(torch.randn(2, 5), torch.tensor([1, 2]))


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="unknown backend"), fk.use_backend("cuda-magic"):
        pass


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with fk.use_backend("triton"), pytest.raises(fk.BackendUnavailableError, match="TRITON_INTERPRET=1"):
        fk.token_logprobs(torch.randn(2, 5), torch.tensor([1, 2]))


def test_native_unbuilt_is_a_clear_error():
    if _backend.native_built():
        pytest.skip("native extension is built here; the error path cannot be reached")
    with fk.use_backend("native"), pytest.raises(fk.BackendUnavailableError, match="native"):
        fk.token_logprobs(torch.randn(2, 5), torch.tensor([1, 2]))


# ---- bad inputs ----

@pytest.mark.parametrize(
    "logits, targets, kwargs, exc, match",
    [
        (torch.randn(2, 5), torch.tensor([1, 2, 3]), {}, ValueError, "targets must have shape"),
        (torch.randn(2, 5), torch.tensor([[1], [2]]), {}, ValueError, "targets must have shape"),
        (torch.randn(2, 5).double(), torch.tensor([1, 2]), {}, TypeError, "logits must have dtype"),
        (torch.randn(2, 5), torch.tensor([1.0, 2.0]), {}, TypeError, "targets must have dtype"),
        (torch.randn(2, 5), torch.tensor([1, 2], dtype=torch.int16), {}, TypeError, "targets must have dtype"),
        (torch.randn(0, 5), torch.zeros(0, dtype=torch.long), {}, ValueError, "empty batch"),
        (torch.randn(2, 0), torch.tensor([0, 0]), {}, ValueError, "V = 0"),
        (torch.randn(5, 2).t(), torch.tensor([0, 1]), {}, ValueError, "unit stride"),
        (torch.randn(2, 5), torch.tensor([1, 2]), {"temperature": 0.0}, ValueError, "temperature"),
        (torch.randn(2, 5), torch.tensor([1, 2]), {"temperature": float("nan")}, ValueError, "temperature"),
        (torch.randn(2, 5), torch.tensor([1, 2]), {"ignore_index": 1.5}, TypeError, "ignore_index"),
        ([[1.0, 2.0]], torch.tensor([1]), {}, TypeError, "logits must be a torch.Tensor"),
    ],
)
def test_bad_metadata(logits, targets, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fk.token_logprobs(logits, targets, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [-1, 5, 7])
def test_target_out_of_range(backend, bad):
    targets = torch.tensor([1, bad, 2])
    with fk.use_backend(backend), pytest.raises(ValueError, match=rf"\[0, 5\).*flat position 1 holds {bad}"):
        fk.token_logprobs(torch.randn(3, 5), targets)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), "all-neg-inf"])
def test_undefined_rows(backend, poison):
    logits = torch.randn(3, 6)
    if poison == "all-neg-inf":
        logits[2] = float("-inf")
    else:
        logits[2, 4] = poison
    with fk.use_backend(backend):
        with pytest.raises(ValueError, match="row 2"):
            fk.token_logprobs(logits, torch.tensor([0, 1, 2]))
        # an ignored row may hold anything
        out = fk.token_logprobs(logits, torch.tensor([0, 1, -100]), ignore_index=-100)
        assert torch.isfinite(out).all() and out[2] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_value_checks_off_never_reads_out_of_bounds(backend):
    fk.set_value_checks(False)
    try:
        with fk.use_backend(backend):
            out = fk.token_logprobs(torch.randn(3, 5), torch.tensor([1, 99, -3]))
    finally:
        fk.set_value_checks(True)
    assert torch.isfinite(out[0]) and torch.isnan(out[1]) and torch.isnan(out[2])


def test_device_mismatch_is_named():
    if not torch.cuda.is_available():
        pytest.skip("needs two devices (cpu and cuda) to build a mismatch")
    with pytest.raises(ValueError, match="targets is on"):
        fk.token_logprobs(torch.randn(2, 5, device="cuda"), torch.tensor([1, 2]))
