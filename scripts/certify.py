"""The certification run behind scripts/certify.sh (which installs the carried wheels first).

The subject is the artifact carried in .artifact/ (`make artifact`: the stable-ABI variants
built on the development machine, the very build this project would publish); without one,
the CUDA variant is built here first and certified instead. Stages, most decisive first, the
record (`<smXY>-<gpu>.json` and `.md`, or `no-gpu.*` without a GPU) rewritten after each one,
so a run stopped anywhere still leaves what it found:

  0. preflight: the tools and headers present (pip, nvcc, compute-sanitizer, nvidia-smi, g++,
     ninja, readelf/objcopy/strip, curand.h, cublas_v2.h) and the Python modules that import;
     a missing piece switches off only the stages that need it, saying so. FlashInfer's JIT
     build (`bench.py --prewarm`) starts now, in the background.
  1. tests: the loader loads the subject; the whole test suite (CUDA tests, CUDA/CPU agreement)
     runs against it, in certification mode (LP_OFFLINE=1: tests needing a package index skip).
  2. sanitizers: compute-sanitizer memcheck, racecheck, initcheck and synccheck over
     scripts/sanitizer_cases.py (a reduced case set, each call also checked against the CPU; every
     public op that launches a kernel, every kernel), in parallel, timed.
  3. graph: CUDA-graph capture and replay of a decoding step (scripts/graph_check.py).
  Stages 2 and 3 record the ops they ran on the GPU and the kernels those launch; without a GPU,
  what they would cover, from the scripts' CPU runs.
  4. bench: the GPU benchmarks against the copy-bandwidth floor and XGrammar (FlashInfer left
     out); without a GPU, `bench.py --device cpu --quick`.
  5. flashinfer: the quick GPU benchmark with FlashInfer, only if its JIT build has finished.
  6. build here (optional, when time is left): build the variants for the torch present
     (one arch: the GPU's, else 9.0) and run the bitmask and sampling tests against that build.
Certified (exit status 0) only with a GPU and stages 1-3 passed; benchmarks are reported, not
gating. Without a GPU: the CPU parts of 1, 4 and 6, a record named `no-gpu`, a loud notice
that nothing was certified, and exit status 0 if those parts passed.

Everything runs under one deadline (CERTIFY_BUDGET_S, default 390 s with a GPU, so that a
run under a 420 s device limit writes its record); each stage gets at most its cap and what
is left after keeping back the minimum of the decisive stages after it. Only the standard
library is imported at the top: torch and everything optional are imported inside a `try`,
so a failure there is recorded too.

  python scripts/certify.py OUT_DIR
Environment: CERTIFY_BUDGET_S, CERTIFY_SANITIZERS (default "memcheck racecheck initcheck synccheck"),
CERTIFY_COMMIT (recorded when git is not available, e.g. on the device machine), CERTIFY_WHEELS
(how certify.sh installed the carried wheels, recorded).
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
import traceback
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
START = time.monotonic()
ARTIFACT = ROOT / ".artifact"
# Seconds each stage may take at most, and the minimum kept back for the decisive ones.
CAP = {"tests": 170, "sanitizers": 100, "graph": 40, "bench": 70, "flashinfer": 45, "build here": 300}
RESERVE = {"sanitizers": 45, "graph": 15}


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
                out.flush()
                print(f"[{self.name}] {line}", end="", flush=True)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

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
        return {"rc": rc, "seconds": seconds, "status": "TIMEOUT" if rc is None else ("PASS" if rc == 0 else "FAIL")}

    def text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.text().splitlines()[-lines:])


class Deadline:
    def __init__(self, budget: float):
        self.end = START + budget

    def left(self, reserve: float = 0.0) -> float:
        return self.end - time.monotonic() - reserve


def run(cmd: list[str], timeout: float = 30) -> str:
    """A short query's output, or '' when the tool is missing or fails."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit() -> str:
    head = run(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    if not head:
        return os.environ.get("CERTIFY_COMMIT", "unknown")
    dirty = run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
    return head + ("-dirty" if dirty else "")


# --- preflight ----------------------------------------------------------------------------

TOOLS = ["nvcc", "compute-sanitizer", "nvidia-smi", "g++", "ninja", "readelf", "objcopy", "strip"]
HEADERS = {"curand.h": "FlashInfer's sampling JIT", "cublas_v2.h": "XGrammar's CUDA JIT (ATen/cuda)"}
MODULES = ["torch", "kernels", "xgrammar", "flashinfer.sampling", "jsonschema", "xdist", "hypothesis",
           "transformers", "pynvml", "requests"]
# What each optional stage or peer needs; a missing piece switches off only these.
NEEDS = {
    "sanitizers": ["compute-sanitizer"],
    "flashinfer": ["nvcc", "ninja", "g++", "curand.h", "flashinfer.sampling"],
    "xgrammar-cuda": ["nvcc", "ninja", "g++", "cublas_v2.h", "xgrammar"],
    "build here": ["nvcc", "g++", "ninja", "readelf", "strip"],
}


def cuda_home() -> Optional[str]:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    if Path("/usr/local/cuda/bin/nvcc").exists():
        return "/usr/local/cuda"
    return str(Path(nvcc).resolve().parent.parent) if nvcc else None


def preflight() -> dict:
    """What is present (a path, 'ok', a version) or missing (None, or the import error)."""
    start = time.monotonic()
    home = cuda_home()
    tools = {}
    for name in TOOLS:
        found = shutil.which(name) or (str(Path(home) / "bin" / name) if home and (Path(home) / "bin" / name).exists() else None)
        tools[name] = found
    # The toolkit's headers, or those of the nvidia-* wheels beside torch (site-packages/nvidia/).
    include_dirs = [Path(home) / "include"] if home else []
    for entry in sys.path:
        include_dirs += sorted(Path(entry or ".").glob("nvidia/*/include"))
    headers = {h: next((str(d / h) for d in include_dirs if (d / h).exists()), None) for h in HEADERS}
    probe = ("import importlib, json\nout = {}\nfor m in %r:\n    try:\n        importlib.import_module(m); out[m] = 'ok'\n"
             "    except BaseException as e:\n        out[m] = f'{type(e).__name__}: {e}'[:300]\nprint(json.dumps(out))" % MODULES)
    modules = json.loads(run([PY, "-c", probe], timeout=180) or "{}") or {m: "probe failed" for m in MODULES}
    pip = run([PY, "-m", "pip", "--version"])
    present = {**{k: v for k, v in tools.items()}, **headers, **{m: (v if v == "ok" else None) for m, v in modules.items()}}
    switched_off = {stage: [n for n in needs if not present.get(n)] for stage, needs in NEEDS.items()}
    result = {"seconds": round(time.monotonic() - start, 1), "cuda_home": home, "pip": pip or None,
              "wheels": os.environ.get("CERTIFY_WHEELS", "not reported (certify.py run without certify.sh)"),
              "tools": tools, "headers": headers, "modules": modules,
              "switched_off": {k: v for k, v in switched_off.items() if v}}
    for name, value in {**tools, **headers}.items():
        log(f"preflight: {name:18} {value or 'MISSING'}")
    for name, value in modules.items():
        log(f"preflight: import {name:20} {value}")
    log(f"preflight: pip {pip or 'MISSING'}; wheels: {result['wheels']}")
    for stage, missing in result["switched_off"].items():
        log(f"preflight: {stage} SWITCHED OFF: missing {', '.join(missing)}")
    return result


# --- results ------------------------------------------------------------------------------

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
    reasons: dict[str, int] = {}
    for case in root.iter("testcase"):
        skip = case.find("skipped")
        if skip is not None:
            reason = skip.get("message", "")[:160]
            reasons[reason] = reasons.get(reason, 0) + 1
    return {"passed": total - failed - errors - skipped, "failed": failed, "errors": errors,
            "skipped": skipped, "failures": failures[:30], "skip_reasons": reasons}


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


# ptxas's resource report (-Xptxas=-v): dozens of lines per kernel, never the error.
PTXAS_REPORT = re.compile(r"^\s*(ptxas info\s*:|\d+ bytes stack frame)")


def build_errors(text: str, lines: int = 30) -> str:
    """A failed build's errors: the compiler's error lines with the line before each, or
    without any, the last lines that are not ptxas's resource report."""
    kept = [line for line in text.splitlines() if not PTXAS_REPORT.match(line)]
    errors = [i for i, line in enumerate(kept)
              if re.search(r"\berror\b|Error:|FAILED|SystemExit|NO CUDA VARIANT|asks for CUDA", line)]
    if not errors:
        return "\n".join(kept[-lines:])
    picked = sorted({j for i in errors for j in (i - 1, i) if j >= 0})
    return "\n".join(kept[j] for j in picked[:lines])


def loaded_variant(build_dir: Path, backend: Optional[str] = None) -> dict:
    """The variant the loader picks from build_dir for this torch (as the tests load it)."""
    try:
        from kernels import get_local_kernel

        variant = Path(get_local_kernel(build_dir, backend=backend).__file__).parent
        meta = json.loads((variant / "metadata.json").read_text())
        return {"status": "PASS", "variant": variant.name, "id": meta.get("id"),
                "archs": meta["backend"].get("archs")}
    except Exception as error:  # recorded; the tests fail on it too
        return {"status": "FAIL", "detail": f"none loadable from {build_dir.name}/: {type(error).__name__}: {error}"}


def skipped(detail: str) -> dict:
    log(f"SKIP: {detail}")
    return {"status": "SKIP", "detail": detail}


# --- the run ------------------------------------------------------------------------------

class Certification:
    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.work = Path(tempfile.mkdtemp(prefix="certify-"))  # step logs; out_dir gets results
        self.record: dict = {"certified": False, "complete": False, "environment": {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
            "python": sys.version.split()[0], "cpus": os.cpu_count()}, "stages": {}}
        self.name = "no-gpu"
        self.gpu = False

    @property
    def stages(self) -> dict:
        return self.record["stages"]

    def write(self) -> None:
        """The record as it stands (JSON and Markdown), after every stage."""
        self.record["seconds"] = round(time.monotonic() - START, 1)
        (self.out_dir / f"{self.name}.json").write_text(json.dumps(self.record, indent=1) + "\n")
        summary, tables = render(self.record)
        (self.out_dir / f"{self.name}.md").write_text(f"{summary}\n\n{tables}\n")

    def tests(self, build_dir: Path, files: list[str], timeout: float, name: str, env: Optional[dict] = None) -> dict:
        junit = self.work / f"{name}.xml"
        cmd = [PY, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
        workers = min(6, (os.cpu_count() or 1) // 2)
        if workers >= 2 and self.record["preflight"]["modules"].get("xdist") == "ok":
            cmd += ["-n", str(workers)]
        # Tests and the background JIT share the cores: two torch threads per process.
        env = {"LP_BUILD_DIR": str(build_dir), "LP_OFFLINE": "1", "OMP_NUM_THREADS": "2", **(env or {})}
        step = Step(name, cmd, self.work / f"{name}.log", env).start()
        result = step.wait(timeout)
        counts = junit_counts(junit)
        ok = result["rc"] == 0 and counts["failed"] == counts["errors"] == 0 and counts["passed"] > 0
        if junit.exists() and name == "tests":  # the device returns 8 files at most
            shutil.copy(junit, self.out_dir / "junit.xml")
        out = {**result, **counts, "status": "TIMEOUT" if result["rc"] is None else ("PASS" if ok else "FAIL")}
        if not ok:
            out["tail"] = step.tail()
        return out

    def coverage(self, script: str, subject: Path) -> dict:
        """What a GPU stage's script would run, from its CPU run (no GPU: the dry run's list)."""
        path = self.work / f"{script}.json"
        step = Step(script, [PY, f"scripts/{script}", "--device", "cpu", "--json", str(path)],
                    self.work / f"{script}.log", {"LP_BUILD_DIR": str(subject)}).start()
        result = step.wait(300)
        return json.loads(path.read_text())["covers"] if path.exists() else {"error": result["status"] + ": " + step.tail()}

    def build(self, timeout: float, env: dict) -> dict:
        step = Step("build", [PY, "tools/build.py"], self.work / "build.log", env).start()
        result = step.wait(timeout)
        if result["status"] != "PASS":
            result["errors"] = build_errors(step.text())
        return result

    def main(self) -> int:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = self.record
        try:
            import torch
        except BaseException as error:
            record["error"] = f"import torch failed: {type(error).__name__}: {error}"
            self.write()
            log(record["error"])
            return 1
        self.gpu = gpu = torch.cuda.is_available()
        env = record["environment"]
        env.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
        if gpu:
            major, minor = torch.cuda.get_device_capability(0)
            env.update(gpu=torch.cuda.get_device_name(0), capability=f"{major}.{minor}",
                       driver=run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).split("\n")[0]
                       or "unknown")
            slug = re.sub(r"[^a-z0-9]+", "-", env["gpu"].lower().replace("nvidia", "")).strip("-")
            self.name = f"sm{major}{minor}-{slug}"
        deadline = Deadline(float(os.environ.get("CERTIFY_BUDGET_S", 390 if gpu else 3600)))
        # The stages' caps fit the device's limit; without a GPU only the deadline applies.
        cap = CAP if gpu else dict.fromkeys(CAP, float("inf"))
        log(f"{'GPU: ' + env['gpu'] + ' (sm ' + env['capability'] + ')' if gpu else 'no CUDA GPU visible'}; "
            f"torch {env['torch']} (CUDA {env['torch_cuda']}), python {env['python']}, commit {env['commit']}")

        # 0. preflight; FlashInfer's JIT (minutes of nvcc) starts first, in the background.
        record["preflight"] = pre = preflight()
        off = pre["switched_off"]
        prewarm = None
        if gpu and "flashinfer" not in off:
            prewarm = Step("prewarm", [PY, "benchmarks/bench.py", "--prewarm"], self.work / "prewarm.log").start()
        carried = (ARTIFACT / "ARTIFACT.json").exists()
        record["artifact"] = ({"source": "carried (.artifact/, make artifact)",
                               **json.loads((ARTIFACT / "ARTIFACT.json").read_text())} if carried
                              else {"source": "none carried: built on this machine (stage 'build here' first)"})
        self.write()

        subject = ARTIFACT if carried else ROOT / "build"
        if not carried:
            build_env = {"LP_CUDA_ARCHS": env.get("capability", "9.0")}
            self.stages["build here"] = self.build(min(cap["build here"], deadline.left(cap["tests"])), build_env)
            self.write()

        # 1. load + the whole suite against the subject (CUDA tests, CUDA/CPU agreement).
        load = loaded_variant(subject)
        if gpu and "-cu" not in load.get("variant", "-cu"):
            load = {**load, "status": "FAIL", "detail": f"the loader picked {load['variant']}, not a CUDA variant"}
        tests = self.tests(subject, ["tests"], min(cap["tests"], deadline.left(sum(RESERVE.values()))), "tests")
        self.stages["tests"] = {**tests, "load": load,
                                "status": tests["status"] if load["status"] == "PASS" else "FAIL"}
        self.write()

        # 2. compute-sanitizer on the reduced case set, the tools in parallel.
        tools = os.environ.get("CERTIFY_SANITIZERS", "memcheck racecheck initcheck synccheck").split()
        if not gpu:
            self.stages["sanitizers"] = {**skipped("no GPU"), "covers": self.coverage("sanitizer_cases.py", subject)}
        elif "sanitizers" in off:
            self.stages["sanitizers"] = {"status": "FAIL", "detail": "compute-sanitizer not found"}
        else:
            sanitizer = pre["tools"]["compute-sanitizer"]
            # Every tensor its own cudaMalloc: memcheck sees only accesses outside allocations.
            senv = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1", "LP_BUILD_DIR": str(subject), "OMP_NUM_THREADS": "2"}
            running = {tool: Step(tool, [sanitizer, "--tool", tool, "--error-exitcode", "99", "--print-limit", "20",
                                         PY, "scripts/sanitizer_cases.py", "--json", str(self.work / f"{tool}.json")],
                                  self.work / f"{tool}.log", senv).start()
                       for tool in tools}
            end = time.monotonic() + min(cap["sanitizers"], deadline.left(RESERVE["graph"]))
            results = {}
            with open(self.out_dir / "sanitizers.log", "w") as combined:
                for tool, step in running.items():
                    result = step.wait(end - time.monotonic())
                    combined.write(f"===== {tool} =====\n{step.text()}\n")
                    summary = sanitizer_summary(step.text())
                    # rc 99: the sanitizer found errors; 1: a case computed a wrong result.
                    ok = result["rc"] == 0 and summary["errors"] == 0
                    results[tool] = {**result, **summary,
                                     "status": "TIMEOUT" if result["rc"] is None else ("PASS" if ok else "FAIL")}
                    if not ok:
                        results[tool]["tail"] = step.tail(40)
            ran = [json.loads(path.read_text()) for path in (self.work / f"{t}.json" for t in tools) if path.exists()]
            self.stages["sanitizers"] = {"status": "PASS" if all(r["status"] == "PASS" for r in results.values())
                                         else "FAIL", "tools": results, "covers": ran[0]["covers"] if ran else {}}
        self.write()

        # 3. the CUDA-graph check.
        if gpu:
            graph_json = self.work / "graph.json"
            step = Step("graph", [PY, "scripts/graph_check.py", "--json", str(graph_json)], self.work / "graph.log",
                        {"LP_BUILD_DIR": str(subject)}).start()
            result = step.wait(min(cap["graph"], deadline.left()))
            detail = json.loads(graph_json.read_text()) if graph_json.exists() else {"tail": step.tail()}
            self.stages["graph"] = {**detail, **result}
        else:
            self.stages["graph"] = {**skipped("no GPU"), "covers": self.coverage("graph_check.py", subject)}
        self.write()

        # 4. benchmarks against the copy-bandwidth floor and XGrammar (FlashInfer in stage 5).
        bench_json = self.out_dir / "bench.json"
        cmd = [PY, "benchmarks/bench.py", "--json", str(bench_json)]
        cmd += (["--device", "cuda", "--without", "flashinfer"] + (["--without", "xgrammar-cuda"] if "xgrammar-cuda" in off else [])
                if gpu else ["--device", "cpu", "--quick"])
        step = Step("bench", cmd, self.work / "bench.log", {"LP_BUILD_DIR": str(subject)}).start()
        result = step.wait(min(cap["bench"], deadline.left()))
        self.stages["bench"] = {**result, "status": result["status"] if bench_json.exists() or result["rc"] is None else "FAIL"}
        if result["status"] != "PASS":
            self.stages["bench"]["tail"] = step.tail()
        record["benchmark"] = json.loads(bench_json.read_text()) if bench_json.exists() else None
        self.write()

        # 5. FlashInfer, only if its JIT build finished in the background.
        if not gpu:
            self.stages["flashinfer"] = skipped("no GPU")
        elif prewarm is None:
            self.stages["flashinfer"] = skipped(f"switched off: missing {', '.join(off['flashinfer'])}")
        elif prewarm.running() or not re.search(r"\] flashinfer .* ready", prewarm.text()):
            reason = (f"its JIT build had not finished after {time.monotonic() - prewarm.started:.0f} s"
                      if prewarm.running() else "its prewarm did not make it ready: " + prewarm.tail(5))
            self.stages["flashinfer"] = skipped(reason)
        elif deadline.left() < 20:
            self.stages["flashinfer"] = skipped(f"{deadline.left():.0f} s left")
        else:
            fi_json = self.out_dir / "bench-flashinfer.json"
            step = Step("flashinfer", [PY, "benchmarks/bench.py", "--device", "cuda", "--quick", "--json", str(fi_json)],
                        self.work / "flashinfer.log", {"LP_BUILD_DIR": str(subject)}).start()
            result = step.wait(min(cap["flashinfer"], deadline.left()))
            self.stages["flashinfer"] = result
            record["benchmark_flashinfer"] = json.loads(fi_json.read_text()) if fi_json.exists() else None
        if prewarm is not None and prewarm.running():
            prewarm.wait(0)
        self.write()

        # 6. optional: build for the torch present and test that build too.
        if carried:
            left = deadline.left()
            if "build here" in off:
                self.stages["build here"] = skipped(f"missing {', '.join(off['build here'])}")
            elif left < 90:
                self.stages["build here"] = skipped(f"only {left:.0f} s left")
            else:
                build_env = {"LP_CUDA_ARCHS": env.get("capability", "9.0"), "LP_BACKENDS": "cuda,cpu"}
                built = self.build(min(cap["build here"], left - 30), build_env)
                if built["status"] == "PASS" and deadline.left() > 20:
                    built["tests"] = self.tests(ROOT / "build", ["tests/ops/test_bitmask.py", "tests/ops/test_sampling.py",
                                                                 "tests/cuda_emulation/test_bitmask_cuda.py",
                                                                 "tests/cuda_emulation/test_sampler_cuda.py",
                                                                 "-m", "not emulation"],
                                                deadline.left(), "tests-build-here", build_env)
                    built["status"] = built["tests"]["status"]
                self.stages["build here"] = built
            self.write()

        # With a GPU the decisive stages must pass; without one, every CPU part that ran.
        gating = (["tests", "sanitizers", "graph"] + ([] if carried else ["build here"]) if gpu
                  else [name for name, s in self.stages.items() if s["status"] != "SKIP"])
        passed = all(self.stages[name]["status"] == "PASS" for name in gating)
        record["certified"] = gpu and passed
        record["complete"] = True
        self.write()
        shutil.rmtree(self.work, ignore_errors=True)
        log(f"record written: {self.out_dir / self.name}.json and .md")
        summary, tables = render(record)
        # The summary last: a caller that keeps only the end of the output still sees the verdict.
        print(f"\n{tables}\n\n{summary}", flush=True)
        if not gpu:
            print("\n" + "!" * 78 + "\nNOTHING WAS CERTIFIED: no CUDA GPU is visible. Only the CPU parts ran "
                  f"(tests, CPU benchmark, build): {'they passed' if passed else 'THEY FAILED'}.\n" + "!" * 78,
                  flush=True)
            return 0 if passed else 1
        return 0 if record["certified"] else 1


def stage_line(name: str, s: dict) -> str:
    if "passed" in s:
        detail = (f"{s['passed']} passed, {s['failed']} failed, {s['errors']} errors, {s['skipped']} skipped"
                  f" ({s.get('seconds')} s)")
    elif "tools" in s:
        detail = "; ".join(f"{tool} {t['status']}: " + (t.get("detail") or f"{t.get('errors')} errors"
                           + (f", {t['warnings']} warnings" if "warnings" in t else "") + f" ({t.get('seconds')} s)")
                           for tool, t in s["tools"].items())
    elif "checks" in s:
        detail = ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in s["checks"].items())
    else:
        detail = s.get("detail") or (f"{s['seconds']} s" if "seconds" in s else "")
    return f"| {name} | {s['status']}: {detail} |"


def render(record: dict) -> tuple[str, str]:
    """(the summary: environment, artifact, stages, failures; the benchmark tables) in Markdown."""
    env, stages = record["environment"], record["stages"]
    title = (f"# Certification: {env['gpu']} (sm {env['capability']})" if "gpu" in env
             else "# No GPU: nothing certified (CPU parts only)")
    verdict = "CERTIFIED" if record["certified"] else "NOT CERTIFIED"
    lines = [title, "", f"**{verdict}** on {env['date']}, commit `{env['commit']}`, in {record.get('seconds')} s"
             + ("" if record["complete"] else " (INCOMPLETE: the run stopped before its end)") + ".", ""]
    if record.get("error"):
        lines += [f"**Error:** {record['error']}", ""]
    lines += ["| | |", "|---|---|"]
    if "gpu" in env:
        lines += [f"| GPU | {env['gpu']}, compute capability {env['capability']}, driver {env['driver']} |"]
    lines.append(f"| torch | {env.get('torch')} (CUDA {env.get('torch_cuda')}), Python {env['python']} |")
    artifact = record.get("artifact", {})
    lines.append(f"| artifact | {artifact.get('source', '-')}"
                 + (f", commit `{artifact['commit']}`, built {artifact['built']} with torch {artifact['built_with_torch']}: "
                    + "; ".join(f"{name} `{v['id']}`" + (f" archs {', '.join(v['archs'])}" if v.get("archs") else "")
                                for name, v in artifact["variants"].items()) if "variants" in artifact else "") + " |")
    pre = record.get("preflight")
    if pre:
        missing = [n for n, v in {**pre["tools"], **pre["headers"]}.items() if not v]
        lines.append(f"| preflight | pip {'present' if pre['pip'] else 'MISSING'}; wheels: {pre['wheels']}; "
                     f"missing: {', '.join(missing) or 'nothing'}"
                     + "".join(f"; {stage} off (no {', '.join(m)})" for stage, m in pre["switched_off"].items()) + " |")
    load = stages.get("tests", {}).get("load")
    if load:
        lines.append(f"| loader | {load['status']}: {load.get('variant') or load.get('detail')} |")
    for name, s in stages.items():
        lines.append(stage_line(name, s))
        if "tests" in s:
            lines.append(stage_line(f"{name}: tests", s["tests"]))
    covered = [(name, s["covers"]) for name, s in stages.items() if s.get("covers")]
    if covered:
        lines += ["", "What the GPU stages run" + ("" if "gpu" in env else " (would run: the scripts' CPU runs)") + ":"]
        for name, c in covered:
            lines.append(f"- {name}: " + (f"{len(c['ops'])} ops ({', '.join(c['ops'])}); the {len(c['kernels'])} "
                                          f"kernels they launch ({', '.join(c['kernels'])})" if "ops" in c else f"not listed: {c.get('error')}"))
    for name, s in stages.items():
        for part in (s, s.get("tests", {}), *s.get("tools", {}).values()):
            if part.get("failures"):
                lines += ["", f"Failed in {name}: {', '.join(part['failures'])}"]
            for key in ("errors", "tail"):
                if isinstance(part.get(key), str):
                    lines += ["", f"{name} ({key}):", "```", part[key], "```"]
    tables = []
    for key, heading in (("benchmark", "Benchmarks"), ("benchmark_flashinfer", "Benchmarks with FlashInfer (quick set)")):
        bench = record.get(key)
        if not bench:
            continue
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from report import markdown as bench_markdown

        meta = bench["meta"]
        tables += [f"## {heading}", "",
                   f"Medians of interleaved rounds on rotating buffers; {meta.get('gpu', meta['cpu'])}"
                   + (f", copy bandwidth {meta['copy_bandwidth_GBps']:.0f} GB/s (floor = bytes that must move"
                      " / that bandwidth)" if "copy_bandwidth_GBps" in meta else "")
                   + (f"; peers skipped: {meta['skipped_peers']}" if meta.get("skipped_peers") else "")
                   + ("" if bench["complete"] else f"; stopped after {len(bench['cases'])} cases") + ".",
                   bench_markdown(bench), ""]
    return "\n".join(lines), "\n".join(tables)


def main() -> int:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT") or ROOT / "certification" / "out")
    certification = Certification(out_dir)
    try:
        return certification.main()
    except BaseException:  # whatever broke, the record says so
        certification.record["error"] = traceback.format_exc()[-3000:]
        certification.write()
        print(certification.record["error"], flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
