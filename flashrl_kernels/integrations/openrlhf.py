"""Drop-in kernels for OpenRLHF 0.11.2 (DeepSpeed actor and critic on Ray, vLLM rollout).

    import flashrl_kernels
    flashrl_kernels.patch("openrlhf")     # or FLASHRL_PATCH=openrlhf, in a process that imports flashrl_kernels

and in every Ray worker (the actor, critic, reference and trainer processes never import flashrl_kernels
themselves), through Ray's runtime environment:

    ray.init(runtime_env={"worker_process_setup_hook": "flashrl_kernels.integrations.openrlhf.ray_worker_setup"})
    # ray job submit --runtime-env-json '{"worker_process_setup_hook": "flashrl_kernels.integrations.openrlhf.ray_worker_setup"}' -- python3 -m openrlhf.cli.train_ppo_ray ...
    # python -m flashrl_kernels.integrations.openrlhf openrlhf.cli.train_ppo_ray ...   (local launch, adds the hook)

What `patch()` does (openrlhf >= 0.11.2, < 0.12; other versions are refused with a RuntimeError):

- `Actor.forward` (openrlhf.models.actor): the log-probabilities and entropy come from one flashrl pass over
  the model's own logits (`token_logprobs`, temperature inside the kernel): no fp32 copy of the [N, V] logits,
  no in-place division by the temperature, no [N, V] softmax. Where the lm_head is a plain `nn.Linear` of a
  model whose forward does nothing after it (see `FUSABLE_MODEL_TYPES`; not under ZeRO-3, not a VLM) the
  logits are never built at all: `linear_token_logprobs` on the lm_head's input hidden states, and with an
  action mask (the actor's PPO forward) only the response tokens are scored. OpenRLHF's own forward still
  runs (packing, ring attention, slicing, masking): the patch intercepts the logits at the model's output
  (or the lm_head's input) and hands OpenRLHF a placeholder that its `log_probs_from_logits` /
  `compute_entropy`, both replaced, resolve.
- `log_probs_from_logits` / `compute_entropy` (openrlhf.models.utils and the names bound in
  openrlhf.models.actor), called on ordinary logits: `token_logprobs`, same values and dtypes as OpenRLHF's,
  without dividing the caller's logits in place.
- `PolicyLoss` and `ValueLoss` (openrlhf.models.loss, re-exported by openrlhf.models and bound by name in
  ppo_actor / ppo_critic): subclasses with OpenRLHF's constructor (its own validation runs) whose forward
  runs `policy_loss` / `value_loss` with OpenRLHF's semantics (mapping in docs/integrations/openrlhf.md).
- `RemoteExperienceMaker.get_advantages_and_returns` (GAE): `flashrl_kernels.gae` (patched when
  openrlhf.trainer.ppo_utils.experience_maker is imported, now or later).

`unpatch()` restores every replaced object. Both are idempotent. Objects built while patched (a PolicyLoss
made by a trainer) keep flashrl's class: patch before building trainers, as the Ray hook does.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import inspect
import logging
import os
import sys
from typing import NamedTuple

import torch

SUPPORTED_RANGE = ">=0.11.2,<0.12"
_MIN_VERSION = (0, 11, 2)
_MAX_EXCLUSIVE = (0, 12)
# Model types whose causal-LM forward (transformers 5.x) returns lm_head(hidden) unchanged as the logits
# (no soft-capping, no logit scale): the fused head may score straight from the lm_head's input.
FUSABLE_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "phi3", "olmo2",
    "deepseek_v3",
})
FUSED_HEAD_ENV = "FLASHRL_OPENRLHF_FUSED_HEAD"  # "0": always score from the model's logits
RAY_SETUP_HOOK = "flashrl_kernels.integrations.openrlhf.ray_worker_setup"
_LOG_RATIO_CLAMP = 20.0  # OpenRLHF's ppo loss clamps log(ratio) to +-20 before exp
_GAE_MODULE = "openrlhf.trainer.ppo_utils.experience_maker"

logger = logging.getLogger(__name__)

_originals: dict[tuple[str, str], object] = {}  # (module, attribute or "Class.method") -> OpenRLHF's object
_classes: dict[str, type] = {}                   # "PolicyLoss" / "ValueLoss" -> flashrl's subclass (built once)
_patched = False
_finder = None


# ---------------------------------------------------------------------------------------------- version

def _check_version() -> str:
    from ._versions import release_of, require_supported

    try:
        version = importlib.metadata.version("openrlhf")
    except importlib.metadata.PackageNotFoundError as e:
        raise RuntimeError(f"flashrl_kernels' OpenRLHF integration needs openrlhf{SUPPORTED_RANGE} "
                           f"(pip install 'openrlhf{SUPPORTED_RANGE}'); it is not installed") from e
    release = release_of(version)
    ok = release is not None and _MIN_VERSION <= tuple(release[:3]) and tuple(release[:2]) < _MAX_EXCLUSIVE
    return require_supported("OpenRLHF", "openrlhf", version, ok, SUPPORTED_RANGE,
                             "It replaces OpenRLHF's loss classes and Actor.forward, whose signatures and semantics "
                             "change between releases (0.11.0/0.11.1 have another PolicyLoss constructor; 0.11.0 "
                             "takes the entropy before the temperature)")


# ---------------------------------------------------------------------------------------------- log-probs

def _token_logprobs(logits, labels, temperature, entropy):
    import flashrl_kernels as fk

    return fk.token_logprobs(logits, labels.to(torch.int64), temperature=float(temperature), return_entropy=entropy)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """OpenRLHF's `log_probs_from_logits` on `token_logprobs`: log softmax(logits / temperature) at `labels`, in
    the logits' dtype. Unlike OpenRLHF's it never divides the caller's logits in place."""
    head = getattr(logits, "_flashrl_head", None)
    if head is not None:  # the placeholder the patched Actor.forward hands to OpenRLHF's code
        return head.logprobs(labels, temperature)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _token_logprobs(logits, labels, temperature, False).to(logits.dtype)


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """OpenRLHF's `compute_entropy` (entropy of softmax(logits) over the last dim, in the logits' dtype) without
    its [N, V] softmax."""
    head = getattr(logits, "_flashrl_head", None)
    if head is not None:
        return head.entropy()
    flat = logits.reshape(-1, logits.shape[-1])
    # the entropy does not depend on the targets: token 0 for every row
    _, ent = _token_logprobs(flat, torch.zeros(flat.shape[0], dtype=torch.int64, device=flat.device), 1.0, True)
    return ent.view(logits.shape[:-1]).to(logits.dtype)


