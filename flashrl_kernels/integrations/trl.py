"""Drop-in acceleration for TRL's GRPOTrainer.

    import flashrl_kernels
    flashrl_kernels.patch("trl")          # or flashrl_kernels.integrations.trl.patch(), or FLASHRL_PATCH=trl

What `patch()` replaces (TRL >= 1.16, < 1.17; other versions are refused with a RuntimeError):

- `trl.trainer.utils._ChunkedLogProbFunction`: the fused LM head that TRL's `add_fused_lm_head` forward calls
  with the last hidden states and the lm_head weight. Replaced by `flashrl_kernels.linear_token_logprobs`
  (log-probabilities and entropy; the [N, V] logits are never built). Every call the op cannot serve exactly
  (soft-capped or scaled logits, extra outputs such as `log_sum_sq_probs`, empty batches, devices other
  than CPU/CUDA) goes to TRL's own kernel, with a one-time warning per reason.
- `trl.trainer.utils._use_triton` as seen by that forward: on CPU and CUDA only the completion positions are
  scored (TRL scores every position on CPU, prompt included, then zeroes the prompt part; the result is the same).
- `GRPOTrainer._compute_loss`: the clipped-ratio loss, KL term and aggregation run in
  `flashrl_kernels.policy_loss`. Configurations it does not map exactly fall back to TRL's own
  `_compute_loss` with a one-time warning per reason. See docs/integrations/trl.md for the mapping.

`unpatch()` puts TRL's original objects back. Both are idempotent.
"""
from __future__ import annotations

import logging
import warnings

import torch

SUPPORTED_TRL = (1, 16)  # major, minor of the TRL releases this adapter was written and tested against
SUPPORTED_RANGE = ">=1.16,<1.17"

# Loss types whose loss is -min(r A, clip(r) A) (+ beta KL), i.e. what policy_loss computes; the value is
# LossConfig.loss_agg_mode (the divisor is passed per call, see _normalizer).
_LOSS_AGG = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum",
    "dapo": "token-mean",
    "luspo": "seq-mean-token-sum",
}
# Inputs GRPOTrainer forwards to _get_per_token_logps_and_entropies for multimodal models
_MODEL_INPUT_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)

logger = logging.getLogger(__name__)

_originals: dict = {}     # name -> TRL's object, filled at the first patch(), kept after unpatch()
_capture: list | None = None  # set by _compute_loss while TRL's forward runs: the fused head's inputs land here
_patched = False
_warned: set = set()


class FlashrlFallbackWarning(UserWarning):
    """A step ran TRL's own code because flashrl_kernels cannot reproduce it exactly."""


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"flashrl_kernels TRL integration: {reason}; using TRL's own code for it", FlashrlFallbackWarning,
                      stacklevel=3)


def _check_version():
    import trl

    from ._versions import release_of, require_supported

    version = getattr(trl, "__version__", "unknown")
    release = release_of(version)
    return require_supported("TRL", "trl", version, release is not None and release[:2] == SUPPORTED_TRL,
                             SUPPORTED_RANGE, "It replaces private TRL functions whose signatures change between "
                             "releases")


def patch() -> None:
    """Route TRL's GRPOTrainer log-probabilities and loss through flashrl_kernels (idempotent, reversible)."""
    global _patched
    if _patched:
        return
    version = _check_version()
    import trl.trainer.utils as trl_utils
    from trl import GRPOTrainer

    if not _originals:
        _originals["chunked"] = trl_utils._ChunkedLogProbFunction
        _originals["use_triton"] = trl_utils._use_triton
        _originals["compute_loss"] = GRPOTrainer.__dict__["_compute_loss"]
    trl_utils._ChunkedLogProbFunction = FlashrlChunkedLogProb
    trl_utils._use_triton = _score_completions_only
    GRPOTrainer._compute_loss = _compute_loss
    _warned.clear()
    _patched = True
    logger.info(
        "flashrl_kernels patched trl %s: trl.trainer.utils._ChunkedLogProbFunction -> linear_token_logprobs, "
        "GRPOTrainer._compute_loss -> policy_loss (unsupported options fall back to TRL with a warning)", version)


def unpatch() -> None:
    """Restore TRL's original functions (idempotent)."""
    global _patched
    if not _patched:
        return
    import trl.trainer.utils as trl_utils
    from trl import GRPOTrainer

    trl_utils._ChunkedLogProbFunction = _originals["chunked"]
    trl_utils._use_triton = _originals["use_triton"]
    GRPOTrainer._compute_loss = _originals["compute_loss"]
    _patched = False
    logger.info("flashrl_kernels unpatched trl: TRL's own log-prob kernel and loss are back")


def is_patched() -> bool:
    return _patched


# ---------------------------------------------------------------- log-probabilities (the fused LM head)

