"""Installs one of dmltrain's extras into a folder beside the virtual environment's site-packages:
``.venv/bin/python tests/side_stack.py EXTRA TARGET`` (``make`` runs it for ``test-s3``, the remote-shard tests'
moto server and s3fs, into ``.venv/test-s3``, for ``docs``, mkdocs and its plugins, into ``.venv/docs``, and for
``lint``, ruff, into ``.venv/lint``).

Why not into site-packages: ``pip freeze`` would list them, and the GPU machine's bundle is built from that list
(a device run carries 64 MiB at most: with the S3 stack the bundle was 78 MiB of xz instead of 56, botocore and
moto most of it; with the docs stack 77, Babel's locale data most of it; ruff's binary adds 7). Each folder holds only what the
environment lacks, resolved against what it has with its versions pinned, so putting it on the path
(tests/conftest.py does, PYTHONPATH included; the Makefile's docs targets too) never shadows the environment's own
packages.
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

REPO = Path(__file__).resolve().parents[1]


def _pip(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "pip", *args], check=True, stdout=subprocess.PIPE, text=True).stdout


def install(extra: str, target: Path) -> list[str]:
    """Replace ``target`` with ``extra``'s packages that this interpreter's environment lacks; their names."""
    wanted = [
        req
        for req in map(Requirement, importlib.metadata.requires("dmltrain") or [])
        if req.marker is not None and req.marker.evaluate({"extra": extra})
    ]
    for req in wanted:
        req.marker = None  # as a requirement of its own, not one of the extra
    if not wanted:
        sys.exit(f"side_stack: the installed dmltrain declares no '{extra}' extra (pip install -e . first)")
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
                f"side_stack: warning: {', '.join(inside)} installed in the environment itself (an older dev extra?), "
                "so in the GPU machine's bundle too; `make clean-venv setup` starts afresh",
                file=sys.stderr,
            )
        clash = sorted(m for m in missing if canonicalize_name(m.split("==")[0]) in have)
        if clash:
            sys.exit(f"side_stack: {', '.join(clash)} would shadow the environment's own version")
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
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} EXTRA TARGET_DIR")
    names = install(sys.argv[1], Path(sys.argv[2]))
    print(f"side_stack: {len(names)} packages of the {sys.argv[1]} extra in {sys.argv[2]}")
