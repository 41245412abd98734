"""Helpers shared by the vLLM tests (in-process plugin tests and the multi-process scenarios)."""
import torch
import vllm

PROMPTS = ["hello world", "12+3=", "The quick brown fox", "Question: what is 7*8?\nAnswer:"]
GREEDY = {"max_tokens": 16, "temperature": 0.0, "logprobs": 0, "ignore_eos": True}


def engine_kwargs():
    return {
        "dtype": "bfloat16", "enforce_eager": True, "max_model_len": 256, "max_num_seqs": 8, "seed": 0,
        "kv_cache_memory_bytes": 64 << 20, "logprobs_mode": "processed_logprobs",
    }


def perturbed_copy(src, dst):
    """A copy of the checkpoint with every tensor moved a little (what a training step produces)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((0.02 * p.float().std() * torch.randn(p.shape, generator=g)).to(p.dtype))
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def state_dict_of(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def generate(llm, prompts=PROMPTS, **kw):
    out = llm.generate(prompts, vllm.SamplingParams(**(kw or GREEDY)), use_tqdm=False)
    ids = [list(o.outputs[0].token_ids) for o in out]
    lps = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in out]
    return ids, lps


def _greedy_sequences(llm):
    """Prompt + greedy continuation token ids of PROMPTS under `llm`."""
    ids, _ = generate(llm)
    prompts = llm.generate(PROMPTS, vllm.SamplingParams(max_tokens=1), use_tqdm=False)
    return [list(p.prompt_token_ids) + x for p, x in zip(prompts, ids)]


def _engine_scores(engine, seqs):
    """The engine's logprob of every token of `seqs` after the first, given its prefix."""
    out = engine.generate([{"prompt_token_ids": s} for s in seqs],
                          vllm.SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.cat([torch.tensor([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])])
                      for o, s in zip(out, seqs)])


def greedy_logprob_diff(ref, llm):
    """|logprob diff| between `llm` and the bf16 engine `ref`, on `ref`'s greedy continuations of PROMPTS
    (every token scored given its prefix, so both engines see the same sequences)."""
    seqs = _greedy_sequences(ref)
    return (_engine_scores(llm, seqs) - _engine_scores(ref, seqs)).abs()


def float_logprob_diff(llm, ckpt):
    """|logprob diff| between `llm` and the checkpoint's float32 transformers model, on `llm`'s greedy
    continuations of PROMPTS: a reference without a second engine (the multi-process tests start few)."""
    from transformers import AutoModelForCausalLM

    seqs = _greedy_sequences(llm)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.cat([model(torch.tensor([s])).logits[0, :-1].double().log_softmax(-1)
                         .gather(-1, torch.tensor(s[1:])[:, None])[:, 0] for s in seqs])
    return (_engine_scores(llm, seqs).double() - ref).abs()


def weights_as_bytes(model):
    """{name: [sha256 of its bytes, byte count, storage address, dtype]} of every parameter and flashrl
    weight_scale / weight_comp buffer, as stored (packed weights in packed order; plain values: a multi-process
    engine returns results through msgpack)."""
    import hashlib

    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if n.endswith(("weight_scale", "weight_comp"))})
    out = {}
    for n, t in tensors.items():
        b = t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
        out[n] = [hashlib.sha256(b).hexdigest(), len(b), t.data_ptr(), str(t.dtype)]
    return out


def sampler_state(worker):
    """Whether the worker's engine draws tokens with flashrl's native sampler (for llm.collective_rpc)."""
    from flashrl_kernels.integrations.vllm.sampler import uses_flashrl_sampler

    return uses_flashrl_sampler(worker.model_runner.sampler.topk_topp_sampler)


def amx_state(model):
    """Whether the process running `model` may execute AMX instructions (for llm.apply_model)."""
    from flashrl_kernels._cpu import amx_permitted

    return amx_permitted()
