"""The certification run behind scripts/certify.sh (which installs carried wheels first).

With a CUDA GPU: build the CUDA variant for this GPU against the torch present, run the whole
test suite, compute-sanitizer over scripts/sanitizer_cases.py (in parallel with the tests),
the CUDA-graph check, and the GPU benchmarks; then write `<smXY>-<gpu>.json` and `.md` to the
output folder and print the Markdown last. Exit status 0 only if certified: build, every
test, every sanitizer tool and the graph check passed (the benchmark's targets are reported,
not gating: they are speed goals, not correctness).
Without a GPU: the CPU parts (build, tests, `bench.py --device cpu --quick`), a record named
`no-gpu`, and a loud notice that nothing was certified; exit status 0 if those parts passed.

Everything runs under one deadline (CERTIFY_BUDGET_S, default 450 s with a GPU: the device
machine allows 10 minutes a command and the issue asks for 8); each step gets what is left
after reserving the minimum of the steps after it, and a step that runs out is stopped and
recorded as TIMEOUT, so a record is always written.

  python scripts/certify.py OUT_DIR
Environment: CERTIFY_BUDGET_S, CERTIFY_SANITIZERS (default "memcheck racecheck initcheck
synccheck"), CERTIFY_COMMIT (recorded when git is not available, e.g. on the device machine).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
START = time.monotonic()


def log(message: str) -> None:
    print(f"[certify {time.monotonic() - START:6.1f}s] {message}", flush=True)


class Step:
    """A child process in its own process group, its output streamed with a prefix and kept."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: Optional[dict] = None):
        self.name, self.cmd, self.log_path = name, cmd, log_path
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: Optional[subprocess.Popen] = None
        self.reader: Optional[threading.Thread] = None
        self.started = 0.0

    def start(self) -> "Step":
        log(f"{self.name}: {' '.join(self.cmd)}")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace",
                                     start_new_session=True)
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()
        return self

    def _pump(self) -> None:
        with open(self.log_path, "w") as out:
            for line in self.proc.stdout:
                out.write(line)
                print(f"[{self.name}] {line}", end="", flush=True)

    def wait(self, timeout: float) -> dict:
        """{'rc': int or None (timed out), 'seconds': ...}; stops the whole group on timeout."""
        try:
            rc = self.proc.wait(timeout=max(timeout, 0))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this step started
            self.proc.wait()
            rc = None
        self.reader.join(timeout=10)
        seconds = round(time.monotonic() - self.started, 1)
        log(f"{self.name}: {'TIMEOUT' if rc is None else f'exit {rc}'} after {seconds}s")
        return {"rc": rc, "seconds": seconds}

    def tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class Deadline:
    def __init__(self, budget: float):
        self.end = START + budget

    def left(self, reserve: float = 0.0) -> float:
        return self.end - time.monotonic() - reserve


def run(cmd: list[str]) -> str:
    """A short query's output, or '' when the tool is missing or fails."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit() -> str:
    head = run(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    if not head:
        return os.environ.get("CERTIFY_COMMIT", "unknown")
    dirty = run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
    return head + ("-dirty" if dirty else "")


def environment(gpu: bool) -> dict:
    env = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
           "python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "nvcc": (run(["nvcc", "--version"]).splitlines() or [""])[-1], "cpus": os.cpu_count()}
    if gpu:
        major, minor = torch.cuda.get_device_capability(0)
        env.update(gpu=torch.cuda.get_device_name(0), capability=f"{major}.{minor}",
                   driver=run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).split("\n")[0]
                   or "unknown")
    return env


def record_name(env: dict) -> str:
    if "gpu" not in env:
        return "no-gpu"
    slug = re.sub(r"[^a-z0-9]+", "-", env["gpu"].lower().replace("nvidia", "")).strip("-")
    return f"sm{env['capability'].replace('.', '')}-{slug}"


def built_variant() -> dict:
    """The variant the loader picks from build/ for this torch (as the tests load it)."""
    from kernels import get_local_kernel

    try:
        variant = Path(get_local_kernel(ROOT / "build").__file__).parent
    except Exception as error:  # reported in the record; the tests fail on it too
        return {"variant": f"none loadable: {type(error).__name__}: {error}"}
    meta = json.loads((variant / "metadata.json").read_text())
    return {"variant": variant.name, "id": meta.get("id"), "archs": meta["backend"].get("archs")}


def junit_counts(path: Path) -> dict:
    if not path.exists():
        return {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": ["no junit XML written"]}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) for s in suites)
    errors = sum(int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    failures = [f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase")
                if case.find("failure") is not None or case.find("error") is not None]
    return {"passed": total - failed - errors - skipped, "failed": failed, "errors": errors,
            "skipped": skipped, "failures": failures[:30]}


def sanitizer_summary(text: str) -> dict:
    """Error counts from compute-sanitizer's summary lines (None where none was printed)."""
    errors = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", text)]
    race = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
    summary = {"errors": max(errors) if errors else None}
    if race:
        hazards, race_errors, warnings = (int(x) for x in race[-1])
        summary.update(hazards=hazards, warnings=warnings,
                       errors=max(summary["errors"] or 0, race_errors))
    return summary


