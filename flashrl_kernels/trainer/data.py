"""Batching and evaluation helpers shared by the warm start and the RL loop."""
from __future__ import annotations

import re

import torch

from .task import Problem, exact_match_reward


def encode_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    return [tokenizer(p).input_ids for p in prompts]


def pad_left(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
    return ids, mask


def flawed_text(answer: int | str) -> str:
    """The answer with the warm start's habit the verifier rejects: a redundant leading zero on the number
    (arith: "07"), or on the first single-digit running total of a chain ("3+4=07,...")."""
    if isinstance(answer, int):
        return "0" + str(answer) if answer >= 0 else str(answer)
    return re.sub(r"=(\d)(?=,|$)", r"=0\1", answer, count=1)


def sft_batch(tokenizer, problems: list[Problem], flawed: list[bool] | None = None):
    """(input_ids, attention_mask, labels) with labels only on the answer and EOS.

    `flawed[i]`: write problem i's answer with a redundant leading zero ("07"),
    a habit the exact-match verifier rejects (see warmstart.py).
    """
    seqs, n_prompt = [], []
    for i, p in enumerate(problems):
        prompt = tokenizer(p.prompt).input_ids
        text = flawed_text(p.answer) if flawed is not None and flawed[i] else str(p.answer)
        answer = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        seqs.append(prompt + answer)
        n_prompt.append(len(prompt))
    ids, mask = pad_left(seqs, tokenizer.pad_token_id)
    labels = torch.full_like(ids, -100)
    width = ids.shape[1]
    for i, (s, k) in enumerate(zip(seqs, n_prompt)):
        start = width - len(s) + k
        labels[i, start:] = ids[i, start:]
    return ids, mask, labels


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 256) -> list[str]:
    was_training = model.training
    model.eval()
    out = []
    for i in range(0, len(prompts), batch_size):
        ids, mask = pad_left(encode_prompts(tokenizer, prompts[i:i + batch_size]), tokenizer.pad_token_id)
        gen = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )
        out += tokenizer.batch_decode(gen[:, ids.shape[1]:], skip_special_tokens=True)
    model.train(was_training)
    return out


def accuracy(model, tokenizer, problems: list[Problem], max_new_tokens: int, score=None) -> float:
    """Mean of score(greedy answer, answer) over the problems (default: exact match)."""
    score = score or exact_match_reward
    answers = greedy_answers(model, tokenizer, [p.prompt for p in problems], max_new_tokens)
    return sum(score(a, p.answer) for a, p in zip(answers, problems)) / len(problems)
