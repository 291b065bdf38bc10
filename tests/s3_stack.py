"""Installs the remote-shard tests' S3 stack (the ``test-s3`` extra: moto's server, s3fs) into a folder beside
the virtual environment's site-packages: ``.venv/bin/python tests/s3_stack.py .venv/test-s3`` (``make`` runs it).

Why not into site-packages: ``pip freeze`` would list it, and the GPU machine's bundle is built from that list
(with it, 78 MiB of xz instead of 56, botocore and moto most of it; a device run carries 64 MiB at most).
The folder holds only what the environment lacks, resolved against what it has with its versions pinned, so
putting it on the path (tests/conftest.py does, PYTHONPATH included) never shadows the environment's own packages.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

EXTRA = "test-s3"
REPO = Path(__file__).resolve().parents[1]


def _pip(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "pip", *args], check=True, stdout=subprocess.PIPE, text=True).stdout


def install(target: Path) -> list[str]:
    """Replace ``target`` with the extra's packages that this interpreter's environment lacks; their names."""
    wanted = [
        req
        for req in map(Requirement, importlib.metadata.requires("dmltrain") or [])
        if req.marker is not None and req.marker.evaluate({"extra": EXTRA})
    ]
    for req in wanted:
        req.marker = None  # as a requirement of its own, not one of the extra
    if not wanted:
        sys.exit(f"s3_stack: the installed dmltrain declares no '{EXTRA}' extra (pip install -e . first)")
    target = target.absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        pinned = [line for line in _pip("freeze", "--exclude-editable").splitlines() if "==" in line]
        (work / "have.txt").write_text("\n".join(pinned) + "\n")
        # a dry run against the environment: what it would have to add, given that nothing it has may change
        _pip(
            "install",
            "-q",
            "--dry-run",
            "--report",
            str(work / "plan.json"),
            "-c",
            str(REPO / "constraints.txt"),
            "-c",
            str(work / "have.txt"),
            *(str(req) for req in wanted),
        )
        plan = json.loads((work / "plan.json").read_text())["install"]
        missing = [f"{p['metadata']['name']}=={p['metadata']['version']}" for p in plan]
        have = {canonicalize_name(d.metadata["Name"]) for d in importlib.metadata.distributions()}
        inside = sorted(n for n in (canonicalize_name(req.name) for req in wanted) if n in have)
        if inside:
            print(
                f"s3_stack: warning: {', '.join(inside)} installed in the environment itself (an older dev extra?), "
                "so in the GPU machine's bundle too; `make clean-venv setup` starts afresh",
                file=sys.stderr,
            )
        clash = sorted(m for m in missing if canonicalize_name(m.split("==")[0]) in have)
        if clash:
            sys.exit(f"s3_stack: {', '.join(clash)} would shadow the environment's own version")
        if missing:
            _pip("install", "-q", "--no-deps", "--target", str(work / "site"), *missing)
        else:
            (work / "site").mkdir()
        shutil.rmtree(target, ignore_errors=True)
        (work / "site").rename(target)
        return missing
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} TARGET_DIR")
    names = install(Path(sys.argv[1]))
    print(f"s3_stack: {len(names)} packages in {sys.argv[1]}")