def _score_completions_only(device) -> bool:
    """Stands in for `_use_triton` in trl.trainer.utils, where it only decides whether the fused head scores
    just the labelled rows (True) or every row. Scoring only the labelled rows is what TRL does on CUDA; the
    per-token outputs are the same (zero where the label is -100, without gradient there)."""
    return device.type in ("cpu", "cuda") or _originals["use_triton"](device)


def _logprob_unsupported(hidden, weight, bias, targets, temperature, softcap, logit_scale, outputs):
    extra = [o for o in outputs if o not in ("log_probs", "entropy")]
    if extra:
        return f"fused LM head outputs {extra} are not computed by linear_token_logprobs"
    if softcap is not None:
        return "final_logit_softcapping is not supported by linear_token_logprobs"
    if logit_scale != 1.0:
        return f"logit_scale={logit_scale} is not supported by linear_token_logprobs"
    if hidden.device.type not in ("cpu", "cuda"):
        return f"device {hidden.device.type} has no flashrl_kernels backend"
    if type(weight) is not torch.Tensor and not isinstance(weight, torch.nn.Parameter):
        return f"lm_head weight of type {type(weight).__name__}"
    if getattr(weight, "ds_id", None) is not None:
        # DeepSpeed ZeRO-3 re-partitions the gathered weight when TRL's gather context exits: a backward (or the
        # fused loss, which runs after the forward) would see an empty tensor; TRL's own head gathers it again
        return "a DeepSpeed ZeRO-3 partitioned lm_head weight"
    if hidden.dim() != 2 or hidden.shape[0] == 0:
        return "an empty batch (no labelled position)"
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        return f"temperature={temperature!r}"
    return None