class _Head:
    """What the patched Actor.forward captured from the model: its logits (model dtype, untempered), or the
    lm_head's input hidden states and weight (fused). OpenRLHF's forward receives an empty fp32 placeholder
    carrying this object and calls compute_entropy / log_probs_from_logits on it; both land here.

    The log-probabilities and the entropy come from one kernel pass when the labels OpenRLHF will ask for are
    known up front (`labels_guess`: its rolled sequences); the guess is checked against the labels it passes."""

    def __init__(self, temperature: float, labels_guess=None, rows=None):
        self.temperature = temperature
        self.labels_guess = labels_guess
        self.rows = rows        # bool [b, s]: the positions to score (fused path with an action mask), else None
        self.logits = None      # non-fused: the model's logits
        self.hidden = None      # fused: the lm_head's input
        self.linear = None      # fused: the lm_head
        self.used = None        # "token_logprobs" / "linear_token_logprobs": what ran (for tests and logs)
        self._cached = None     # (labels, logprobs) from the entropy pass

    def placeholder(self, like: torch.Tensor) -> torch.Tensor:
        """An empty fp32 [..., 0] tensor: OpenRLHF's `.to(torch.float32)` returns it unchanged and its in-place
        division touches nothing, so it reaches compute_entropy / log_probs_from_logits as the same object."""
        p = torch.empty((*like.shape[:-1], 0), dtype=torch.float32, device=like.device)
        p._flashrl_head = self
        return p

    def capture_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.hidden is not None:
            raise RuntimeError(f"the lm_head was called twice in one forward; flashrl's fused head cannot tell which "
                               f"call gives the logits. Set {FUSED_HEAD_ENV}=0 to score from the model's logits.")
        self.hidden = hidden
        return self.placeholder(hidden)

    def _score(self, labels: torch.Tensor, temperature: float, entropy: bool):
        labels = labels.to(torch.int64)
        if self.logits is not None:
            self.used = "token_logprobs"
            out = _token_logprobs(self.logits, labels, temperature, entropy)
            return out if entropy else (out, None)
        import flashrl_kernels as fk

        self.used = "linear_token_logprobs"
        w, b = self.linear.weight, self.linear.bias
        rows = self.rows
        if rows is None:
            out = fk.linear_token_logprobs(self.hidden, w, labels, bias=b, temperature=temperature,
                                           return_entropy=entropy)
            return out if entropy else (out, None)
        # only the positions OpenRLHF keeps (the response tokens): the lm_head GEMM runs on those rows alone
        out = fk.linear_token_logprobs(self.hidden[rows], w, labels[rows], bias=b, temperature=temperature,
                                       return_entropy=entropy)
        lp, ent = out if entropy else (out, None)
        zeros = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        return zeros.index_put((rows,), lp), (None if ent is None else zeros.index_put((rows,), ent))

    def entropy(self) -> torch.Tensor:
        shape = (self.logits if self.logits is not None else self.hidden).shape[:-1]
        labels = self.labels_guess
        if labels is None or tuple(labels.shape) != tuple(shape):
            labels = torch.zeros(shape, dtype=torch.int64, device=(self.logits if self.logits is not None
                                                                     else self.hidden).device)
            lp, ent = self._score(labels, self.temperature, True)
        else:
            lp, ent = self._score(labels, self.temperature, True)
            self._cached = (labels, lp)
        return ent

    def logprobs(self, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if temperature == 1.0 and self._cached is not None:
            cached_labels, lp = self._cached
            self._cached = None
            if cached_labels.shape == labels.shape and torch.equal(cached_labels, labels.to(cached_labels.device)):
                return lp
        return self._score(labels, self.temperature * float(temperature), False)[0]


def _unwrap(model):
    """The Hugging Face model inside a DeepSpeed engine (its `.config` is DeepSpeed's, not the model's)."""
    ds = sys.modules.get("deepspeed")
    if ds is not None and isinstance(model, getattr(ds, "DeepSpeedEngine", ())):
        return model.module
    return model


def fused_head_of(actor):
    """(lm_head, None) when `actor`'s log-probabilities can be scored straight from the lm_head's input (no [N, V]
    logits), else (None, the reason)."""
    if os.environ.get(FUSED_HEAD_ENV, "1").strip() == "0":
        return None, f"{FUSED_HEAD_ENV}=0"
    if getattr(actor, "is_vlm", False):
        return None, "a vision-language model"
    model = _unwrap(actor.model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FUSABLE_MODEL_TYPES:
        return None, f"model_type {model_type!r} is not known to use its lm_head output unchanged"
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if type(head) is not torch.nn.Linear:
        return None, f"the lm_head is a {type(head).__name__}, not a plain nn.Linear (LoRA, tensor parallel, ...)"
    if hasattr(head.weight, "ds_id"):
        return None, "the lm_head weight is partitioned by DeepSpeed ZeRO-3"
    if "forward" in head.__dict__:
        return None, "the lm_head's forward is already wrapped (accelerate hooks)"
    return head, None


_ACTOR_SIGNATURE = None


def _actor_forward(self, *args, **kwargs):
    """Actor.forward with the logits intercepted (see the module docstring); OpenRLHF's forward does the rest."""
    original = _originals[("openrlhf.models.actor", "Actor.forward")]
    bound = _ACTOR_SIGNATURE.bind(self, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    action_mask = a["action_mask"]
    if action_mask is None and not a["return_logprobs"]:
        return original(self, *args, **kwargs)  # the caller wants the logits themselves: OpenRLHF's own path
    sequences = a["sequences"]
    packing = bool(getattr(self, "packing_samples", False))
    labels = None
    if not packing:
        labels = torch.roll(sequences, shifts=-1, dims=1)
    elif a["ring_attn_group"] is None and a["attention_mask"] is not None:
        labels = torch.roll(sequences, shifts=-1, dims=1)[a["attention_mask"].bool()].unsqueeze(0)
    head = _Head(float(self.temperature), labels_guess=labels)
    lm_head, _reason = fused_head_of(self)
    if lm_head is not None:
        if action_mask is not None and not packing:
            b, s = sequences.shape
            rows = torch.zeros(b, s, dtype=torch.bool, device=sequences.device)
            rows[:, s - 1 - action_mask.shape[1]:s - 1] = action_mask.bool()
            if bool(rows.any()):
                head.rows = rows
        head.linear = lm_head
        lm_head.forward = head.capture_hidden
        undo = lambda: lm_head.__dict__.pop("forward", None)
    else:
        def stash(module, inputs, output):
            head.logits = output["logits"]
            output["logits"] = head.placeholder(head.logits)
            return output

        undo = self.model.register_forward_hook(stash).remove
    try:
        result = original(self, *args, **kwargs)
    finally:
        undo()
    if a["return_output"]:
        # the model's own logits (model dtype, not divided by the temperature); None on the fused path, where
        # they were never built
        result[1]["logits"] = head.logits
    return result


# ---------------------------------------------------------------------------------------------- losses

class _PolicyPlan(NamedTuple):
    config: object          # flashrl_kernels.LossConfig
    gspo: bool
    correction: bool        # is_correction_level != "off"
    op_tis: bool            # the IS correction runs inside policy_loss (token level, ratio gating)
    gate: tuple | None      # (gating, seq_level, low, high): the weight is computed here, folded into A


def _policy_plan(loss) -> _PolicyPlan:
    """OpenRLHF's PolicyLoss attributes -> flashrl's LossConfig (ValueError for what policy_loss cannot take)."""
    from flashrl_kernels import LossConfig

    lo, hi = float(loss.clip_eps_low), float(loss.clip_eps_high)
    if not 0.0 <= lo < 1.0:
        raise ValueError(f"clip_eps_low={loss.clip_eps_low}: flashrl_kernels.policy_loss needs 0 <= eps_low < 1 "
                         "(the lower clip bound 1 - eps_low must be positive)")
    if hi < 0.0:
        raise ValueError(f"clip_eps_high={loss.clip_eps_high}: flashrl_kernels.policy_loss needs eps_high >= 0")
    if loss.policy_loss_type not in ("ppo", "gspo"):
        raise ValueError(f"Invalid policy loss type: {loss.policy_loss_type}")
    gspo = loss.policy_loss_type == "gspo"
    correction = loss.is_correction_level != "off"
    tis = {}
    op_tis, gate = False, None
    if correction and not gspo:  # OpenRLHF applies the IS weight to ppo only (gspo takes the ratio to the rollout)
        low, high = (float(x) for x in loss.is_correction_threshold)
        if low > high:
            raise ValueError(f"is_correction_threshold={tuple(loss.is_correction_threshold)}: low must not exceed high")
        seq = loss.is_correction_level == "seq"
        if loss.is_correction_gating == "ratio" and not seq:
            if not high > 0.0:
                raise ValueError(f"is_correction_threshold high={high}: the ratio band must contain positive ratios")
            # a ratio is positive, so a negative lower bound is the same as 0
            tis = {"tis_mode": "token_truncate" if loss.is_correction_mode == "clip" else "token_mask",
                   "tis_min": max(low, 0.0), "tis_max": high}
            op_tis = True
        else:
            gate = (loss.is_correction_gating, seq, low, high)
    cfg = LossConfig(eps_low=lo, eps_high=hi, dual_clip=None if loss.dual_clip is None else float(loss.dual_clip),
                     importance_sampling_level="sequence" if gspo else "token",
                     loss_agg_mode="token-mean" if loss.token_level_loss and not gspo else "seq-mean-token-mean",
                     **tis)
    return _PolicyPlan(cfg, gspo, correction, op_tis, gate)


def _normalizer(token_level: bool, dp_size, batch_num_tokens, global_batch_size):
    """The divisor that makes policy_loss / value_loss equal OpenRLHF's aggregate_loss (None: the op's own
    default, which is OpenRLHF's local mean)."""
    n = batch_num_tokens if token_level else global_batch_size
    if n is None:
        return None  # OpenRLHF ignores dp_size then
    return n / dp_size


def _masked_mean(x: torch.Tensor, maskf: torch.Tensor) -> torch.Tensor:
    """Mean over the valid tokens; 0 (not OpenRLHF's 0/0 = NaN) when there is none."""
    return (x * maskf).sum() / maskf.sum().clamp(min=1.0)


def _row_mean(x: torch.Tensor, maskf: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean over the valid tokens, [B, 1]. An empty response gives 0/0 = NaN, which no band
    contains: OpenRLHF filters empty responses at sequence level, and so does this."""
    return ((x * maskf).sum(-1) / maskf.sum(-1)).unsqueeze(-1)


@torch.no_grad()
def _gate_weights(gate, old, roll, maskf):
    """OpenRLHF's IS-correction weight for the gates policy_loss's TIS modes do not express (sequence-level or
    divergence gating): the per-token ratio pi_old / pi_rollout where the unit's statistic lies in [low, high],
    0 elsewhere. Returns (weight [B, T], is_filter_ratio)."""
    gating, seq, low, high = gate
    log_is = old - roll
    if gating == "ratio":
        stat = torch.exp(_row_mean(log_is, maskf))  # the geometric mean of the sequence's ratios
    else:
        p = roll.exp().clamp(1e-6, 1 - 1e-6)  # rollout and trainer probabilities of the sampled token
        q = old.exp().clamp(1e-6, 1 - 1e-6)
        if gating == "binary_kl":
            stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
        else:  # total variation of the sampled token's Bernoulli
            stat = (p - q).abs()
        if seq:
            stat = _row_mean(stat, maskf)
    keep = (stat >= low) & (stat <= high)
    weight = torch.where(keep, log_is.exp(), torch.zeros((), dtype=log_is.dtype, device=log_is.device))
    dropped = (~keep).float()
    ratio = dropped.mean() if seq else _masked_mean(dropped, maskf)  # per sequence, or per valid token
    return weight, ratio


@torch.no_grad()
def _clip_ratio(d, advantages, maskf, lo, hi):
    """OpenRLHF's `clip_ratio`: the share of valid tokens whose clipped surrogate is the smaller one."""
    r = d.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).exp()
    clipped = ((advantages > 0) & (r > 1.0 + hi)) | ((advantages < 0) & (r < 1.0 - lo))
    return _masked_mean(clipped.float(), maskf)


def _policy_forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                    batch_num_tokens=None, global_batch_size=None):
    import flashrl_kernels as fk

    plan = _policy_plan(self)
    mask = torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None else action_mask
    maskf = mask.to(torch.float32)
    old = old_log_probs.detach()
    d = (log_probs - old).detach()  # OpenRLHF's raw log-ratio
    if plan.correction and rollout_log_probs is None:
        raise ValueError(f"is_correction_level={self.is_correction_level!r} needs rollout_log_probs (the vLLM "
                         "engine's log-probabilities of the sampled tokens)")
    roll = None if rollout_log_probs is None else rollout_log_probs.detach()
    if plan.gspo:
        # GSPO: the sequence ratio is taken to the rollout policy when the IS correction is on, no clamp
        lp, ref = log_probs, (roll if plan.correction else old)
    else:
        # log(ratio) clamped to +-20 (value and zero gradient there): the same on those tokens only
        over = d.abs() > _LOG_RATIO_CLAMP
        lp, ref = torch.where(over, old + d.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP), log_probs), old
    adv = advantages
    filter_ratio = None
    if plan.gate is not None:
        # the clipped loss is linear in A for a given sign, so w * loss(A) = loss(w * A) for the weights w >= 0
        weight, filter_ratio = _gate_weights(plan.gate, old, roll, maskf)
        adv = advantages * weight
    out = fk.policy_loss(lp, ref, adv, mask=mask, rollout_logp=roll if plan.op_tis else None, config=plan.config,
                         normalizer=_normalizer(plan.config.loss_agg_mode == "token-mean", dp_size, batch_num_tokens,
                                                global_batch_size))
    m = out.metrics
    with torch.no_grad():
        if plan.gate is None:  # policy_loss's clip counts are OpenRLHF's clip_ratio (on the same A and ratios)
            clip_ratio = m["clip_frac_low"] + m["clip_frac_high"]
        else:  # A was reweighted: count on the caller's advantages, as OpenRLHF
            clip_ratio = _clip_ratio(d, advantages, maskf, plan.config.eps_low, plan.config.eps_high)
        ppo_kl = _masked_mean(-d, maskf)
        vllm_kl = None
        if plan.correction and not plan.gspo:
            vllm_kl = _masked_mean(roll - old, maskf)
            if plan.op_tis:
                filter_ratio = m["tis_frac_clipped"]
    return out.loss, clip_ratio, ppo_kl, vllm_kl, filter_ratio


def _value_forward(self, values, old_values, returns, action_mask=None, dp_size=1, batch_num_tokens=None,
                   global_batch_size=None):
    import flashrl_kernels as fk

    token = bool(self.token_level_loss)
    out = fk.value_loss(values, old_values, returns, mask=action_mask,
                        clip_range=None if self.clip_eps is None else float(self.clip_eps),
                        loss_agg_mode="token-mean" if token else "seq-mean-token-mean",
                        normalizer=_normalizer(token, dp_size, batch_num_tokens, global_batch_size))
    return out.loss  # value_loss is 0.5 * the aggregated squared error, as OpenRLHF's


def _build_classes(policy_base, value_base):
    class PolicyLoss(policy_base):
        """OpenRLHF's PolicyLoss (same constructor, forward and 5-tuple) computed by flashrl_kernels.policy_loss."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)  # OpenRLHF's own checks
            _policy_plan(self)  # and what policy_loss cannot take, at construction

        forward = _policy_forward

    class ValueLoss(value_base):
        """OpenRLHF's ValueLoss (0.5 x the aggregated clipped squared error) computed by flashrl_kernels.value_loss."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            c = self.clip_eps
            if c is not None and not float(c) > 0.0:
                raise ValueError(f"clip_eps={c}: flashrl_kernels.value_loss clips to old_values +- clip_eps with "
                                 "clip_eps > 0 (None: no clipping)")

        forward = _value_forward

    for cls in (PolicyLoss, ValueLoss):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
    return PolicyLoss, ValueLoss


def __getattr__(name):  # PEP 562: flashrl's PolicyLoss / ValueLoss subclasses, built on first use
    if name in ("PolicyLoss", "ValueLoss"):
        _ensure_classes()
        return _classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _ensure_classes():
    if not _classes:
        _check_version()
        from openrlhf.models import loss as orl_loss

        policy = _originals.get(("openrlhf.models.loss", "PolicyLoss"), orl_loss.PolicyLoss)
        value = _originals.get(("openrlhf.models.loss", "ValueLoss"), orl_loss.ValueLoss)
        _classes["PolicyLoss"], _classes["ValueLoss"] = _build_classes(policy, value)


# ---------------------------------------------------------------------------------------------- GAE

@torch.no_grad()
def get_advantages_and_returns(self, values, rewards, action_mask, gamma, lambd):
    """RemoteExperienceMaker.get_advantages_and_returns on flashrl_kernels.gae. OpenRLHF zeroes the values and
    rewards outside the action mask and runs the recurrence over every position (a masked position inside a
    response passes gamma * V_next on); gae over all positions of the masked inputs is exactly that."""
    import flashrl_kernels as fk

    if action_mask is not None:
        values = action_mask * values
        rewards = action_mask * rewards
    dtype = torch.promote_types(values.dtype, rewards.dtype)
    work = dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    out = fk.gae(rewards.to(work), values.to(work), gamma=float(gamma), lam=float(lambd))
    return out.advantages.to(dtype), out.returns.to(dtype)


# ---------------------------------------------------------------------------------------------- patch

def _set(module_name: str, attr: str, value) -> None:
    module = sys.modules.get(module_name)
    if module is None or not hasattr(module, attr):
        return
    _originals.setdefault((module_name, attr), getattr(module, attr))
    setattr(module, attr, value)


def _set_method(module_name: str, cls_name: str, meth: str, value) -> None:
    cls = getattr(sys.modules[module_name], cls_name)
    _originals.setdefault((module_name, f"{cls_name}.{meth}"), cls.__dict__[meth])
    setattr(cls, meth, value)


def _patch_gae(module) -> None:
    if _patched:  # the import may come after unpatch(): then nothing to do
        _set_method(module.__name__, "RemoteExperienceMaker", "get_advantages_and_returns",
                    get_advantages_and_returns)


class _PostImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Patches openrlhf.trainer.ppo_utils.experience_maker right after it is imported (it pulls in Ray, the
    datasets stack and the Ray launchers: patch() does not import it for the processes that never use it)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _GAE_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                self._loader = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self._loader
        module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _patch_gae(module)


def patch() -> None:
    """Route OpenRLHF's log-probs, entropy, policy and value losses and GAE through flashrl_kernels. Idempotent."""
    global _patched, _finder, _ACTOR_SIGNATURE
    if _patched:
        return
    version = _check_version()
    import openrlhf.models  # noqa: F401  (loss, utils, actor)
    from openrlhf.models import actor as orl_actor

    _ensure_classes()
    policy, value = _classes["PolicyLoss"], _classes["ValueLoss"]
    for module_name in ("openrlhf.models.loss", "openrlhf.models", "openrlhf.trainer.ray.ppo_actor"):
        _set(module_name, "PolicyLoss", policy)
    for module_name in ("openrlhf.models.loss", "openrlhf.models", "openrlhf.trainer.ray.ppo_critic"):
        _set(module_name, "ValueLoss", value)
    for module_name in ("openrlhf.models.utils", "openrlhf.models.actor"):
        _set(module_name, "log_probs_from_logits", log_probs_from_logits)
        _set(module_name, "compute_entropy", compute_entropy)
    original_forward = orl_actor.Actor.__dict__["forward"]
    _ACTOR_SIGNATURE = inspect.signature(_originals.get(("openrlhf.models.actor", "Actor.forward"), original_forward))
    _set_method("openrlhf.models.actor", "Actor", "forward", _actor_forward)
    _patched = True
    if _GAE_MODULE in sys.modules:
        _patch_gae(sys.modules[_GAE_MODULE])
    else:
        _finder = _PostImport()
        sys.meta_path.insert(0, _finder)
    logger.info("flashrl_kernels patched openrlhf %s: Actor.forward logits -> token_logprobs / linear_token_logprobs, "
                "PolicyLoss -> policy_loss, ValueLoss -> value_loss, GAE -> gae", version)


def unpatch() -> None:
    """Undo patch(): OpenRLHF's own functions and classes are back. Idempotent."""
    global _patched, _finder
    if not _patched:
        return
    if _finder is not None:
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None
    for (module_name, attr), original in _originals.items():
        module = sys.modules.get(module_name)
        if module is None:
            continue
        if "." in attr:
            cls_name, meth = attr.split(".")
            setattr(getattr(module, cls_name), meth, original)
        else:
            setattr(module, attr, original)
    # modules imported while patched bound flashrl's objects by name (`from openrlhf.models import PolicyLoss`)
    ours = {id(_classes.get("PolicyLoss")): ("openrlhf.models.loss", "PolicyLoss"),
            id(_classes.get("ValueLoss")): ("openrlhf.models.loss", "ValueLoss"),
            id(log_probs_from_logits): ("openrlhf.models.utils", "log_probs_from_logits"),
            id(compute_entropy): ("openrlhf.models.utils", "compute_entropy")}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "openrlhf" or name.startswith("openrlhf.")):
            continue
        for attr, value in list(vars(module).items()):
            key = ours.get(id(value))
            if key is not None and key in _originals:
                setattr(module, attr, _originals[key])
    _patched = False
    logger.info("flashrl_kernels unpatched openrlhf")


