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
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

EXTRA = "test-s3"
REPO = Path(__file__).resolve().parents[1]


def _pip(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "pip", *args], check=True, stdout=subprocess.PIPE, text=True).stdout


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def install(target: Path) -> list[str]:
    """Replace ``target`` with the extra's packages that this interpreter's environment lacks; their names."""
    wanted = [r.split(";")[0].strip() for r in importlib.metadata.requires("dmltrain") or []
              if re.search(rf"extra\s*==\s*['\"]{EXTRA}['\"]", r)]
    if not wanted:
        sys.exit(f"s3_stack: the installed dmltrain declares no '{EXTRA}' extra (pip install -e . first)")
    target = target.absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        pinned = [line for line in _pip("freeze", "--exclude-editable").splitlines() if "==" in line]
        (work / "have.txt").write_text("\n".join(pinned) + "\n")
        # a dry run against the environment: what it would have to add, given that nothing it has may change
        _pip("install", "-q", "--dry-run", "--report", str(work / "plan.json"), "-c", str(REPO / "constraints.txt"),
             "-c", str(work / "have.txt"), *wanted)
        plan = json.loads((work / "plan.json").read_text())["install"]
        missing = [f"{p['metadata']['name']}=={p['metadata']['version']}" for p in plan]
        have = {_key(d.metadata["Name"]) for d in importlib.metadata.distributions()}
        inside = sorted(n for n in (_key(re.split(r"[\[<>=!~ ]", w)[0]) for w in wanted) if n in have)
        if inside:
            print(f"s3_stack: warning: {', '.join(inside)} installed in the environment itself (an older dev extra?), "
                  "so in the GPU machine's bundle too; `make clean-venv setup` starts afresh", file=sys.stderr)
        clash = sorted(m for m in missing if _key(m.split("==")[0]) in have)
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
