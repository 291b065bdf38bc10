"""The native kernels load only what this user built in a folder nobody else can write.

A shared object planted where an older version looked (the predictable ``dmltrain-native-<uid>``
folder in the system temp dir), or in a cache folder other users can write, must never be
loaded: each planted library here has a constructor that leaves a marker file when it runs.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dmltrain.evaluate import native

REPO = Path(__file__).resolve().parents[1]
EVIL_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char* mark = getenv("DMLT_PLANTED_MARK");
    FILE* f = mark ? fopen(mark, "w") : NULL;
    if (f) { fputs("ran", f); fclose(f); }
}
"""


def _names() -> list[str]:
    """The file names a planted library would need: today's, and the older source-only tag."""
    old = hashlib.sha256((native._SOURCE + platform.machine() + sys.platform).encode()).hexdigest()[:16]
    return sorted({native._library_name(), f"dmltrain-native-{old}.so"})


@pytest.fixture(scope="module")
def evil_so(tmp_path_factory) -> Path:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}): the native kernels are not built here at all")
    d = tmp_path_factory.mktemp("evil")
    (d / "evil.c").write_text(EVIL_C)
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", str(d / "evil.so"), str(d / "evil.c")], check=True, capture_output=True
    )
    return d / "evil.so"


def _plant(folder: Path, evil: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in _names():
        shutil.copy(evil, folder / name)


def _load_in_child(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    code = (
        "import numpy as np, warnings\n"
        "from dmltrain.evaluate import native, hamming\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    lib = native.library()\n"
        "assert lib is not None, native.unavailable_reason()\n"
        "a = np.random.default_rng(0).integers(0, 256, (3, 32), dtype=np.uint8)\n"
        "b = np.random.default_rng(1).integers(0, 256, (5, 32), dtype=np.uint8)\n"
        "got = hamming.hamming_block(a, b)\n"
        "ref = np.unpackbits(a[:, None, :] ^ b[None, :, :], axis=2).sum(2)\n"
        "assert (np.asarray(got) == ref).all()\n"
        "print('WARN', ' '.join(str(x.message) for x in w))\n"
    )
    full_env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "DMLTRAIN_NATIVE": "1",
        "DMLTRAIN_HAMMING": "native",
        "DMLT_PLANTED_MARK": str(tmp_path / "planted-ran"),
        **env,
    }
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=300)


def test_library_in_the_old_predictable_temp_folder_is_not_loaded(evil_so, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    _plant(tmp / f"dmltrain-native-{os.getuid()}", evil_so)  # where the fallback used to look
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("the cache cannot be created under a file")
    proc = _load_in_child(tmp_path, XDG_CACHE_HOME=str(blocked), TMPDIR=str(tmp))
    assert not (tmp_path / "planted-ran").exists(), "a planted shared object was loaded"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "private temporary folder" in proc.stdout
    leftovers = [
        p.name
        for p in tmp.iterdir()
        if p.name.startswith("dmltrain-native-") and p.name != f"dmltrain-native-{os.getuid()}"
    ]
    assert leftovers == [], "the private build folder is removed once the library is loaded"


def test_library_in_a_cache_folder_others_can_write_is_not_loaded(evil_so, tmp_path):
    cache = tmp_path / "cache"
    folder = cache / "dmltrain" / "native"
    _plant(folder, evil_so)
    os.chmod(folder, 0o777)  # anyone could have put the file there
    proc = _load_in_child(tmp_path, XDG_CACHE_HOME=str(cache), TMPDIR=tempfile.gettempdir())
    assert not (tmp_path / "planted-ran").exists(), "a planted shared object was loaded"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "writable by other users" in proc.stdout


def test_private_cache_is_created_0700_and_reused(tmp_path):
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    cache = tmp_path / "cache"
    proc = _load_in_child(tmp_path, XDG_CACHE_HOME=str(cache))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "WARN", proc.stdout  # no warning: the cache was usable
    for d in (cache / "dmltrain", cache / "dmltrain" / "native"):
        assert (d.stat().st_mode & 0o777) == 0o700, oct(d.stat().st_mode)
    (lib,) = (cache / "dmltrain" / "native").iterdir()
    assert lib.name == native._library_name() and not lib.stat().st_mode & 0o022
    mtime = lib.stat().st_mtime_ns
    assert _load_in_child(tmp_path, XDG_CACHE_HOME=str(cache)).returncode == 0
    assert lib.stat().st_mtime_ns == mtime, "a trusted cached build is reused, not rebuilt"
