"""flashrl_kernels' verl integration inside verl 0.9.1's own FSDP training engine, end to end, on the CPU.

For every case (loss `vanilla` / `gspo`, every `loss_agg_mode`, with and without `rollout_is_weights`, with
and without `use_remove_padding`), tests/verl_fsdp_scenario.py runs one actor update (verl's update_actor
path: TrainingWorker.train_mini_batch -> FSDPEngine.train_batch -> ppo_loss; fsdp2, world size 1, gloo; a
tiny fp32 Qwen2; 8 sequences, 2 mini-batches of 2 micro-batches each, so 2 optimizer steps with gradient
accumulation and verl's global-batch normalisers) twice from the same checkpoint on the same batch: unpatched
with verl's loss, and after `flashrl_kernels.patch("verl")` with `flashrl` / `flashrl_gspo`. The runs must give
the same loss, metrics, gradient norm and updated weights, and the patched one must have gone through
flashrl (the policy loss that ppo_loss looked up, flashrl_kernels.policy_loss / token_logprobs calls).

The optimizer is SGD (lr 0.5), so the updated weights compare the gradients directly, with verl's gradient
clipping (1.0): the weights check the gradient's direction, `grad_norm` (before clipping) its scale; two
AdamW cases (verl's default) and two with an entropy bonus come on top. Two more tests check that the
comparison tells different updates apart, and that the remove-padding (packed) forward matches the padded
one on the CPU. About 25 s on 2 CPU cores.

It runs in a subprocess (a fresh process: verl's platform singleton, the engine registry and
torch.distributed are process-global) and only where verl is installed (.ci/run installs it after the main
suite; see docs/integrations/verl.md); elsewhere the module is skipped.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (.ci/run installs it after the main suite)")

from flashrl_kernels.testing import build_tiny_qwen2

SCENARIO = Path(__file__).with_name("verl_fsdp_scenario.py")
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
CASES = [{"loss": loss, "agg": agg, "weights": weights, "rmpad": rmpad, "optim": "SGD"}
         for rmpad in (True, False) for loss in ("vanilla", "gspo") for agg in AGG_MODES for weights in (False, True)]
# verl's default optimizer too: AdamW scales each gradient element by 1 / (|g| + eps) on its first step, so
# elements with |g| near eps (1e-8) move by a visible fraction of lr for float-rounding-sized differences in g
CASES += [{"loss": "vanilla", "agg": "token-mean", "weights": True, "rmpad": True, "optim": "AdamW"},
          {"loss": "gspo", "agg": "seq-mean-token-mean", "weights": False, "rmpad": False, "optim": "AdamW"}]
# an entropy bonus (entropy_coeff != 0): verl computes the entropy in the engine (rmpad: the function bound at
# FSDPEngine.__init__; padded: verl_F.entropy_from_logits at call time) and adds it to the loss
CASES += [{"loss": "vanilla", "agg": "token-mean", "weights": True, "rmpad": True, "optim": "SGD",
           "entropy_coeff": 0.01},
          {"loss": "gspo", "agg": "seq-mean-token-mean", "weights": False, "rmpad": False, "optim": "SGD",
           "entropy_coeff": 0.01}]
WEIGHT_ATOL = {"SGD": 2e-6, "AdamW": 5e-5}  # SGD lr 0.5, AdamW lr 1e-3 (tests/verl_fsdp_scenario.py)
MIN_CHANGE = {"SGD": 1e-2, "AdamW": 5e-4}  # the update itself moves some weight by at least this much
LOSS_FNS = {  # what verl's ppo_loss must have looked up (get_policy_loss_fn), per run
    ("verl", "vanilla"): "verl.trainer.ppo.core_algos.compute_policy_loss_vanilla",
    ("verl", "gspo"): "verl.trainer.ppo.core_algos.compute_policy_loss_gspo",
    ("flashrl", "vanilla"): "flashrl_kernels.integrations.verl.flashrl_policy_loss",
    ("flashrl", "gspo"): "flashrl_kernels.integrations.verl.flashrl_gspo_loss",
}
METRICS = ("actor/pg_loss", "loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "grad_norm")


def case_id(c):
    return f"{c['loss']}-{c['agg']}-{'tis' if c['weights'] else 'noweights'}-{'rmpad' if c['rmpad'] else 'padded'}-" \
           f"{c['optim']}" + ("-entropy" if c.get("entropy_coeff") else "")


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verl_fsdp")
    model_dir = build_tiny_qwen2(tmp / "tiny_qwen2", hidden=64, intermediate=128, heads=4, kv_heads=2,
                                 dtype=torch.float32, seed=0)
    out = tmp / "runs.pt"
    env = {k: v for k, v in os.environ.items() if k != "FLASHRL_PATCH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(SCENARIO), str(model_dir), str(out), json.dumps(CASES)], check=False,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"verl FSDP scenario failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-6000:]}"
    data = torch.load(out, weights_only=False)
    assert [r["case"] for r in data["results"]] == CASES
    return data


def _result(engine_runs, case):
    return next(r for r in engine_runs["results"] if r["case"] == case)


def _assert_metrics_equal(got, want, what):
    assert got.keys() == want.keys(), what
    for k in want:
        assert len(got[k]) == len(want[k]), (what, k)
        assert got[k] == pytest.approx(want[k], rel=2e-5, abs=1e-6), (what, k)


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_flashrl_actor_update_equals_verls(engine_runs, case):
    """Patched (flashrl / flashrl_gspo) and unpatched (vanilla / gspo) verl: one update_actor, same result."""
    r = _result(engine_runs, case)
    ref, ours = r["verl"], r["flashrl"]
    n_micro = engine_runs["micro_batches"]
    assert ref["verl_version"].startswith("0.9.")

    entropy = bool(case.get("entropy_coeff"))

    # the reference run is verl's own: its loss, its log-probs, no flashrl kernel called
    assert ref["loss_mode"] == case["loss"] and not ref["patched_logprobs"]
    assert ref["loss_fns"] == [LOSS_FNS["verl", case["loss"]]] * n_micro
    assert ref["token_logprobs_calls"] == 0 and ref["policy_loss_calls"] == 0
    assert ref["entropy_fn"] == "verl.utils.torch_functional.entropy_from_logits"
    # the patched run went through flashrl: the registered loss, and flashrl's kernels, on every micro-batch
    assert ours["loss_mode"] == {"vanilla": "flashrl", "gspo": "flashrl_gspo"}[case["loss"]]
    assert ours["patched_logprobs"]
    assert ours["loss_fns"] == [LOSS_FNS["flashrl", case["loss"]]] * n_micro
    assert ours["policy_loss_calls"] == n_micro
    assert ours["entropy_calls"] == (n_micro if entropy else 0)  # token_logprobs(..., return_entropy=True)
    assert ours["token_logprobs_calls"] == n_micro + ours["entropy_calls"]
    assert ours["entropy_fn"] == "flashrl_kernels.integrations.verl.entropy_from_logits"

    # same loss, metrics (per mini-batch: 2 optimizer steps) and gradient norm
    for k in METRICS + (("actor/entropy_loss",) if entropy else ()):
        assert k in ref["metrics"], k
        assert len(ref["metrics"][k]) == 2, k
    _assert_metrics_equal(ours["metrics"], ref["metrics"], case_id(case))
    assert ref["metrics"]["actor/pg_clipfrac"][0] + ref["metrics"]["actor/pg_clipfrac"][1] > 0  # clipping happened
    if case["loss"] == "vanilla":
        assert max(ref["metrics"]["actor/pg_clipfrac_lower"]) > 0  # so did the dual clip

    # same starting weights, same updated weights, and the update is far larger than the tolerance
    assert torch.equal(ours["initial"], ref["initial"])
    change = (ref["final"] - ref["initial"]).abs().max().item()
    assert change > MIN_CHANGE[case["optim"]], change
    torch.testing.assert_close(ours["final"], ref["final"], rtol=0, atol=WEIGHT_ATOL[case["optim"]])


def _final(engine_runs, run="verl", **case):
    return _result(engine_runs, {**case, "optim": "SGD"})[run]["final"]


@pytest.mark.parametrize("rmpad", [True, False], ids=["rmpad", "padded"])
def test_the_weight_comparison_tells_different_updates_apart(engine_runs, rmpad):
    """The comparison above has teeth: a different loss, aggregation or IS weighting gives other weights."""
    tol = 100 * WEIGHT_ATOL["SGD"]
    for agg in AGG_MODES:
        for weights in (False, True):
            a = _final(engine_runs, loss="vanilla", agg=agg, weights=weights, rmpad=rmpad)
            b = _final(engine_runs, loss="gspo", agg=agg, weights=weights, rmpad=rmpad)
            assert (a - b).abs().max() > tol, (agg, weights)
        for loss in ("vanilla", "gspo"):
            a = _final(engine_runs, loss=loss, agg=agg, weights=False, rmpad=rmpad)
            b = _final(engine_runs, loss=loss, agg=agg, weights=True, rmpad=rmpad)
            assert (a - b).abs().max() > tol, (loss, agg)
    for loss in ("vanilla", "gspo"):
        a = _final(engine_runs, loss=loss, agg="token-mean", weights=False, rmpad=rmpad)
        b = _final(engine_runs, loss=loss, agg="seq-mean-token-mean", weights=False, rmpad=rmpad)
        assert (a - b).abs().max() > tol, loss


@pytest.mark.parametrize("run", ["verl", "flashrl"])
def test_remove_padding_matches_the_padded_forward_on_cpu(engine_runs, run):
    """use_remove_padding packs the micro-batch into one sequence (sdpa on the CPU, no flash-attn): it must
    give what the padded forward gives, so the rmpad cases above exercise a correct model, not a mixed one."""
    for loss in ("vanilla", "gspo"):
        for agg in AGG_MODES:
            for weights in (False, True):
                case = {"loss": loss, "agg": agg, "weights": weights, "optim": "SGD"}
                packed = _result(engine_runs, {**case, "rmpad": True})[run]
                padded = _result(engine_runs, {**case, "rmpad": False})[run]
                _assert_metrics_equal(packed["metrics"], padded["metrics"], (run, case))
                torch.testing.assert_close(packed["final"], padded["final"], rtol=0, atol=WEIGHT_ATOL["SGD"])
