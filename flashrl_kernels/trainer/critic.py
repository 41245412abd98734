"""The critic of value-based PPO / VAPO: a scalar head on a copy of the policy's trunk.

Why a copy of the warm-started trunk rather than a separate small model: the
critic must judge partial answers to arithmetic problems, which needs what the
warm start taught the policy (a model trained from scratch would first have to
learn the task), and a copy rather than a shared trunk keeps the value loss
from pulling on the policy's features (the way verl and OpenRLHF initialise
their critic from the actor or a reward model). The head starts at zero, so
the first values are 0 and VC-PPO's value pretraining fits it before any
policy update.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

import flashrl_kernels as fk


class ValueModel(nn.Module):
    def __init__(self, policy):
        super().__init__()
        self.trunk = copy.deepcopy(policy.model)
        self.head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, ids, attn):
        """V(s_t) for every position that predicts a next token: [B, W-1] fp32, aligned with the targets."""
        hidden = self.trunk(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1]
        return self.head(hidden).squeeze(-1)


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sequence reward on each response's last valid token, 0 elsewhere: [B, W-1] fp32."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    has = mask.any(1)
    last = mask.shape[1] - 1 - mask.flip(1).float().argmax(1)
    rows = torch.nonzero(has).squeeze(1)
    out[rows, last[rows]] = rewards[rows].float()
    return out


def value_update(critic, opt, ids, attn, old_values, returns, mask, clip_range, grad_clip):
    """One critic step on (a minibatch of) the batch; returns the value-loss metrics as floats."""
    values = critic(ids, attn)
    out = fk.value_loss(values, old_values, returns, mask=mask, clip_range=clip_range)
    opt.zero_grad(set_to_none=True)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(critic.parameters(), grad_clip or float("inf"))
    opt.step()
    return {"value_loss": float(out.loss.detach()), **{k: float(v) for k, v in out.metrics.items()}}
