"""The built-in task: integer arithmetic generated in code, with verifiable rewards.

Prompts look like "12+7=" and the answer is the decimal result followed by
the end-of-sequence token. Train and held-out problems are disjoint sets
drawn by seed, so held-out accuracy measures generalisation, not recall.

Rewards:
- exact match: 1 if the completion is the answer in canonical decimal form
  ("7", "-3"; not "07" or "+7"), else 0;
- RandomCalculation-style continuous reward for a parsed value a and answer b:
  r = 1 - 0.5 min(|a - b|, 1) - 0.5 min(|a - b| / (|b| + eps), 1); 0 if unparsable.
"""
from __future__ import annotations

import dataclasses
import random
import re

_INT = re.compile(r"^-?\d+$")


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str
    answer: int


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    max_operand: int = 30
    ops: str = "+-"
    n_eval: int = 128
    seed: int = 0

    def __post_init__(self):
        if self.max_operand < 2:
            raise ValueError(f"max_operand must be >= 2, got {self.max_operand}")
        bad = set(self.ops) - set("+-*")
        if not self.ops or bad:
            raise ValueError(f"ops must be a non-empty subset of '+-*', got {self.ops!r}")
        total = len(self.ops) * self.max_operand**2
        if not 0 < self.n_eval < total // 2:
            raise ValueError(f"n_eval must be in (0, {total // 2}) for this task size, got {self.n_eval}")

    def all_problems(self) -> list[Problem]:
        out = []
        for op in self.ops:
            for a in range(self.max_operand):
                for b in range(self.max_operand):
                    val = a + b if op == "+" else a - b if op == "-" else a * b
                    out.append(Problem(f"{a}{op}{b}=", val))
        return out

    def splits(self) -> tuple[list[Problem], list[Problem]]:
        """(train, held_out): disjoint, fixed by seed."""
        probs = self.all_problems()
        random.Random(self.seed).shuffle(probs)
        return probs[self.n_eval:], probs[: self.n_eval]

    @property
    def alphabet(self) -> str:
        return "0123456789-+*="

    @property
    def max_answer_chars(self) -> int:
        m = self.max_operand - 1
        biggest = max(2 * m if "+" in self.ops else 0, m * m if "*" in self.ops else 0, m)
        return len(str(biggest)) + ("-" in self.ops)


def parse_answer(text: str) -> int | None:
    text = text.strip()
    return int(text) if _INT.match(text) else None


def exact_match_reward(completion: str, answer: int) -> float:
    return 1.0 if completion.strip() == str(answer) else 0.0


def calculation_reward(completion: str, answer: int, eps: float = 1e-6) -> float:
    value = parse_answer(completion)
    if value is None:
        return 0.0
    d = abs(value - answer)
    return 1.0 - 0.5 * min(d, 1.0) - 0.5 * min(d / (abs(answer) + eps), 1.0)


REWARDS = {"exact": exact_match_reward, "calculation": calculation_reward}
