"""The sanitizer runs cover what the fibers run covers: every line of the kernels' sources
(logits_processor/), in every function instantiation (each dtype's read path is its own
template instance), that the emulated tests reach on fibers is reached under ThreadSanitizer
and under AddressSanitizer + UBSan too, on their smaller cases.

The emulation's kernels are built with gcov's counters in these flavors (tools/build_emulation.py);
each run adds to its flavor's .gcda files. `reset` removes them (before the runs), `check`
compares them (after) and fails listing each line missed, unless EXCEPTIONS names it.

  python tests/cuda_emulation/coverage.py reset|check
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from build_emulation import OUT, SCHEMA, config, emulated_kernels  # noqa: E402

REFERENCE = "fibers"
SANITIZED = ["tsan", "asan"]
SOURCES = ROOT / "logits_processor"
# Those flavors compile the kernels from the mutant schemata's copy, line for line the sources.
COMPILED = SCHEMA

# (file relative to the root, line) -> why a sanitizer run need not reach it. Keep it short:
# a line belongs here only if reaching it under a sanitizer costs far more than it could find,
# or if gcov cannot count it there: a small function that ASan + UBSan's build inlines early
# into its caller (gcov then counts its lines at the call, which that run reaches) while it
# keeps an out-of-line copy that nothing calls (gcov's function records: 0 executions).
_INLINED_UNDER_ASAN = "inlined early by the asan build into its caller, which its runs reach"
EXCEPTIONS: dict[tuple[str, int], str] = {
    **{("logits_processor/sampling.h", n): _INLINED_UNDER_ASAN + " (RowSampler::kept_score)" for n in (219, 221)},
    **{("logits_processor/support_logprobs.h", n): _INLINED_UNDER_ASAN + " (support_logprobs_backward_kernel)"
       for n in range(121, 127)},
}

Line = tuple[str, str, int]  # (file, function, line number)


def object_dir(flavor: str) -> Path:
    return OUT / ".obj" / flavor


def reset() -> None:
    for flavor in [REFERENCE, *SANITIZED]:
        for gcda in object_dir(flavor).glob("*.gcda"):
            gcda.unlink()


def lines(flavor: str) -> tuple[set[Line], set[Line]]:
    """(instrumented, reached) lines of the kernels' sources in `flavor`'s objects."""
    instrumented: set[Line] = set()
    reached: set[Line] = set()
    for kernel in emulated_kernels(config()):
        gcda = object_dir(flavor) / (Path(kernel).stem + ".gcda")
        if not gcda.exists():
            raise SystemExit(f"[coverage] no {gcda.relative_to(ROOT)}: the {flavor} run did not run {kernel}")
        report = subprocess.run(["gcov", "--json-format", "--stdout", gcda.name], cwd=gcda.parent,
                                check=True, capture_output=True, text=True).stdout
        for document in report.splitlines():
            for source in json.loads(document)["files"]:
                path = Path(source["file"])
                if not path.is_relative_to(COMPILED):
                    continue
                name = (SOURCES / path.relative_to(COMPILED)).relative_to(ROOT).as_posix()
                for entry in source["lines"]:
                    line = (name, entry.get("function_name", ""), entry["line_number"])
                    instrumented.add(line)
                    if entry["count"] > 0:
                        reached.add(line)
    return instrumented, reached


def demangled(names: set[str]) -> dict[str, str]:
    names = sorted(n for n in names if n)
    out = subprocess.run(["c++filt"], input="\n".join(names), check=True, capture_output=True, text=True).stdout
    return dict(zip(names, out.splitlines()))


def missed(reference: set[Line], instrumented: set[Line], reached: set[Line]) -> tuple[set[Line], int]:
    """The reference's lines that a flavor instruments and never reaches, and how many it does
    not instrument at all. A line is compared in its function where the flavor has that
    function; gcov names no function for some lines, and a build may inline a small function
    early where another keeps it: such lines are compared whatever function holds them. A line
    a build merged into its neighbour's block has no count of its own there: not comparable."""
    functions = {function for _, function, _ in instrumented}
    anywhere = {(file, number) for file, _, number in instrumented}
    reached_anywhere = {(file, number) for file, _, number in reached}
    misses, uncomparable = set(), 0
    for line in reference:
        file, function, number = line
        if (file, number) in EXCEPTIONS:
            continue
        if function and function in functions:
            is_reached, is_instrumented = line in reached, line in instrumented
        else:
            is_reached, is_instrumented = (file, number) in reached_anywhere, (file, number) in anywhere
        if not is_instrumented:
            uncomparable += 1
        elif not is_reached:
            misses.add(line)
    return misses, uncomparable


def check() -> None:
    _, reference = lines(REFERENCE)
    missing: dict[str, set[Line]] = {}
    for flavor in SANITIZED:
        missing[flavor], uncomparable = missed(reference, *lines(flavor))
        print(f"[coverage] {flavor}: {len(reference) - len(missing[flavor]) - uncomparable} of the {len(reference)} "
              f"(function, line) pairs the {REFERENCE} runs reach are reached, {len(missing[flavor])} missed, "
              f"{uncomparable} not instrumented there (merged into a neighbouring line's block)")
    if not any(missing.values()):
        return
    names = demangled({function for miss in missing.values() for _, function, _ in miss})
    for flavor, miss in missing.items():
        by_line: dict[tuple[str, int], list[str]] = defaultdict(list)
        for file, function, number in miss:
            by_line[(file, number)].append(names.get(function, function))
        for (file, number), functions in sorted(by_line.items()):
            text = (ROOT / file).read_text().splitlines()[number - 1].strip()
            print(f"[coverage] {flavor} misses {file}:{number} `{text}` in {len(functions)} instance(s), "
                  f"e.g. {functions[0][:160]}")
    raise SystemExit("[coverage] the sanitizer runs miss lines the fibers run reaches (above)")


if __name__ == "__main__":
    {"reset": reset, "check": check}[sys.argv[1]]()
