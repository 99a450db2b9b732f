"""Copy the stable-ABI variants of build/ into .artifact/ (ignored by git): the artifact the
GPU certification loads and certifies (scripts/certify.sh), sent to the device machine in the
device tool's `carry` beside .whl/. `make artifact` builds first, then runs this.

.artifact/ARTIFACT.json names it for the record: the commit it was built from (with "-dirty"
when tracked files differed from it), when, with which torch, and per variant its build id (the
ops name, a hash of the sources and flags), CUDA archs and size. Refuses without the stable CUDA
variant, or when that variant lacks machine code for 9.0 (the H200 the certification runs on).

  python tools/pack_artifact.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
ARTIFACT = ROOT / ".artifact"


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def main() -> int:
    variants = sorted(p for p in BUILD.glob("torch-stable-abi*") if p.is_dir())
    metadata = {v.name: json.loads((v / "metadata.json").read_text()) for v in variants}
    cuda = [name for name, meta in metadata.items() if meta["backend"]["type"] == "cuda"]
    if not cuda:
        print(f"[artifact] no stable-ABI CUDA variant in {BUILD}: run `make build` with nvcc", file=sys.stderr)
        return 1
    archs = metadata[cuda[0]]["backend"]["archs"]
    if not any(a.removesuffix("+PTX") == "9.0" for a in archs):
        print(f"[artifact] {cuda[0]} has no 9.0 machine code (archs {archs}): unset LP_CUDA_ARCHS",
              file=sys.stderr)
        return 1
    commit = git("rev-parse", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    if ARTIFACT.exists():
        shutil.rmtree(ARTIFACT)
    described = {}
    for variant in variants:
        shutil.copytree(variant, ARTIFACT / variant.name)
        meta = metadata[variant.name]
        described[variant.name] = {
            "id": meta["id"], "backend": meta["backend"]["type"], "archs": meta["backend"].get("archs"),
            "bytes": sum(f.stat().st_size for f in (ARTIFACT / variant.name).iterdir())}
    record = {"commit": commit, "built": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "built_with_torch": torch.__version__, "variants": described}
    (ARTIFACT / "ARTIFACT.json").write_text(json.dumps(record, indent=1) + "\n")
    total = sum(v["bytes"] for v in described.values())
    print(f"[artifact] {ARTIFACT.relative_to(ROOT)}/: {', '.join(described)} ({total / 2**20:.1f} MiB), "
          f"commit {commit}" + ("  WARNING: built from uncommitted changes" if commit.endswith("-dirty") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
