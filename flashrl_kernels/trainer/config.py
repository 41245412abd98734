"""Trainer configuration: one flat dataclass, validated at construction.

Every option can come from a YAML file (`flashrl-kernels train --config F`)
or a flag (`--rollout-quant int8`); unknown options and impossible
combinations fail at start with a message naming the option.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from flashrl_kernels._cpu import usable_cpus

ROLLOUT_ENGINES = ("auto", "vllm", "hf")
ROLLOUT_QUANTS = ("bf16", "int8", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's kv_cache_dtype (fp8 on CPU: AVX-512 or AMX)
ADVANTAGES = ("grpo", "dr_grpo", "rloo", "gfpo_length", "gfpo_token_efficiency", "gfpo_adaptive")
LEVELS = ("token", "sequence", "sequence_token")
TIS_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
REWARD_NAMES = ("auto", "exact", "calculation", "steps")  # auto: exact (arith), steps (chain)
ALGOS = ("grpo", "ppo", "vapo")
TASKS = ("arith", "chain")
ROLLOUT_MODES = ("auto", "sync", "async")
INTERRUPTS = ("abort", "keep")
PROXIMALS = ("recompute", "behaviour")
# What --algo sets when an option is left at None ("the algorithm's default"):
#   ppo  = VC-PPO: value pretraining, decoupled GAE (policy lambda 0.95, critic lambda 1.0)
#   vapo = VC-PPO + length-adaptive lambda (alpha 0.05) + the positive-example NLL term (mu 0.1);
#          clip-higher, token-level loss and group sampling are the trainer's defaults for every algo
ALGO_DEFAULTS = {
    "grpo": {"lam": 0.95, "critic_lam": 0.95, "lam_alpha": 0.0, "nll_coef": 0.0},
    "ppo": {"lam": 0.95, "critic_lam": 1.0, "lam_alpha": 0.0, "nll_coef": 0.0},
    "vapo": {"lam": 0.95, "critic_lam": 1.0, "lam_alpha": 0.05, "nll_coef": 0.1},
}


def parse_cpus(text: str, option: str = "engine_cpus") -> list[int]:
    """CPU numbers from "1", "2,3", "4-7" or "0,2-3"; ValueError naming the option otherwise."""
    out: list[int] = []
    try:
        for part in text.split(","):
            a, dash, b = part.strip().partition("-")
            lo, hi = int(a), int(b) if dash else int(a)
            if lo < 0 or hi < lo:
                raise ValueError
            out += range(lo, hi + 1)
    except ValueError:
        raise ValueError(f"option {option} must be a CPU list such as '1', '2,3' or '4-7', got {text!r}") from None
    return sorted(set(out))


@dataclasses.dataclass
class TrainConfig:
    # run
    seed: int = 0
    steps: int = 60
    out_dir: str = "runs/demo"
    eval_every: int = 10
    # task: "arith" (a+b, 2-4 answer tokens: the demo) or "chain" (running totals of 7-14 terms: 36-120 tokens,
    # rollout-heavy)
    task: str = "arith"
    max_operand: int = 10
    ops: str = "+-"
    n_eval: int = 64
    reward: str = "auto"
    # model and warm start
    hidden_size: int = 128
    num_layers: int = 3
    warmstart_steps: int = 300
    warmstart_lr: float = 3e-3
    warmstart_batch: int = 64
    warmstart_flaw: float = 0.5  # share of demonstrations with a leading-zero habit the verifier rejects
    cache_dir: str = ""  # default: $FLASHRL_CACHE_DIR or ~/.cache/flashrl_kernels
    # rollout
    rollout_engine: str = "auto"
    rollout_quant: str = "int8"
    kv_cache_dtype: str = "auto"  # vLLM's KV cache dtype: auto (the model's, bf16) or fp8 (e4m3 / e5m2)
    prompts_per_step: int = 16
    group_size: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 0  # 0: derived from the task
    # asynchronous RL (AReaL): the engine generates while the trainer trains, samples at most max_staleness
    # policy versions old; rollout_mode "auto" = async when max_staleness > 0 ("async" forces the asynchronous
    # engine at 0 too: the synchronous schedule on it)
    max_staleness: int = 0
    rollout_mode: str = "auto"
    interrupt: str = "abort"  # at a weight update: abort and resubmit in-flight requests, or keep their KV
    engine_cpus: str = "auto"  # async: CPUs of the engine process ("1", "2,3", "4-7"); auto: half of them
    trainer_cpus: str = "auto"  # async: CPUs of the trainer; auto: the others; "all": every CPU (shared)
    frontend_cpus: str = "trainer"  # async: where vLLM's front-end threads in this process run ("engine": its CPUs)
    proximal: str = "recompute"  # decoupled PPO (ratio vs the trainer's recompute); behaviour: naive PPO
    # algorithm: grpo (group advantages; GSPO via level) or value-based ppo / vapo (a critic and GAE)
    algo: str = "grpo"
    # advantages and filtering
    advantage: str = "grpo"
    gfpo_keep: int = 4  # GFPO: kept per group (adaptive: for the hardest groups)
    dynamic_sampling: bool = False
    overlong_cache: int = 0  # DAPO soft overlong penalty window in tokens; 0 = off
    # loss
    level: str = "token"
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = 3.0
    tis: str = "token_truncate"
    tis_max: float = 2.0
    tis_min: float = 0.0
    loss_agg: str = "token-mean"
    beta: float = 0.0
    entropy_coef: float = 0.0
    fused_logprobs: bool = False  # linear_policy_loss / linear_token_logprobs from hidden states (no logits)
    # value-based PPO / VAPO (algo ppo or vapo); None = the algorithm's default (ALGO_DEFAULTS)
    gamma: float = 1.0
    lam: float | None = None         # GAE lambda of the advantages
    critic_lam: float | None = None  # GAE lambda of the value targets (VC-PPO's decoupled GAE: 1.0)
    lam_alpha: float | None = None   # VAPO length-adaptive lambda 1 - 1/(alpha * length); 0 = off
    nll_coef: float | None = None    # VAPO positive-example NLL weight (mu)
    whiten_advantages: bool = True
    value_pretrain_steps: int = 20   # VC-PPO: critic-only steps on the warm-started policy's rollouts
    value_lr: float = 1e-3
    value_clip: float | None = 0.5   # clip range of the value loss (None: unclipped)
    # optimisation
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    num_iterations: int = 2  # optimizer passes over each rollout batch
    minibatches: int = 2

    def __post_init__(self):
        self.validate()

    def resolved(self, name: str):
        """Option `name`, with None replaced by the algorithm's default (the field itself stays None, so
        dataclasses.replace(cfg, algo=...) picks up the new algorithm's defaults)."""
        value = getattr(self, name)
        return ALGO_DEFAULTS[self.algo][name] if value is None and name in ALGO_DEFAULTS[self.algo] else value

    @property
    def value_based(self) -> bool:
        return self.algo in ("ppo", "vapo")

    @property
    def reward_name(self) -> str:
        """The reward in use ("auto" resolved by task)."""
        from .task import DEFAULT_REWARD

        return DEFAULT_REWARD[self.task] if self.reward == "auto" else self.reward

    @property
    def is_async(self) -> bool:
        """Whether rollouts come from the asynchronous engine (the engine process generates continuously)."""
        return self.rollout_mode == "async" or (self.rollout_mode == "auto" and self.max_staleness > 0)

    def _check_types(self) -> None:
        """Each option's type (a YAML `dynamic_sampling: "false"` is a string, and a string is true)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if "None" in str(f.type):  # float | None
                kinds, label = (int, float, type(None)), "a number or None"
            else:
                kind = type(f.default)
                kinds, label = ((int, float), "a number") if kind is float else ((kind,), kind.__name__)
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                raise TypeError(f"option {f.name} must be {label}, got {value!r} ({type(value).__name__})")

    def validate(self) -> None:
        self._check_types()

        def choice(name, allowed):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"option {name}={value!r} is not one of {', '.join(map(str, allowed))}")

        def positive(name, zero_ok=False):
            value = getattr(self, name)
            if not (value >= 0 if zero_ok else value > 0):
                raise ValueError(f"option {name} must be {'>= 0' if zero_ok else '> 0'}, got {value}")

        choice("rollout_engine", ROLLOUT_ENGINES)
        choice("rollout_quant", ROLLOUT_QUANTS)
        choice("kv_cache_dtype", KV_CACHE_DTYPES)
        choice("advantage", ADVANTAGES)
        choice("level", LEVELS)
        choice("tis", TIS_MODES)
        choice("loss_agg", AGG_MODES)
        choice("algo", ALGOS)
        choice("reward", REWARD_NAMES)
        choice("task", TASKS)
        choice("rollout_mode", ROLLOUT_MODES)
        choice("frontend_cpus", ("engine", "trainer"))
        choice("interrupt", INTERRUPTS)
        choice("proximal", PROXIMALS)
        for name in ("steps", "prompts_per_step", "group_size", "num_iterations", "minibatches", "eval_every",
                     "temperature", "lr", "warmstart_lr", "warmstart_batch", "hidden_size", "num_layers"):
            positive(name)
        for name in ("warmstart_steps", "max_new_tokens", "overlong_cache", "beta", "entropy_coef", "grad_clip",
                     "weight_decay", "eps_low", "eps_high", "tis_min", "value_pretrain_steps", "max_staleness"):
            positive(name, zero_ok=True)
        positive("value_lr")
        if not 0 <= self.seed < 2**32:  # vLLM seeds numpy with it (and the warm start, torch and the sampler)
            raise ValueError(f"option seed must be in [0, 2**32), got {self.seed}")
        for name in ("lam_alpha", "nll_coef"):
            if not self.resolved(name) >= 0:
                raise ValueError(f"option {name} must be >= 0, got {self.resolved(name)}")
        for name in ("gamma", "lam", "critic_lam"):
            if not 0.0 <= self.resolved(name) <= 1.0:
                raise ValueError(f"option {name} must be in [0, 1], got {self.resolved(name)}")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ValueError(f"option value_clip must be > 0 (or None), got {self.value_clip}")
        if self.value_based and self.advantage != "grpo":
            raise ValueError(
                f"option advantage={self.advantage!r} is for group advantages; algo={self.algo!r} takes its "
                "advantages from GAE over the critic's values (leave advantage at 'grpo')"
            )
        if not self.value_based and self.resolved("nll_coef"):
            raise ValueError(f"option nll_coef needs algo='vapo' (or 'ppo'), got algo={self.algo!r}")
        if self.hidden_size % 4 or self.hidden_size // 4 not in (32, 64, 80, 96, 112, 128, 256):
            raise ValueError(
                f"option hidden_size must be 4 x a head size vLLM's CPU attention supports "
                f"(32, 64, 80, 96, 112, 128, 256), e.g. 128 or 256; got {self.hidden_size}"
            )
        if not 0.0 <= self.warmstart_flaw < 1.0:
            raise ValueError(f"option warmstart_flaw must be in [0, 1), got {self.warmstart_flaw}")
        if self.group_size < 2:
            raise ValueError(f"option group_size must be >= 2 (group advantages need a group), got {self.group_size}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"option dual_clip must be > 1 (or None), got {self.dual_clip}")
        if self.tis_min > self.tis_max:  # checked with tis 'none' too: the loss config rejects it either way
            raise ValueError(f"option tis_min ({self.tis_min}) must not exceed tis_max ({self.tis_max})")
        if not self.tis_max > 0:
            raise ValueError(f"option tis_max must be > 0, got {self.tis_max}")
        if not self.eps_low < 1.0:
            raise ValueError(f"option eps_low must be in [0, 1) (the ratio's lower clip is 1 - eps_low), "
                             f"got {self.eps_low}")
        if self.advantage.startswith("gfpo") and not 2 <= self.gfpo_keep < self.group_size:
            raise ValueError(f"option gfpo_keep must be in [2, group_size) for GFPO (one kept sample has advantage 0: "
                             f"no gradient), got {self.gfpo_keep}")
        if (self.prompts_per_step * self.group_size) % self.minibatches:
            raise ValueError(
                f"option minibatches ({self.minibatches}) must divide prompts_per_step * group_size "
                f"({self.prompts_per_step * self.group_size})"
            )
        if self.rollout_engine == "hf" and self.rollout_quant != "bf16":
            raise ValueError(
                f"option rollout_quant={self.rollout_quant!r} needs the vLLM engine; "
                "the Hugging Face rollout runs the trainer's own weights (use rollout_quant='bf16')"
            )
        if self.rollout_engine == "hf" and self.kv_cache_dtype != "auto":
            raise ValueError(f"option kv_cache_dtype={self.kv_cache_dtype!r} needs the vLLM engine")
        if self.kv_cache_dtype != "auto" and (self.hidden_size // 4) % 32:
            raise ValueError(f"option kv_cache_dtype={self.kv_cache_dtype!r} needs a head size that is a multiple of "
                             f"32 (vLLM's CPU attention); hidden_size {self.hidden_size} gives {self.hidden_size // 4}")
        if self.rollout_mode == "sync" and self.max_staleness > 0:
            raise ValueError(f"option max_staleness={self.max_staleness} needs the asynchronous engine "
                             "(rollout_mode 'auto' or 'async', not 'sync')")
        if self.is_async and self.rollout_engine == "hf":
            raise ValueError("asynchronous rollout (max_staleness > 0 or rollout_mode 'async') needs the vLLM "
                             "engine (rollout_engine 'vllm' or 'auto'), not 'hf'")
        if self.task == "chain" and self.reward == "calculation":
            raise ValueError("option reward='calculation' scores one integer answer: task 'arith' only")
        if self.task == "arith" and self.reward == "steps":
            raise ValueError("option reward='steps' scores chains of running totals: task 'chain' only")
        if self.task == "chain" and not 2 <= self.max_operand <= 10:
            raise ValueError(f"option max_operand must be in [2, 10] for task 'chain', got {self.max_operand}")
        self._check_task()
        if self.engine_cpus != "auto":
            parse_cpus(self.engine_cpus)  # raises naming the option
        if self.trainer_cpus not in ("auto", "all"):
            parse_cpus(self.trainer_cpus, "trainer_cpus")

    def _check_task(self) -> None:
        """The options the task itself checks (n_eval, ops, max_operand), the train split against
        prompts_per_step and the response budget against overlong_cache: here, not when the trainer builds the
        task (after the command has started) or draws its first batch (after the warm start and the engine)."""
        from .task import ArithmeticTask, ChainSumTask

        try:
            if self.task == "chain":
                task = ChainSumTask(max_operand=self.max_operand, n_eval=self.n_eval, seed=self.seed)
            else:
                task = ArithmeticTask(max_operand=self.max_operand, ops=self.ops, n_eval=self.n_eval, seed=self.seed)
        except ValueError as exc:
            raise ValueError(f"option {exc}") from None
        n_train = task.n_train
        if self.prompts_per_step > n_train:
            raise ValueError(f"option prompts_per_step ({self.prompts_per_step}) exceeds the {n_train} problems of "
                             f"the train split (task {self.task!r}, max_operand {self.max_operand}, n_eval {self.n_eval})")
        budget = self.max_new_tokens or task.max_answer_chars + 1
        if self.overlong_cache > budget:
            raise ValueError(f"option overlong_cache ({self.overlong_cache}) must not exceed the response budget "
                             f"max_new_tokens ({budget}{'' if self.max_new_tokens else ', the task default'})")

    def split_cpus(self) -> tuple[list[int], list[int]]:
        """(engine CPUs, trainer CPUs) of the asynchronous mode: engine_cpus, or the upper half of this process's
        CPUs ("auto"); the trainer keeps the rest (all of them if engine_cpus names every CPU)."""
        cpus = usable_cpus()
        if self.engine_cpus == "auto":
            engine = cpus[len(cpus) // 2:] if len(cpus) > 1 else cpus
        else:
            engine = parse_cpus(self.engine_cpus)
            missing = sorted(set(engine) - set(cpus))
            if missing:
                raise ValueError(f"option engine_cpus={self.engine_cpus!r} names CPUs {missing} this process may not "
                                 f"use (allowed: {cpus})")
        if self.trainer_cpus == "all":
            trainer = cpus
        elif self.trainer_cpus == "auto":
            trainer = [c for c in cpus if c not in engine] or cpus
        else:
            trainer = parse_cpus(self.trainer_cpus, "trainer_cpus")
            missing = sorted(set(trainer) - set(cpus))
            if missing:
                raise ValueError(f"option trainer_cpus={self.trainer_cpus!r} names CPUs {missing} this process may "
                                 f"not use (allowed: {cpus})")
        return engine, trainer

    @property
    def cache_root(self) -> str:
        return self.cache_dir or os.environ.get("FLASHRL_CACHE_DIR") or os.path.join(
            os.path.expanduser("~"), ".cache", "flashrl_kernels"
        )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(f"unknown option(s): {', '.join(unknown)}")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str, overrides: dict[str, Any] | None = None,
                  defaults: dict[str, Any] | None = None) -> TrainConfig:
        """The file's options over `defaults` (e.g. a command's own out_dir), `overrides` over both."""
        import yaml

        with open(path) as f:
            try:
                values = yaml.safe_load(f) or {}
            except yaml.YAMLError as exc:  # one line naming the file and the place, not the parser's traceback
                raise ValueError(f"config file {path} is not valid YAML: {' '.join(str(exc).split())}") from None
        if not isinstance(values, dict):
            raise TypeError(f"config file {path} must hold a mapping of option: value")
        return cls.from_dict({**(defaults or {}), **values, **(overrides or {})})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