def find_sanitizer() -> Optional[str]:
    candidates = [shutil.which("compute-sanitizer")]
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            candidates.append(str(Path(home) / "bin" / "compute-sanitizer"))
    return next((c for c in candidates if c and Path(c).exists()), None)


def status(ok: bool, timed_out: bool = False) -> str:
    return "TIMEOUT" if timed_out else ("PASS" if ok else "FAIL")


def main() -> int:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT") or ROOT / "certification" / "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="certify-"))  # step logs; out_dir gets only the results
    gpu = torch.cuda.is_available()
    deadline = Deadline(float(os.environ.get("CERTIFY_BUDGET_S", 450 if gpu else 3600)))
    env = environment(gpu)
    steps: dict[str, dict] = {}
    log(f"{'GPU: ' + env['gpu'] + ' (sm ' + env['capability'] + ')' if gpu else 'no CUDA GPU visible'}; "
        f"torch {env['torch']} (CUDA {env['torch_cuda']}), python {env['python']}, commit {env['commit']}")

    if gpu:
        # Machine code for this GPU only: a one-arch build takes well under a minute. Every
        # step inherits it: the fatbin test then checks this arch, not all six.
        os.environ["LP_CUDA_ARCHS"] = env["capability"]
        prewarm = Step("prewarm", [PY, "benchmarks/bench.py", "--prewarm"], work / "prewarm.log").start()

    # Minimum seconds each later step needs: what the deadline keeps back for them.
    reserve = {"tests": 60, "graph": 10, "bench": 60} if gpu else {"tests": 60, "bench": 60}

    build = Step("build", [PY, "tools/build.py"], work / "build.log").start()
    result = build.wait(min(300, deadline.left(sum(reserve.values()))))
    built = result["rc"] == 0
    steps["build"] = {**result, "status": status(built, result["rc"] is None), **built_variant()}
    if not built:
        steps["build"]["tail"] = build.tail()

    junit = work / "junit.xml"
    # The cross-version stable-ABI test builds a torch 2.13 environment from a package index,
    # which the offline device machine lacks; CI runs it on every submission.
    tests_cmd = [PY, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                 "--deselect", "tests/test_stable_abi.py::test_cpu_variant_runs_unchanged_under_torch_2_13"]
    # Tests and sanitizers share the cores: two torch threads each instead of one per core
    # for every process (oversubscribed, they would all crawl).
    threads = {"OMP_NUM_THREADS": "2"} if gpu else {}
    if gpu and (os.cpu_count() or 1) >= 8 and run([PY, "-c", "import xdist; print(1)"]) == "1":
        tests_cmd += ["-n", "6"]  # the device machine's 16 cores, less the sanitizers' share
    sanitizer = find_sanitizer() if gpu else None
    tools = os.environ.get("CERTIFY_SANITIZERS", "memcheck racecheck initcheck synccheck").split()
    running: dict[str, Step] = {}
    if built:
        running["tests"] = Step("tests", tests_cmd, work / "tests.log", threads).start()
        if sanitizer:
            # Every tensor its own cudaMalloc: memcheck sees only accesses outside allocations.
            for tool in tools:
                running[tool] = Step(tool, [sanitizer, "--tool", tool, "--error-exitcode", "99",
                                            "--print-limit", "20", PY, "scripts/sanitizer_cases.py"],
                                     work / f"{tool}.log",
                                     {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1", **threads}).start()
    later = sum(v for k, v in reserve.items() if k != "tests")
    waited = {name: step.wait(deadline.left(later)) for name, step in running.items()}

    if "tests" in waited:
        counts = junit_counts(junit)
        ok = waited["tests"]["rc"] == 0 and counts["failed"] == counts["errors"] == 0 and counts["passed"] > 0
        steps["tests"] = {**waited["tests"], **counts, "status": status(ok, waited["tests"]["rc"] is None)}
        if junit.exists():
            shutil.copy(junit, out_dir / "junit.xml")
    else:
        steps["tests"] = {"status": "SKIP", "detail": "build failed"}

    sanitizers: dict[str, dict] = {}
    if gpu:
        with open(out_dir / "sanitizers.log", "w") as combined:
            for tool in tools:
                if tool not in running:
                    sanitizers[tool] = {"status": "FAIL", "detail": "build failed" if not built
                                        else "compute-sanitizer not found"}
                    continue
                text = running[tool].log_path.read_text(errors="replace")
                combined.write(f"===== {tool} =====\n{text}\n")
                summary = sanitizer_summary(text)
                rc = waited[tool]["rc"]
                # rc 99: the sanitizer found errors; 1: a case computed a wrong result.
                ok = rc == 0 and summary["errors"] == 0
                sanitizers[tool] = {**waited[tool], **summary, "status": status(ok, rc is None)}
                if not ok:
                    sanitizers[tool]["tail"] = running[tool].tail(40)
        steps["sanitizers"] = {"status": "PASS" if all(s["status"] == "PASS" for s in sanitizers.values())
                               else "FAIL", "tools": sanitizers}

        graph_json = work / "graph.json"
        if built:
            graph = Step("graph", [PY, "scripts/graph_check.py", "--json", str(graph_json)], work / "graph.log")
            result = graph.start().wait(min(120, deadline.left(reserve["bench"])))
            detail = json.loads(graph_json.read_text()) if graph_json.exists() else {"tail": graph.tail()}
            steps["graph"] = {**result, **detail, "status": status(result["rc"] == 0, result["rc"] is None)}
        else:
            steps["graph"] = {"status": "SKIP", "detail": "build failed"}
        # The peers' JIT builds must be finished (or given up) before anything is timed.
        steps["prewarm"] = {**prewarm.wait(min(120, deadline.left(reserve["bench"]))), "tail": prewarm.tail(10)}

    bench_json = out_dir / "bench.json"
    bench_cmd = [PY, "benchmarks/bench.py", "--json", str(bench_json)]
    bench_cmd += ["--device", "cuda"] if gpu else ["--device", "cpu", "--quick"]
    if built:
        result = Step("bench", bench_cmd, work / "bench.log").start().wait(deadline.left(5))
        steps["bench"] = {**result, "status": status(result["rc"] == 0 and bench_json.exists(), result["rc"] is None)}
    else:
        steps["bench"] = {"status": "SKIP", "detail": "build failed"}
    bench = json.loads(bench_json.read_text()) if bench_json.exists() else None

    gating = ["build", "tests", "sanitizers", "graph"] if gpu else ["build", "tests"]
    passed = all(steps[name]["status"] == "PASS" for name in gating)
    certified = gpu and passed
    record = {"certified": certified, "environment": env, "steps": steps, "benchmark": bench,
              "seconds": round(time.monotonic() - START, 1)}
    name = record_name(env)
    (out_dir / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    summary, tables = render(record)
    (out_dir / f"{name}.md").write_text(f"{summary}\n\n{tables}\n")
    shutil.rmtree(work, ignore_errors=True)
    log(f"record written: {out_dir / name}.json and .md")
    # The summary last: a caller that keeps only the end of the output still sees the verdict.
    print(f"\n{tables}\n\n{summary}", flush=True)
    if not gpu:
        print("\n" + "!" * 78 + "\nNOTHING WAS CERTIFIED: no CUDA GPU is visible. Only the CPU parts ran "
              f"(build, tests, CPU benchmark): {'they passed' if passed else 'THEY FAILED'}.\n" + "!" * 78,
              flush=True)
        return 0 if passed else 1
    return 0 if certified else 1


def render(record: dict) -> tuple[str, str]:
    """(the summary: environment, steps, failures; the benchmark tables) in Markdown."""
    env, steps = record["environment"], record["steps"]
    title = (f"# Certification: {env['gpu']} (sm {env['capability']})" if "gpu" in env
             else "# No GPU: nothing certified (CPU parts only)")
    lines = [title, "",
             f"**{'CERTIFIED' if record['certified'] else 'NOT CERTIFIED'}** on {env['date']}, "
             f"commit `{env['commit']}`, in {record['seconds']} s.", "",
             "| | |", "|---|---|"]
    if "gpu" in env:
        lines += [f"| GPU | {env['gpu']}, compute capability {env['capability']} |",
                  f"| driver | {env['driver']} |"]
    build = steps["build"]
    lines += [f"| torch | {env['torch']} (CUDA {env['torch_cuda']}), Python {env['python']} |",
              f"| nvcc | {env['nvcc'] or 'not found'} |",
              f"| build | {build['status']}: {build.get('variant', '-')}, archs {build.get('archs', '-')}, "
              f"`{build.get('id', '-')}` |"]
    tests = steps["tests"]
    if "passed" in tests:
        lines.append(f"| tests | {tests['status']}: {tests['passed']} passed, {tests['failed']} failed, "
                     f"{tests['errors']} errors, {tests['skipped']} skipped ({tests.get('seconds')} s) |")
    else:
        lines.append(f"| tests | {tests['status']}: {tests.get('detail', '')} |")
    for tool, s in steps.get("sanitizers", {}).get("tools", {}).items():
        detail = s.get("detail") or (f"{s.get('errors')} errors" + (f", {s['warnings']} warnings"
                                     if "warnings" in s else "") + f", exit {s.get('rc')} ({s.get('seconds')} s)")
        lines.append(f"| compute-sanitizer {tool} | {s['status']}: {detail} |")
    if "graph" in steps:
        g = steps["graph"]
        checks = ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in g.get("checks", {}).items())
        lines.append(f"| CUDA graph decode step | {g['status']}: {checks or g.get('detail', '')} |")
    bench = record.get("benchmark")
    stopped = f" (stopped after {len(bench['cases'])} cases)" if bench and not bench["complete"] else ""
    lines.append(f"| benchmarks | {steps['bench']['status']}{stopped} |")
    failed_steps = {**steps, **steps.get("sanitizers", {}).get("tools", {})}
    for name, s in failed_steps.items():
        if s.get("failures"):
            lines += ["", f"Failed tests: {', '.join(s['failures'])}"]
        if s.get("tail") and name != "prewarm":
            lines += ["", f"Last lines of {name}:", "```", s["tail"], "```"]
    tables = []
    if bench:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from bench import markdown as bench_markdown

        meta = bench["meta"]
        tables += ["## Benchmarks", "",
                   f"Medians of interleaved rounds on rotating buffers; {meta.get('gpu', meta['cpu'])}"
                   + (f", copy bandwidth {meta['copy_bandwidth_GBps']:.0f} GB/s (floor = bytes that must move"
                      " / that bandwidth)" if "copy_bandwidth_GBps" in meta else "")
                   + (f"; peers skipped: {meta['skipped_peers']}" if meta.get("skipped_peers") else "") + ".",
                   bench_markdown(bench)]
    return "\n".join(lines), "\n".join(tables)


if __name__ == "__main__":
    sys.exit(main())
