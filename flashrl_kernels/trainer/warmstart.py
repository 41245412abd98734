"""Supervised warm start on the task, cached on disk so the demo does not repeat it.

RL needs a policy that already samples a correct answer sometimes; a few
hundred steps of cross-entropy on the train split give that. The
demonstrations are imperfect on purpose, as real SFT data is: a share
`warmstart_flaw` of them writes the answer with a redundant leading zero
("07"), which the exact-match verifier rejects. The warm-started model keeps
that habit on held-out prompts too; removing it is a skill that transfers,
so verifiable-reward RL on the train split visibly lifts held-out accuracy
(and shortens responses), where on clean data this tiny model would mostly
have memorised its train split already. The result is
saved with save_pretrained (model and tokenizer) under
<cache>/warmstart/<key>, where the key hashes everything that changes it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile

import torch

from .config import TrainConfig
from .data import sft_batch
from .task import ArithmeticTask, ChainSumTask
from .tiny_model import TinyModelConfig, build_char_tokenizer, build_tiny_qwen2

_VERSION = 2  # bump when the warm-start recipe changes


def task_of(cfg: TrainConfig) -> ArithmeticTask | ChainSumTask:
    if cfg.task == "chain":
        return ChainSumTask(max_operand=cfg.max_operand, n_eval=cfg.n_eval, seed=cfg.seed)
    return ArithmeticTask(max_operand=cfg.max_operand, ops=cfg.ops, n_eval=cfg.n_eval, seed=cfg.seed)


def max_positions_of(cfg: TrainConfig) -> int:
    """Positions the model (and the vLLM engine's max_model_len) needs: 64 for the demo's task, enough for the
    longest prompt and answer of the chain task, rounded up to 64."""
    task = task_of(cfg)
    need = task.max_prompt_chars + max(cfg.max_new_tokens, task.max_answer_chars + 1) + 2  # BOS, EOS
    return max(64, -(-need // 64) * 64)


def model_config_of(cfg: TrainConfig) -> TinyModelConfig:
    return TinyModelConfig(hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, max_positions=max_positions_of(cfg))


def warmstart_key(cfg: TrainConfig) -> str:
    task = task_of(cfg)
    fields = {
        "v": _VERSION, "task": dataclasses.asdict(task), "model": dataclasses.asdict(model_config_of(cfg)),
        "steps": cfg.warmstart_steps, "lr": cfg.warmstart_lr, "batch": cfg.warmstart_batch, "seed": cfg.seed,
        "flaw": cfg.warmstart_flaw,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def warm_start(cfg: TrainConfig, progress=None) -> tuple[str, bool]:
    """Path of the warm-started model folder and whether it came from the cache."""
    path = os.path.join(cfg.cache_root, "warmstart", warmstart_key(cfg))
    if os.path.exists(os.path.join(path, "config.json")):
        return path, True
    task = task_of(cfg)
    train, _ = task.splits()
    tokenizer = build_char_tokenizer(task.alphabet)
    model = build_tiny_qwen2(tokenizer, model_config_of(cfg), seed=cfg.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmstart_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    rng = random.Random(cfg.seed)
    for step in range(cfg.warmstart_steps):
        batch = rng.choices(train, k=cfg.warmstart_batch)
        flawed = [rng.random() < cfg.warmstart_flaw for _ in batch]
        ids, mask, labels = sft_batch(tokenizer, batch, flawed)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if progress is not None:
            progress(step + 1, cfg.warmstart_steps, float(loss))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(path))  # write then rename: a killed run leaves no half cache
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return path, False
