"""The docs name only what exists: every path, `file::name`, test name and `make` target in
the code of README.md, CARD.md and docs/*.md (inline and fenced), every relative link and its
anchor; and the API table lists exactly `__all__`, the same in the README and the Hub card.
Plain text reading, but for the signatures the API table is held to (from the loaded package)."""

from __future__ import annotations

import ast
import fnmatch
import inspect
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "CARD.md", *sorted((ROOT / "docs").glob("*.md"))]
# Build outputs and local state (.gitignore's anchored entries; GENERATED: those at the top of
# the tree) and caches anywhere: named by the docs, absent from a fresh clone, and not read for
# file names (a .venv-vllm that CI installs beside the tests would otherwise decide a verdict).
IGNORED = {line.strip().strip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
           if line.strip().startswith("/")}  # (the anchored entries; no "!" or "#" line starts so)
GENERATED = {".git"} | {path for path in IGNORED if "/" not in path}
CACHES = {"__pycache__", ".pytest_cache", ".hypothesis"}
GENERATED_FILES = {"_ops.py", "metadata.json", "ARTIFACT.json", "release-report.md"}
SOURCE_SUFFIXES = {".py", ".h", ".cuh", ".cu", ".cpp", ".sh", ".toml", ".md", ".ini", ".txt", ".nix", ".json"}

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"^[\w.~-]+(/[\w.*-]*)+$")
MAKE = re.compile(r"\bmake ([a-z][\w-]*)")


def code_of(text: str) -> list[str]:
    """The code in a Markdown text: fenced blocks, then inline spans outside them."""
    blocks = FENCE.findall(text)
    return blocks + INLINE.findall(FENCE.sub("", text))


def tokens(code: str) -> list[str]:
    return [t.rstrip(".:,") for t in re.split(r"[\s,;()\[\]=\"'|]+", code) if t]


@cache
def tree() -> list[Path]:
    """The repository's files, less what is generated."""
    def walk(folder: Path):
        for p in folder.iterdir():
            if p.name in CACHES or p.relative_to(ROOT).as_posix() in IGNORED | GENERATED:
                continue
            if p.is_dir():
                yield from walk(p)
            else:
                yield p
    return list(walk(ROOT))


@cache
def defined_tests() -> set[str]:
    return {name for p in tree() if p.suffix == ".py" and p.is_relative_to(ROOT / "tests")
            for name in re.findall(r"^def (test_\w+)", p.read_text(), re.M)}


@cache
def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def problem(token: str) -> str | None:
    """Why `token` (from a doc's code) names nothing, or None."""
    path, _, name = token.partition("::")
    if name and not PATH.match(path):
        return None
    if PATH.match(path):
        first = path.split("/")[0]
        if first in GENERATED or first.startswith("~") or "<" in path or "{" in path:
            return None
        if not (ROOT / first).exists():
            suffix = Path(path).suffix
            return f"{path}: no such path" if suffix in SOURCE_SUFFIXES else None
        matches = list(ROOT.glob(path.rstrip("/")))
        if not matches:
            return f"{path}: no such path"
        if name and not re.search(rf"^(def|class) {re.escape(name)}\b|^{re.escape(name)}\s*=",
                                  matches[0].read_text(), re.M):
            return f"{token}: {path} defines no {name}"
        return None
    if re.fullmatch(r"test_[\w*]+", token):
        return None if fnmatch.filter(defined_tests(), token) else f"{token}: no such test"
    if re.fullmatch(r"[\w-]+\.\w+", token) and Path(token).suffix in SOURCE_SUFFIXES:
        if token not in GENERATED_FILES and not any(p.name == token for p in tree()):
            return f"{token}: no file of that name"
    return None


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    text = FENCE.sub("", doc.read_text())
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_names_what_exists(doc):
    text = doc.read_text()
    problems = [p for code in code_of(text) for t in tokens(code) if (p := problem(t))]
    problems += [f"make {t}: no such target" for code in code_of(text) for t in MAKE.findall(code)
                 if t not in make_targets()]
    assert not problems, "\n".join(sorted(set(problems)))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(doc):
    problems = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        if doc.name == "CARD.md":  # the Hub card ships alone: a relative link would dangle there
            problems.append(f"{target}: a relative link in the Hub card")
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            problems.append(f"{target}: no such file")
        elif anchor and anchor not in anchors(linked):
            problems.append(f"{target}: no heading of that anchor in {linked.relative_to(ROOT)}")
    assert not problems, "\n".join(problems)


def api_table(doc: Path) -> str:
    text = doc.read_text()
    return text[text.index("<!-- api -->"):text.index("<!-- /api -->")]


def test_api_table_is_all_and_the_card_has_the_same():
    module = ast.parse((ROOT / "torch-ext" / "logits_processor" / "__init__.py").read_text())
    exported = next(ast.literal_eval(node.value) for node in module.body if isinstance(node, ast.Assign)
                    and any(getattr(t, "id", None) == "__all__" for t in node.targets))
    listed = re.findall(r"^\| `(\w+)", api_table(ROOT / "README.md"), re.M)
    assert sorted(listed) == sorted(exported), "the README's API table, a line per name of __all__"
    assert api_table(ROOT / "CARD.md") == api_table(ROOT / "README.md"), "CARD.md's API table differs"


def test_the_checks_can_fail(lp):
    assert problem("tests/ops/test_sampling.py::test_no_such_thing")
    assert problem("tests/ops/no_such_file.py")
    assert problem("test_no_such_test")
    assert problem("no_such_header.h")
    signature = public_signatures(lp)["sample"]  # what the API table's rows are held to
    assert signature.startswith("sample(logits, temperature, top_k,") and ", *, bitmask," in signature
    assert problem("tests/ops/test_sampling.py::test_determinism_and_offset") is None
    assert problem("test_cuda_build_carries_all_architectures") is None  # (in tests/build/)
    assert slug("## `make test`: the procedure".lstrip("# ")) == "make-test-the-procedure"


def public_signatures(lp) -> dict[str, str]:
    """From the loaded package (the sampler ops' signatures are generated from the controls'
    declaration, _controls.py): each public function's signature as `name(a, b, *, c)`, each
    named tuple's fields as `(a, b)`."""
    found = {}
    for name in lp.__all__:
        obj = getattr(lp, name)
        if isinstance(obj, type) and issubclass(obj, tuple):
            found[name] = f"({', '.join(obj._fields)})"
        elif inspect.isfunction(obj):
            names, star = [], False
            for p in inspect.signature(obj).parameters.values():
                if p.kind is p.KEYWORD_ONLY and not star:
                    names.append("*")
                star = star or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
                names.append({p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name)
            found[name] = f"{name}({', '.join(names)})"
    return found


def test_api_table_gives_each_signature_as_the_code_has_it(lp):
    """A function's row opens with its whole signature, a named tuple's row names its fields in
    order, both as the loaded package has them."""
    signatures = public_signatures(lp)
    problems = []
    for row in re.findall(r"^\| `.*$", api_table(ROOT / "README.md"), re.M):
        shown = row.split("`")[1]
        name = re.match(r"\w+", shown).group(0)
        expected = signatures.get(name)
        if expected is None:
            continue  # a constant (bitmask_dtype)
        if expected.startswith(name + "(") and shown != expected:
            problems.append(f"{name}: the table has `{shown}`, the code `{expected}`")
        elif expected.startswith("(") and f"`{expected}`" not in row:
            problems.append(f"{name}: its fields `{expected}` are not in its row")
    assert not problems, "\n".join(problems)
