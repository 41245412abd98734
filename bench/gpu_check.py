"""One-shot GPU check: correctness at real sizes, timings vs baselines, fractions of measured ceilings.

    python bench/gpu_check.py            # on a machine with one NVIDIA GPU; installs nothing
    python bench/gpu_check.py --dry-run  # plumbing check on the CPU (tiny sizes, Triton interpreter)

Sections: the token_logprobs section below, then every bench/gpu_check_<op>.py
(each defines `run(report)`). Prints a short table last; writes the full
results as JSON to $OUT/gpu_check.json when $OUT is set (else to the cwd).
Every timed row carries the eager time (one call between CUDA events: host launch
overhead included) and the device time from a CUDA-graph replay ("graph ms").
Budget: the whole script must finish in under 10 minutes on an H200 (gpu_check.sh stops it at 9.5).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def graph_replay_ms(torch, fns, replays: int = 10) -> float:
    """Median device time per call of the calls `fns` (run once each on a side stream, then captured in order in
    one CUDA graph), from `replays` graph replays between CUDA events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / len(fns))
    del graph
    return sorted(ts)[len(ts) // 2]


class Report:
    """Collects rows (section, case, value columns) and checks (pass/fail with numbers)."""

    def __init__(self, device, dry_run: bool):
        import torch

        self.torch = torch
        self.device = device
        self.dry_run = dry_run
        self.rows: list[dict] = []
        self.checks: list[dict] = []
        self.ceilings: dict = {}
        self.last_graph_ms: float | None = None

    # timing with device events, median over repeats
    def time_ms(self, fn, warmup: int = 2, repeats: int = 10, graph: bool = True) -> float:
        torch = self.torch
        if self.device.type != "cuda":
            for _ in range(warmup):
                fn()
            ts = []
            for _ in range(max(1, repeats // 3)):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            return sorted(ts)[len(ts) // 2]
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        med = sorted(ts)[len(ts) // 2]
        # taken by the next row(); above 5 ms the host's launch overhead is noise, so no graph is captured
        self.last_graph_ms = self.graph_ms(fn) if graph and med < 5.0 else None
        return med

    def graph_ms(self, fn, calls: int = 5, replays: int = 10) -> float | None:
        """Device time of one call: `calls` calls captured in a CUDA graph, the median replay over `calls`.
        Eager timing (time_ms) includes the host's launch overhead, which dominates small ops; this is the
        time a CUDA-graph user (vLLM decode) or a large batch sees. None where fn cannot be captured."""
        if self.device.type != "cuda":
            return None
        try:
            return graph_replay_ms(self.torch, [fn] * calls, replays)
        except Exception as exc:
            print(f"graph capture failed: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            self.torch.cuda.synchronize()
            return None

    def peak_extra_mb(self, fn) -> float | None:
        torch = self.torch
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    def row(self, section, case, ms=None, gbps=None, tflops=None, peak_mb=None, note=""):
        r = {"section": section, "case": case, "ms": ms, "GB/s": gbps, "TFLOP/s": tflops, "peak MB": peak_mb,
             "note": note}
        bw, mm = self.ceilings.get("copy_gbps"), self.ceilings.get("bf16_tflops")
        r["% BW"] = 100 * gbps / bw if gbps and bw else None
        r["% MM"] = 100 * tflops / mm if tflops and mm else None
        # the same call's device time from a CUDA-graph replay (no host launch overhead), and its % of ceiling
        g, self.last_graph_ms = (self.last_graph_ms if ms is not None else None), None
        r["graph ms"] = g
        r["% BW g"] = r["% BW"] * ms / g if g and r["% BW"] else None
        r["% MM g"] = r["% MM"] * ms / g if g and r["% MM"] else None
        self.rows.append(r)
        return r

    def check(self, section, what, ok: bool, detail: str):
        self.checks.append({"section": section, "what": what, "ok": bool(ok), "detail": detail})

    def target(self, section, what, value: float, goal: float, unit: str = "%"):
        """A performance target: reported with its number whether met or missed (a dry run measures nothing)."""
        if self.dry_run:
            self.checks.append({"section": section, "what": f"target {what} >= {goal:g}{unit}", "ok": None,
                                "detail": "dry run on the CPU interpreter: not a measurement"})
            return
        self.check(section, f"target {what} >= {goal:g}{unit}", value >= goal, f"{value:.1f}{unit}")


def measure_ceilings(report: Report):
    torch = report.torch
    dev = report.device
    n = (1 << 28) if dev.type == "cuda" else (1 << 22)  # 1 GiB fp32 on the GPU
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    ms = report.time_ms(lambda: dst.copy_(src))
    report.ceilings["copy_gbps"] = 2 * n * 4 / (ms * 1e-3) / 1e9
    m = 8192 if dev.type == "cuda" else 256
    a = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    ms = report.time_ms(lambda: a @ b)
    report.ceilings["bf16_tflops"] = 2 * m**3 / (ms * 1e-3) / 1e12


def section_token_logprobs(report: Report):
    torch = report.torch
    import flashrl_kernels as fk
    from flashrl_kernels import reference

    sec = "token_logprobs"
    dev = report.device
    n, v = (16384, 151936) if not report.dry_run else (64, 32003)
    g = torch.Generator(device="cpu").manual_seed(1)
    logits = (torch.randn(n, v, generator=g) * 3).to(device=dev, dtype=torch.bfloat16)
    targets = torch.randint(0, v, (n,), generator=g).to(dev)
    g_lp = torch.randn(n, generator=g).to(dev)
    g_h = torch.randn(n, generator=g).to(dev)

    # correctness at full size vs the float64 spec, checked in row blocks
    with fk.use_backend("triton"):
        x = logits.clone().requires_grad_(True)
        lp, ent = fk.token_logprobs(x, targets, temperature=0.9, return_entropy=True)
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
    lp, ent = lp.detach(), ent.detach()
    err_lp = err_h = err_g = 0.0
    gmax = 0.0
    block = 512
    for r0 in range(0, n, block):
        sl = slice(r0, r0 + block)
        rlp, rh = reference.token_logprobs_spec(logits[sl], targets[sl], 0.9)
        err_lp = max(err_lp, float((lp[sl].double() - rlp).abs().max()))
        err_h = max(err_h, float((ent[sl].double() - rh).abs().max()))
        rg = reference.token_logprobs_backward(
            g_lp[sl], g_h[sl], logits[sl].double(), targets[sl], None, None, 0.9, None
        )
        err_g = max(err_g, float((x.grad[sl].double() - rg.double()).abs().max()))
        gmax = max(gmax, float(rg.double().abs().max()))
    zmax = float(logits.float().abs().max()) / 0.9
    tol = 1e-5 + 4 * 1.2e-7 * zmax
    report.check(sec, f"logprob max err vs fp64 <= {tol:.1e}", err_lp <= tol, f"{err_lp:.2e}")
    report.check(sec, f"entropy max err vs fp64 <= {tol:.1e}", err_h <= tol, f"{err_h:.2e}")
    report.check(sec, "grad max err <= (2^-8 + tol) * max|grad|", err_g <= (2**-8 + tol) * gmax,
                 f"{err_g:.2e} (max|grad| {gmax:.2e})")
    del x, lp, ent

    def naive(z, t):
        return torch.log_softmax(z.float(), -1).gather(-1, t[:, None])[:, 0]

    impls = {"flashrl[triton]": lambda z, t: fk.token_logprobs(z, t), "eager log_softmax+gather": naive}
    impls["flashrl[triton] +entropy"] = lambda z, t: fk.token_logprobs(z, t, return_entropy=True)[0]
    if dev.type == "cuda":
        impls["torch.compile"] = torch.compile(naive)
        try:
            from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

            impls["liger cross_entropy"] = lambda z, t: -LigerCrossEntropyFunction.apply(z, t, -100, 0.0, 0.0, "none")[0]
        except Exception as exc:  # an optional baseline: say why it is missing
            print(f"liger-kernel baseline skipped: {type(exc).__name__}: {exc}")
        try:
            from flash_attn.ops.triton.cross_entropy import cross_entropy_loss

            impls["flash-attn cross_entropy"] = lambda z, t: -cross_entropy_loss(z, t)[0]
        except Exception as exc:
            print(f"flash-attn baseline skipped: {type(exc).__name__}: {exc}")

    es = 2
    fwd_bytes = n * v * es + n * 12
    bwd_bytes = 3 * n * v * es + n * 16
    fk.set_value_checks(False)  # the timed path: no host sync
    forced = fk.use_backend("triton")  # the dry run times the interpreter; on a GPU auto picks triton anyway
    forced.__enter__()
    try:
        for name, fn in impls.items():
            try:
                ms = report.time_ms(lambda fn=fn: fn(logits, targets))
                peak = report.peak_extra_mb(lambda fn=fn: fn(logits, targets))
                r = report.row(sec, f"fwd {name}", ms, fwd_bytes / (ms * 1e-3) / 1e9, peak_mb=peak)
                if name == "flashrl[triton]":
                    report.target(sec, "fwd % copy BW", r["% BW"] or 0.0, 85)
                xg = logits.clone().requires_grad_(True)

                def step(xg=xg, fn=fn):
                    xg.grad = None
                    fn(xg, targets).backward(g_lp)

                ms = report.time_ms(step)
                peak = report.peak_extra_mb(step)
                r = report.row(sec, f"fwd+bwd {name}", ms, bwd_bytes / (ms * 1e-3) / 1e9, peak_mb=peak)
                if name == "flashrl[triton]":
                    report.target(sec, "fwd+bwd % copy BW", r["% BW"] or 0.0, 80)
            except Exception as exc:
                report.row(sec, name, note=f"error: {type(exc).__name__}: {str(exc)[:80]}")
    finally:
        forced.__exit__(None, None, None)
        fk.set_value_checks(True)


def other_sections():
    for path in sorted(HERE.glob("gpu_check_*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield path.stem.removeprefix("gpu_check_"), mod.run


def fmt(v, spec=".2f"):
    return "-" if v is None else (format(v, spec) if isinstance(v, (int, float)) and not math.isnan(v) else str(v))


def print_report(report: Report):
    c = report.ceilings
    print(f"\nceilings: copy {fmt(c.get('copy_gbps'), '.0f')} GB/s, bf16 matmul {fmt(c.get('bf16_tflops'), '.0f')} TFLOP/s")
    cols = ["section", "case", "ms", "graph ms", "GB/s", "% BW", "% BW g", "TFLOP/s", "% MM", "% MM g", "peak MB",
            "note"]
    specs = {"ms": ".3f", "graph ms": ".3f", "GB/s": ".0f", "% BW": ".0f", "% BW g": ".0f", "TFLOP/s": ".1f",
             "% MM": ".0f", "% MM g": ".0f", "peak MB": ".0f"}
    table = [[fmt(r[k], specs.get(k, "")) if k in specs else str(r[k]) for k in cols] for r in report.rows]
    widths = [max(len(x) for x in col) for col in zip(cols, *table)]
    print("  ".join(h.ljust(w) for h, w in zip(cols, widths)))
    for t in table:
        print("  ".join(x.ljust(w) for x, w in zip(t, widths)))
    print()
    for ch in report.checks:
        verdict = "SKIP" if ch["ok"] is None else "PASS" if ch["ok"] else "FAIL"
        print(f"{verdict}  {ch['section']}: {ch['what']}: {ch['detail']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, Triton interpreter: checks the plumbing")
    ap.add_argument("--only", action="append", help="run only these sections (token_logprobs or a gpu_check_<op> name)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new section after this many seconds (default 480 on a GPU, none for --dry-run), "
                         "so that the report is always printed before gpu_check.sh's 570-second stop (skipped "
                         "sections are listed as failed checks)")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda" if not args.dry_run else "cpu")
    report = Report(device, args.dry_run)
    t0 = time.time()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)"
    print(f"gpu_check {datetime.datetime.now().isoformat(timespec='seconds')} on {name}, torch {torch.__version__}", flush=True)
    measure_ceilings(report)
    sections = [("token_logprobs", section_token_logprobs)] + list(other_sections())
    for sec_name, fn in sections:
        if args.only and sec_name not in args.only:
            continue
        budget = args.budget_s if args.budget_s is not None else (float("inf") if args.dry_run else 480.0)
        if time.time() - t0 > budget:
            report.check(sec_name, "section ran", False, f"skipped: {time.time() - t0:.0f} s spent, budget "
                         f"{budget:.0f} s (run it alone with --only {sec_name})")
            continue
        t1 = time.time()
        try:
            fn(report)
        except Exception:
            report.check(sec_name, "section ran", False, traceback.format_exc(limit=3).strip().splitlines()[-1])
            traceback.print_exc()
        print(f"[{sec_name}] {time.time() - t1:.1f}s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)  # a new $OUT must not lose the report after the whole run
    (out_dir / "gpu_check.json").write_text(json.dumps(
        {"device": name, "ceilings": report.ceilings, "rows": report.rows, "checks": report.checks}, indent=1))
    print_report(report)
    print(f"total {time.time() - t0:.0f}s")
    return 0 if all(c["ok"] for c in report.checks if not c["what"].startswith("target")) else 1


if __name__ == "__main__":
    sys.exit(main())
