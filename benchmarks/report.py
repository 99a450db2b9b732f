"""`make bench`'s verdicts and tables (bench.py): the speed targets each case is held to, the
markdown report, and the CUDA kernels' counted traffic."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from timing import OURS, format_time, log
from workloads import LOGPROBS_MODE, SAMPLE_ALONE

ROOT = Path(__file__).resolve().parent.parent


def find(cases: list[dict], **key) -> Optional[dict]:
    return next((c for c in cases if all(c[k] == v for k, v in key.items())), None)


def ratio_target(cases, name, peer, threshold, **key) -> dict:
    case = find(cases, **key)
    if case is None:
        return {"name": name, "status": "SKIP", "detail": "case not run"}
    ratio = case["results"].get(peer, {}).get("ratio")
    if ratio is None or not case["check"] == "ok":
        return {"name": name, "status": "FAIL", "detail": f"no ratio (check: {case['check']}, "
                f"{peer}: {case['results'].get(peer)})"}
    status = "PASS" if ratio >= threshold else "FAIL"
    return {"name": name, "status": status, "detail": f"x{ratio:.2f} (need >= {threshold})"}


def gpu_sampler_targets(cases) -> list[dict]:
    """issue 3's GPU targets at B=256, V=128k: faster than FlashInfer on every path it has,
    greedy within 1.5x of the one-read floor, top-p within 3x."""
    big = [c for c in cases if c["op"] == "sampler" and c["device"] == "cuda"
           and c["batch"] == 256 and c["vocab"] == 128256]
    if not big:
        return [{"name": "GPU sampler targets (B=256, V=128256)", "status": "SKIP", "detail": "cases not run"}]
    targets = []
    timed = [(c, c["results"]["flashinfer"]) for c in big if "flashinfer" in c["results"]]
    ratios = [(f"{c['variant']} {c['dtype']}", r["ratio"]) for c, r in timed if "ratio" in r]
    slower = [f"{name} x{ratio:.2f}" for name, ratio in ratios if ratio < 1]
    failed = [f"{c['variant']} {c['dtype']}" for c, r in timed if "error" in r]
    detail = ", ".join(slower) or f"{len(ratios)} paths, slowest x{min((r for _, r in ratios), default=0):.2f}"
    targets.append({"name": "GPU: every path faster than FlashInfer (B=256, V=128256)",
                    "status": "SKIP" if not ratios else ("FAIL" if slower else "PASS"),
                    "detail": ("flashinfer not run" if not ratios else detail)
                    + (f"; flashinfer failed on {', '.join(failed)}" if failed else "")})
    for mode, limit in (("greedy", 1.5), ("top-p", 3.0)):
        rows = [c for c in big if c["variant"] == mode]
        over = [(c["dtype"], c["results"].get(OURS, {}).get("pct_floor")) for c in rows]
        bad = [f"{d}: {'no time' if p is None else f'{100 / p:.2f}x floor'}" for d, p in over
               if p is None or 100 / p > limit]
        shown = ", ".join(f"{d} {100 / p:.2f}x" for d, p in over if p)
        targets.append({"name": f"GPU: {mode} within {limit}x of the one-read floor (B=256, V=128256)",
                        "status": "FAIL" if bad or not rows else "PASS", "detail": ", ".join(bad) or shown})
    return targets


def targets(cases: list[dict], sampler_available: bool) -> list[dict]:
    result = [ratio_target(cases, "CPU bitmask: >= 2x faster than XGrammar's CPU function "
                           "(B=64, V=128000, fp32, half the bits)", "xgrammar-cpu", 2.0,
                           op="bitmask", device="cpu", batch=64, vocab=128000, dtype="float32", variant="half")]
    if find(cases, op="penalties") is not None:
        result.append(penalty_target(cases))
    if find(cases, op="logprobs") is not None:
        result.append(ratio_target(cases, "CPU sample_with_logprobs: >= 3x faster than the engines' chain "
                                   "(log_softmax + topk + gather + rank count, then the sort-based sampler; "
                                   "B=64, V=128256, fp32, N=5)", "torch chain", 3.0,
                                   op="logprobs", device="cpu", batch=64, vocab=128256, dtype="float32",
                                   variant=f"N=5 raw, {LOGPROBS_MODE}"))
    if find(cases, op="verify") is not None:
        result.append(ratio_target(cases, "CPU verify_draft: >= 5x faster than the engines' torch rejection sampler "
                                   "(B=32, S=4, V=128256, fp32, top-k+top-p, draft_probs)", "torch rejection sampler",
                                   5.0, op="verify", device="cpu", batch=32, vocab=128256,
                                   variant="S=4 draft_probs"))
    if not sampler_available:
        return result + [{"name": "sampler targets", "status": "SKIP", "detail": "not run (not in this build, or --ops)"}]
    result.append(ratio_target(cases, "CPU sampler: >= 5x faster than the sort-based reference "
                               "(B=64, V=128256, fp32, top_p=0.9, top_k=50)", "torch sort-based", 5.0,
                               op="sampler", device="cpu", batch=64, vocab=128256, dtype="float32",
                               variant="top-k+top-p"))
    if any(c["device"] == "cuda" for c in cases):
        result += gpu_sampler_targets(cases)
    return result


def penalty_target(cases) -> dict:
    """Issue 13's CPU target: sample with fused penalties costs at most 1.3x sample alone."""
    name = "CPU penalties: sample(penalties=) within 1.3x of sample alone (B=64, V=128256, fp32, top-k+top-p)"
    case = find(cases, op="penalties", device="cpu", batch=64, vocab=128256, dtype="float32")
    ratio = case and case["results"].get(SAMPLE_ALONE, {}).get("ratio")
    if not ratio:
        return {"name": name, "status": "SKIP", "detail": "case not run"}
    return {"name": name, "status": "PASS" if 1 / ratio <= 1.3 else "FAIL", "detail": f"{1 / ratio:.2f}x"}