class FlashrlChunkedLogProb:
    """Takes the place of `trl.trainer.utils._ChunkedLogProbFunction` (called as `.apply(...)` with the same
    arguments, returning the same 5-tuple: log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None, logit_scale=1.0,
              outputs=("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):
        reason = _logprob_unsupported(hidden, weight, bias, targets, temperature, final_logit_softcapping,
                                      logit_scale, outputs)
        if reason is not None:
            _warn_once(reason)
            return _originals["chunked"].apply(hidden, weight, bias, targets, temperature, chunk_size,
                                               final_logit_softcapping, logit_scale, outputs)
        from ..ops import linear_token_logprobs

        device = hidden.device.type
        # TRL runs the projection in the autocast dtype when autocast is on, else in the hidden states' dtype
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        if _capture is not None:  # _compute_loss runs the head itself (linear_policy_loss): hand back placeholders
            _capture.append({"hidden": hidden.to(dtype), "weight": weight.to(dtype), "targets": targets,
                             "bias": None if bias is None else bias.to(dtype), "temperature": float(temperature)})
            zeros = hidden.new_zeros(hidden.shape[0], dtype=torch.float32)
            return zeros, (zeros if "entropy" in outputs else None), None, None, None
        want_entropy = "entropy" in outputs
        with torch.autocast(device, enabled=False):
            out = linear_token_logprobs(
                hidden.to(dtype), weight.to(dtype), targets, bias=None if bias is None else bias.to(dtype),
                temperature=float(temperature), return_entropy=want_entropy)
        logp, entropy = out if want_entropy else (out, None)
        return logp, entropy, None, None, None


# ---------------------------------------------------------------- the loss

def _loss_unsupported(trainer, inputs):
    if trainer.loss_type not in _LOSS_AGG:
        return f"loss_type={trainer.loss_type!r} is not mapped to policy_loss"
    if trainer.importance_sampling_level not in ("token", "sequence"):
        return f"importance_sampling_level={trainer.importance_sampling_level!r}"
    if not 0.0 <= trainer.epsilon_low < 1.0 or trainer.epsilon_high < 0.0:
        return f"epsilon={trainer.epsilon_low}, epsilon_high={trainer.epsilon_high} outside policy_loss's range"
    delta = trainer.args.delta
    if delta is not None and not delta > 1.0 + trainer.epsilon_high:
        return (f"delta={delta} <= 1 + epsilon_high (TRL then also caps positive-advantage ratios; policy_loss's "
                "dual clip equals TRL's delta only above 1 + epsilon_high)")
    if getattr(trainer, "_entropy_bonus_enabled", False):
        return "the entropy bonus (entropy_coef / adaptive entropy) is not mapped"
    if getattr(trainer, "aux_loss_enabled", False):
        return "the MoE router auxiliary loss is not mapped"
    if inputs["advantages"].dim() not in (1, 2):
        return f"advantages of shape {tuple(inputs['advantages'].shape)}"
    return None


def _normalizer(trainer, loss_type, mask, inputs, batch):
    """The divisor TRL applies for `loss_type` (including the gradient-accumulation scaling)."""
    train = trainer.model.training
    accumulation = trainer.current_gradient_accumulation_steps if train else 1.0
    if loss_type in ("grpo", "luspo"):
        return float(batch * accumulation)
    if loss_type == "bnpo":
        return mask.sum().float().clamp(min=1.0) * accumulation
    if loss_type == "dr_grpo":
        return float(batch * trainer.max_completion_length * accumulation)
    # dapo: num_items_in_batch spans the generation batch: rescale it to one accumulation window
    items = inputs["num_items_in_batch"]
    items = torch.as_tensor(items, dtype=torch.float32, device=mask.device).clamp(min=1.0)
    norm = items / trainer.accelerator.num_processes
    if train:
        norm = norm * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
    return norm


def _head_fusable(trainer) -> bool:
    """Whether the whole policy head can run as one linear_policy_loss: nothing between TRL's logprobs and its
    loss may need the logprobs (the off-policy mask, the high-entropy mask and the bias-corrected KL do)."""
    if trainer.off_policy_mask_threshold is not None or trainer.top_entropy_quantile < 1.0:
        return False
    return not (float(trainer.beta) != 0.0 and trainer.args.use_bias_correction_kl)


def _policy_logps(self, model, inputs, completion_mask, fused):
    """TRL's forward for the loss. fused: the fused head's inputs are captured instead of scored (the returned
    logprobs are placeholders); returns (logp, entropies, captured head or None)."""
    global _capture
    prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
    _capture = [] if fused else None
    try:
        logp, entropies, _ = self._get_per_token_logps_and_entropies(
            model,
            torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], completion_mask], dim=1),
            completion_ids.size(1),
            compute_entropy=True,
            **{key: inputs.get(key) for key in _MODEL_INPUT_KEYS},
        )
        captured = _capture
    finally:
        _capture = None
    if not fused:
        return logp, entropies, None
    labelled = completion_mask.bool()
    if len(captured) == 1 and torch.equal(captured[0]["targets"], completion_ids[labelled]):
        return logp, entropies, captured[0]
    # the fused head was not reached, or scored other rows than the completion tokens: score them the usual way
    _warn_once("the fused LM head did not see exactly the completion tokens (linear_policy_loss needs them)")
    return _policy_logps(self, model, inputs, completion_mask, fused=False)


def _fused_head_loss(head, completion_mask, mask, old, effective_adv, cfg, kwargs, normalizer):
    """The loss straight from the captured hidden states (linear_policy_loss: no logits, 6NHV), packed over the
    completion tokens; returns (loss, logp [B, T], entropies [B, T]) with the logprobs detached for logging."""
    from ..loss_config import LossConfig
    from ..ops import linear_policy_loss

    labelled = completion_mask.bool()
    lengths = labelled.sum(1)
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    b, t = completion_mask.shape
    adv = effective_adv.expand(b, t)[labelled]  # [B, 1] or [B, T] (TRL's factors) -> per completion token
    ref = kwargs.get("ref_logp")  # the only extra input on this path (the bias-corrected KL does not fuse)
    out, lp, ent = linear_policy_loss(
        head["hidden"], head["weight"], head["targets"], None if old is None else old[labelled], adv,
        bias=head["bias"], mask=mask.bool()[labelled], cu_seqlens=cu, temperature=head["temperature"],
        config=LossConfig(**cfg), normalizer=normalizer, return_logprobs=True,
        ref_logp=None if ref is None else ref[labelled],
    )
    logp = lp.new_zeros(b, t).masked_scatter(labelled, lp)
    entropies = ent.new_zeros(b, t).masked_scatter(labelled, ent)
    return out.loss, logp, entropies


def _compute_loss(self, model, inputs):
    """GRPOTrainer._compute_loss on flashrl_kernels (linear_policy_loss where the whole head fuses, else
    policy_loss on TRL's logprobs); same loss, gradients and logged metrics."""
    reason = _loss_unsupported(self, inputs)
    if reason is not None:
        _warn_once(reason)
        return _originals["compute_loss"](self, model, inputs)
    from ..loss_config import LossConfig
    from ..ops import policy_loss

    completion_mask = inputs["completion_mask"]
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    logp, entropies, head = _policy_logps(self, model, inputs, completion_mask, _head_fusable(self))
    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old_given = inputs.get("old_per_token_logps")
    old = logp.detach() if old_given is None else old_given
    level = self.importance_sampling_level

    # TRL multiplies the clipped term by constant per-token (or per-sequence) factors: the off-policy sequence
    # mask, the high-entropy token mask and the vLLM importance-sampling ratio it computed at generation time.
    # For a factor w >= 0, w * L_clip(A, r) = L_clip(w A, r) (the clipped term is linear in A and its branch
    # depends only on the sign of A), so they are folded into the advantages: same loss, same gradient.
    factor = None
    if self.off_policy_mask_threshold is not None:
        factor = self.get_off_policy_mask(
            advantages=advantages, per_token_logps=logp, mask=mask,
            sampling_per_token_logps=inputs.get("sampling_per_token_logps", old),
            off_policy_threshold=self.off_policy_mask_threshold)
    if self.top_entropy_quantile < 1.0:
        entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        factor = entropy_mask.float() if factor is None else factor * entropy_mask
    if self.use_vllm and self.vllm_importance_sampling_correction:
        ratio = inputs["importance_sampling_ratio"]
        factor = ratio if factor is None else factor * ratio
    effective_adv = advantages if factor is None else advantages * factor

    loss_type = self.loss_type
    beta = float(self.beta)
    cfg = {"eps_low": float(self.epsilon_low), "eps_high": float(self.epsilon_high),
               "dual_clip": None if self.args.delta is None else float(self.args.delta),
               "importance_sampling_level": level, "loss_agg_mode": _LOSS_AGG[loss_type]}
    kwargs = {}
    if beta != 0.0:
        ref = inputs["ref_per_token_logps"]
        if self.args.use_bias_correction_kl:
            # TRL weights the k3 KL by the importance ratio (with its gradient). policy_loss has no such term, but
            # it aggregates its entropy input like the loss (L_t += -entropy_coef * H_t): feeding -kl_t * ratio
            # there with entropy_coef = beta adds beta * kl_t * ratio under the same aggregation and divisor.
            log_ratio = logp - old
            if level == "sequence":
                log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
            y = ref - logp
            kwargs["entropy"] = -((torch.exp(y) - y - 1) * torch.exp(log_ratio))
            cfg["entropy_coef"] = beta
        else:
            kwargs["ref_logp"] = ref
            cfg["beta"] = beta
    normalizer = _normalizer(self, loss_type, mask, inputs, logp.size(0))
    if head is not None:
        loss, logp, entropies = _fused_head_loss(head, completion_mask, mask, old_given, effective_adv, cfg, kwargs,
                                                 normalizer)
        _log_metrics(self, logp, logp if old_given is None else old_given, advantages, mask, entropies, inputs, beta)
        return loss
    out = policy_loss(logp, old, effective_adv, mask=mask, config=LossConfig(**cfg), normalizer=normalizer, **kwargs)
    _log_metrics(self, logp.detach(), old, advantages, mask, entropies, inputs, beta)
    return out.loss


@torch.no_grad()
def _log_metrics(trainer, logp, old, advantages, mask, entropies, inputs, beta):
    """The metrics TRL's _compute_loss logs for the clipped loss types, with TRL's definitions (sequence-level
    ratios count once per sequence, per-sequence minima and maxima across processes)."""
    from trl.trainer.utils import nanmax, nanmin

    mode = "train" if trainer.model.training else "eval"
    metrics = trainer._metrics[mode]
    acc = trainer.accelerator
    maskf = mask.float()

    def global_mean(x):
        if x.shape[1] == 1:   # one value per sequence
            total, count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
        else:
            total, count = (x * maskf).sum(), maskf.sum()
        total, count = acc.reduce(torch.stack([total.float(), count.float()]), reduction="sum")
        return (total / count.clamp(min=1.0)).item()

    def per_sequence_mean(x):
        return x.squeeze(1) if x.shape[1] == 1 else (x * maskf).sum(-1) / maskf.sum(-1)

    log_ratio = logp - old
    if trainer.importance_sampling_level == "sequence":
        log_ratio = (log_ratio * maskf).sum(-1, keepdim=True) / maskf.sum(-1, keepdim=True).clamp(min=1.0)
    ratio = torch.exp(log_ratio)
    if beta != 0.0:
        y = inputs["ref_per_token_logps"] - logp
        kl = torch.exp(y) - y - 1
        if trainer.args.use_bias_correction_kl:
            kl = kl * ratio
        metrics["kl"].append(global_mean(kl))
    metrics["entropy"].append(global_mean(entropies.detach()))
    if trainer.args.delta is not None:
        ratio = ratio.clamp(max=trainer.args.delta)
    low = ((ratio < 1 - trainer.epsilon_low) & (advantages < 0)).float()
    high = ((ratio > 1 + trainer.epsilon_high) & (advantages > 0)).float()
    metrics["clip_ratio/low_mean"].append(global_mean(low))
    metrics["clip_ratio/high_mean"].append(global_mean(high))
    metrics["clip_ratio/region_mean"].append(global_mean(torch.maximum(low, high)))
    metrics["clip_ratio/low_min"].append(nanmin(acc.gather(per_sequence_mean(low))).item())
    metrics["clip_ratio/high_max"].append(nanmax(acc.gather(per_sequence_mean(high))).item())
