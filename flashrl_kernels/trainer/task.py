"""The built-in tasks: integer arithmetic generated in code, with verifiable rewards.

`arith` (the demo's): prompts look like "12+7=" and the answer is the decimal
result followed by the end-of-sequence token: 2-4 generated tokens.
`chain` (rollout-heavy): a sum of 7 to 14 single-digit terms, "3+5+2+7+1+...=",
whose answer writes every running total out, "3+5=8,8+2=10,10+7=17,...":
36 to 120 generated tokens (66 on average), so sampling dominates a step as it
does at scale.
Train and held-out problems are disjoint sets drawn by seed, so held-out
accuracy measures generalisation, not recall.

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
    answer: int | str  # the exact completion the verifier accepts (an int: its canonical decimal form)


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

    @property
    def n_train(self) -> int:
        return len(self.ops) * self.max_operand**2 - self.n_eval

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
    def max_prompt_chars(self) -> int:
        return 2 * len(str(self.max_operand - 1)) + 2

    @property
    def max_answer_chars(self) -> int:
        m = self.max_operand - 1
        biggest = max(2 * m if "+" in self.ops else 0, m * m if "*" in self.ops else 0, m)
        return len(str(biggest)) + ("-" in self.ops)


@dataclasses.dataclass(frozen=True)
class ChainSumTask:
    """Sums of `min_terms`..`max_terms` terms in [0, max_operand), answered as the chain of running totals.

    The verifier discipline is the arithmetic task's: exact match of the canonical text (every total in
    canonical decimal, "," between steps), so one wrong or zero-padded total fails the whole answer."""

    max_operand: int = 10
    min_terms: int = 7
    max_terms: int = 14
    n_eval: int = 64
    n_train: int = 4096
    seed: int = 0

    def __post_init__(self):
        if not 2 <= self.max_operand <= 10:
            raise ValueError(f"max_operand must be in [2, 10] for the chain task (single-digit terms), "
                             f"got {self.max_operand}")
        if not 2 <= self.min_terms <= self.max_terms:
            raise ValueError(f"need 2 <= min_terms <= max_terms, got {self.min_terms}, {self.max_terms}")
        if self.n_eval <= 0 or self.n_train <= 0:
            raise ValueError("n_eval and n_train must be > 0")

    @staticmethod
    def chain(terms: list[int]) -> str:
        total, steps = terms[0], []
        for t in terms[1:]:
            steps.append(f"{total}+{t}={total + t}")
            total += t
        return ",".join(steps)

    def splits(self) -> tuple[list[Problem], list[Problem]]:
        """(train, held_out): disjoint (by prompt), fixed by seed."""
        rng = random.Random(self.seed)
        seen: set[str] = set()
        out: list[Problem] = []
        while len(out) < self.n_eval + self.n_train:
            terms = [rng.randrange(self.max_operand) for _ in range(rng.randint(self.min_terms, self.max_terms))]
            prompt = "+".join(map(str, terms)) + "="
            if prompt not in seen:
                seen.add(prompt)
                out.append(Problem(prompt, self.chain(terms)))
        return out[self.n_eval:], out[: self.n_eval]

    @property
    def alphabet(self) -> str:
        return "0123456789+=,"

    @property
    def max_answer_chars(self) -> int:
        m, n = self.max_operand - 1, self.max_terms
        return sum(len(f"{m * k}+{m}={m * (k + 1)}") for k in range(1, n)) + (n - 2)  # + the commas

    @property
    def max_prompt_chars(self) -> int:
        return 2 * self.max_terms


def parse_answer(text: str) -> int | None:
    text = text.strip()
    return int(text) if _INT.match(text) else None


def exact_match_reward(completion: str, answer: int) -> float:
    return 1.0 if completion.strip() == str(answer) else 0.0


def calculation_reward(completion: str, answer: int, eps: float = 1e-6) -> float:
    if not isinstance(answer, int):
        raise TypeError("the calculation reward scores a single integer answer (task 'arith')")
    value = parse_answer(completion)
    if value is None:
        return 0.0
    d = abs(value - answer)
    return 1.0 - 0.5 * min(d, 1.0) - 0.5 * min(d / (abs(answer) + eps), 1.0)


def chain_step_reward(completion: str, answer: str) -> float:
    """Share of the chain's running-total steps written exactly right, in their places ("a+b=s" between commas),
    over the longer of the two chains: 1 only for the exact answer; extra or missing steps count as wrong. The
    exact-match discipline per step, with credit for a partly right chain (a tiny model rarely gets all 6-13
    steps of a held-out sum right at the start, and RL needs some signal)."""
    if not isinstance(answer, str):
        raise TypeError("the steps reward scores a chain of running totals (task 'chain')")
    want, got = answer.split(","), completion.strip().split(",")
    return sum(a == b for a, b in zip(want, got)) / max(len(want), len(got))


REWARDS = {"exact": exact_match_reward, "calculation": calculation_reward, "steps": chain_step_reward}
DEFAULT_REWARD = {"arith": "exact", "chain": "steps"}  # reward "auto"
