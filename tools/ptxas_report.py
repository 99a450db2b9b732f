r"""The ptxas report of a CUDA build log (`LP_VERBOSE=1 tools/build.py`), as a table per
(kernel or non-inlined device function, arch), and the difference between two such logs.

  python tools/ptxas_report.py LOG                  the table
  python tools/ptxas_report.py OLD NEW [--arch sm_90] [--rename FROM=TO ...]
      the functions whose properties differ, or that only one log has; exit status 1 if any

Names are demangled (c++filt) with what depends on the translation unit stripped (the
anonymous namespace's and nvcc's per-file hashes), so a function keeps its name when it
moves to another .cu file. --rename FROM=TO renames OLD's names before the comparison, as
Python's re.sub(FROM, TO, name), in the order given: e.g. '\bRow\b=RowSampler'. Compile
times are left out; the per-module lines (gmem, cmem[4]) are listed apart, as they belong to
the .cu file, not to a function.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ENTRY = re.compile(r"ptxas info\s*: Compiling entry function '(\S+)' for '(sm_\w+)'")
PROPERTIES = re.compile(r"ptxas info\s*: Function properties for (\S+)")
FRAME = re.compile(r"^\s+(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"ptxas info\s*: Used (\d+) registers(.*)")
MODULE = re.compile(r"ptxas info\s*: (\d+ bytes gmem.*)")
NVCC = re.compile(r"nvcc\b.*?\s-c\s+(\S+\.cu)\s")
BYTES = re.compile(r"(\d+) bytes ([\w\[\]]+(?: [a-z]+)*)")
BARRIERS = re.compile(r"used (\d+) barriers")
# What nvcc's names carry of their file: _GLOBAL__N__<hash>_<len>_<file>_cu_<hash> (the
# anonymous namespace) and _INTERNAL_<hash>_<len>_<file>_cu_<hash> (a prefix of internal
# functions), demangled as "(anonymous namespace)::" and "_INTERNAL_...::".
INTERNAL = re.compile(r"_INTERNAL_[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+::")
ANONYMOUS = "(anonymous namespace)::"


def demangle(names: list[str]) -> dict[str, str]:
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return {m: INTERNAL.sub("", d).replace(ANONYMOUS, "").replace("logits_processor::", "")
            for m, d in zip(names, out)}


def parse(log: Path) -> tuple[dict[tuple[str, str], list[tuple]], list[str]]:
    """(name, arch) -> the sorted property tuples of each report of it; and the module lines."""
    raw: list[tuple[str, str, str, dict]] = []  # (function, arch, its entry, properties)
    modules: list[str] = []
    source = "?"
    arch = "?"
    entry = ""
    current: dict | None = None
    pending: list[str] = []  # a module's line comes before its first entry, which names the arch
    for line in log.read_text(errors="replace").splitlines():
        if m := NVCC.search(line):
            source = Path(m.group(1)).name
        elif m := ENTRY.search(line):
            entry, arch = m.group(1), m.group(2)
            modules += [f"{source} {arch}: {p}" for p in pending]
            pending = []
        elif m := PROPERTIES.search(line):
            current = {}
            raw.append((m.group(1), arch, entry, current))
        elif (m := FRAME.match(line)) and current is not None:
            current.update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)),
                           spill_loads=int(m.group(3)))
        elif (m := USED.search(line)) and raw:
            props = raw[-1][3]  # the entry's own line follows its frame line
            props["registers"] = int(m.group(1))
            if b := BARRIERS.search(m.group(2)):
                props["barriers"] = int(b.group(1))
            for value, what in BYTES.findall(m.group(2)):
                props[what.replace(" ", "_")] = int(value)
            current = None
        elif m := MODULE.search(line):
            pending.append(m.group(1))
    names = demangle(sorted({name for name, _, _, _ in raw} | {e for _, _, e, _ in raw}))
    table: dict[tuple[str, str], list[tuple]] = defaultdict(list)
    for name, a, e, props in raw:
        # A device function is reported after each entry that calls it, compiled for that entry.
        key = names[name] if name == e else f"{names[name]}  [called by {names[e]}]"
        table[(key, a)].append(tuple(sorted(props.items())))
    return {k: sorted(v) for k, v in table.items()}, modules


def render(props: tuple) -> str:
    return ", ".join(f"{k} {v}" for k, v in props)


def renamed(name: str, renames: list[tuple[str, str]]) -> str:
    for old, new in renames:
        name = re.sub(old, new, name)
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path, help="LOG, or OLD NEW")
    parser.add_argument("--arch", action="append", default=[], metavar="SM",
                        help="compare only this arch (e.g. sm_90; repeatable), as in a single-arch build")
    parser.add_argument("--rename", action="append", default=[], metavar="FROM=TO",
                        help="a regular expression over OLD's names and its replacement")
    args = parser.parse_args()
    if len(args.logs) == 1:
        table, modules = parse(args.logs[0])
        for (name, arch), reports in sorted(table.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            for props in reports:
                print(f"{arch}  {name}\n    {render(props)}")
        for line in modules:
            print(f"module {line}")
        return
    if len(args.logs) != 2:
        parser.error("one log (the table) or two (the difference)")
    renames = [tuple(r.split("=", 1)) for r in args.rename]
    old_table, old_modules = parse(args.logs[0])
    old = {(renamed(name, renames), arch): v for (name, arch), v in old_table.items()}
    new, new_modules = parse(args.logs[1])
    if args.arch:
        old = {k: v for k, v in old.items() if k[1] in args.arch}
        new = {k: v for k, v in new.items() if k[1] in args.arch}
        old_modules = [m for m in old_modules if m.split(":")[0].split()[-1] in args.arch]
        new_modules = [m for m in new_modules if m.split(":")[0].split()[-1] in args.arch]
    differences = 0
    for key in sorted(old.keys() | new.keys(), key=lambda k: (k[1], k[0])):
        if old.get(key) == new.get(key):
            continue
        differences += 1
        name, arch = key
        print(f"{arch}  {name}")
        for label, table in (("old", old), ("new", new)):
            for props in table.get(key, []) or ["(absent)"]:
                print(f"  {label}: {props if isinstance(props, str) else render(props)}")
    archs = sorted({arch for _, arch in new})
    print(f"[ptxas] {len(new)} (function, arch) entries in NEW over {', '.join(archs)}; "
          f"{len(old)} in OLD; {differences} differ")
    if sorted(old_modules) != sorted(new_modules):
        print("[ptxas] per-module lines (not compared):")
        for label, lines in (("old", old_modules), ("new", new_modules)):
            for line in lines:
                print(f"  {label}: {line}")
    sys.exit(1 if differences else 0)


if __name__ == "__main__":
    main()