def is_patched() -> bool:
    return _patched


# ---------------------------------------------------------------------------------------------- Ray

def ray_worker_setup() -> None:
    """Ray `worker_process_setup_hook`: patch OpenRLHF in this worker process.

    Runs in every Ray worker before any task or actor: `import flashrl_kernels` applies FLASHRL_PATCH (if set),
    then OpenRLHF is patched. A failure (unsupported OpenRLHF, missing package) raises, and Ray stops the worker
    with the error, rather than training silently without flashrl."""
    import flashrl_kernels  # noqa: F401

    patch()


def ray_runtime_env(runtime_env: dict | None = None) -> dict:
    """`runtime_env` (a dict, not modified) with flashrl's worker setup hook added, and this process's FLASHRL_*
    variables (FLASHRL_PATCH, FLASHRL_BACKEND, FLASHRL_OPENRLHF_FUSED_HEAD, ...) in its env_vars unless the caller
    set them there: workers of a cluster started with `ray start` do not inherit the driver's environment."""
    env = dict(runtime_env or {})
    env["env_vars"] = dict(env.get("env_vars") or {})  # Ray writes the hook into env_vars: never the caller's dict
    for name, value in os.environ.items():
        if name.startswith("FLASHRL_"):
            env["env_vars"].setdefault(name, value)
    hook = env.get("worker_process_setup_hook")
    if hook is ray_worker_setup:
        hook = RAY_SETUP_HOOK  # the same hook, by its importable name
    if hook not in (None, RAY_SETUP_HOOK):
        raise ValueError(f"runtime_env already has worker_process_setup_hook={hook!r}; Ray takes one hook: call "
                         f"{RAY_SETUP_HOOK}() from it instead")
    env["worker_process_setup_hook"] = RAY_SETUP_HOOK
    return env


def main(argv=None) -> None:
    """`python -m flashrl_kernels.integrations.openrlhf MODULE [ARGS...]`: run MODULE (e.g.
    openrlhf.cli.train_ppo_ray) as `python -m MODULE ARGS...` would, patched, with flashrl's worker setup hook
    added to the runtime_env of the `ray.init` it calls (a cluster it connects to runs its Ray workers with the
    hook too)."""
    import functools
    import runpy

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(main.__doc__)
        raise SystemExit(0 if argv else 2)
    module, rest = argv[0], argv[1:]
    patch()
    import ray

    init = ray.init

    @functools.wraps(init)
    def init_with_hook(*args, **kwargs):
        kwargs["runtime_env"] = ray_runtime_env(kwargs.get("runtime_env"))
        return init(*args, **kwargs)

    ray.init = init_with_hook
    try:
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        ray.init = init


if __name__ == "__main__":  # run the package's module object (its state is what patch() / is_patched() see)
    importlib.import_module("flashrl_kernels.integrations.openrlhf").main()