def markdown(report: dict) -> str:
    """Tables per (op, device): our time, each peer's time and ratio, % of the floor."""
    lines = []
    groups: dict[tuple, list] = {}
    for case in report["cases"]:
        groups.setdefault((case["op"], case["device"]), []).append(case)
    for (op, device), cases in groups.items():
        peers = list(dict.fromkeys(n for c in cases for n in c["results"] if n != OURS))
        has_floor = any(c["floor_us"] for c in cases)
        header = ["case", f"{OURS}"] + [f"{p} (ratio)" for p in peers] + (["% of floor"] if has_floor else [])
        lines += [f"\n**{op}, {device}** (ratio = peer time / ours; > 1: ours faster)\n",
                  "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for c in cases:
            ours = c["results"].get(OURS, {})
            row = [f"B={c['batch']} V={c['vocab']} {c['dtype']} {c['variant']}"
                   + ("" if c["check"] == "ok" else f" ({c['check'][:60]})")]
            row.append(format_time(ours["us"]) if "us" in ours else ours.get("error", "-")[:40])
            for p in peers:
                r = c["results"].get(p)
                row.append("-" if r is None else (f"failed: {r['error'][:40]}" if "error" in r
                                                  else f"{format_time(r['us'])} (x{r['ratio']:.2f})"))
            if has_floor:
                row.append(f"{ours['pct_floor']:.0f}%" if "pct_floor" in ours else "-")
            lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines += [f"- **{t['status']}** {t['name']}: {t['detail']}" for t in report["targets"]]
    return "\n".join(lines)


def log_emulated_traffic() -> None:
    """The CUDA kernels' global-memory traffic in passes over the row, as `make traffic`
    prints it (counted by the CUDA emulation, tests/cuda_emulation/traffic.py)."""
    sys.path.insert(0, str(ROOT / "tests" / "cuda_emulation"))
    from traffic import lines  # (sets the traffic flavor before emulation reads it)
    from emulation import BUILD, Emulation

    if not BUILD.is_dir():
        log(f"bench: CUDA global-memory traffic: no CUDA emulation build in {BUILD} (make emulation-build)")
        return
    log("bench: CUDA global-memory traffic per row, in passes over the row (CUDA emulation, H200 grid):")
    for line in lines(Emulation()):
        log(line)
