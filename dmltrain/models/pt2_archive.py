"""What a ``.pt2`` file (a ``torch.export`` archive) must be before ``torch.export.load`` reads it.

``torch.export.load`` (torch 2.14) is not safe on a file someone else wrote; each of these runs code of the file's
author (``torch/export/pt2_archive/_package.py``, ``torch/_export/serde/serialize.py``, ``torch/export/_unlift.py``):

* a weight or tensor constant whose payload config says ``use_pickle: true`` is read with
  ``torch.load(weights_only=False)``; a constant stored as ``custom_obj_N`` goes through TorchScript's unpickler
  (``torch._C._pickle_load_obj``), one stored as ``opaque_obj_N`` through ``pickle.loads``;
* the legacy single-file weights and constants (``data/weights/<model>.pt``, ``data/constants/<model>.pt``), the
  sample inputs (``data/sample_inputs/<model>.pt``) and, when the archive cannot be read as one, the older zip
  layout are read with ``torch.load(weights_only=True)`` and, when that fails, ``weights_only=False``;
* AOTInductor entries (``data/aotinductor/``) are compiled shared libraries, loaded into the process;
* the program's JSON is code in four places: every ``expr_str`` goes through ``sympy.sympify`` (Python's
  ``eval``); ``guards_code`` strings are ``exec``-uted by ``.module()``; a node's ``target`` is looked up as any
  attribute path below ``torch``, ``math`` or ``_operator`` (``torch.os.system`` included) and called when the
  module runs; names (inputs, parameters) are pasted into the Python source FX generates and ``exec``-utes;
* a zero-byte weight record is created as ``torch.zeros(declared sizes)`` (memory of any size).

:func:`check_pt2` therefore accepts an archive only in the form ``torch.export.save`` gives a dmltrain model, and
refuses anything else in one line naming the file and the entry, before torch reads it. It reads the records
through torch's own reader and refuses a file that :mod:`zipfile` reads otherwise (two archives in one file, each
reader finding another: a check of one and a load of the other). It accepts: only the entries that
form writes (stored, not compressed; one model, ``model``), every payload a plain tensor record (no
``use_pickle``, no ``custom_obj_``/``opaque_obj_``), sample inputs that load weights-only, no ``guards_code``,
tensor inputs only, node targets that resolve to ATen operator overloads (other than ``aten.from_file`` and
``aten.save``) or torch's symbolic-shape operators, symbolic expressions of a small arithmetic grammar over named
sympy functions (no ``Float`` precision: torch prints every expression it parses, and printing
``Float(1, 3000000)`` held ``torch.export.load`` for two minutes), and every other string a plain dotted name.
"""

from __future__ import annotations

import io
import json
import os
import re
import tokenize
import zipfile
from pathlib import Path
from typing import Any

from dmltrain.errors import UserError
from dmltrain.text import printable

MODEL = "model"  # torch.export.save's one program; torch.export.load returns exactly this one
ENTRIES = (
    re.compile(r"archive_format"),
    re.compile(r"archive_version"),
    re.compile(r"byteorder"),
    re.compile(r"\.data/version"),
    re.compile(r"\.data/serialization_id"),
    re.compile(rf"models/{MODEL}\.json"),
    re.compile(rf"data/weights/{MODEL}_weights_config\.json"),
    re.compile(r"data/weights/weight_[0-9]+"),
    re.compile(rf"data/constants/{MODEL}_constants_config\.json"),
    re.compile(r"data/constants/tensor_[0-9]+"),
    re.compile(rf"data/sample_inputs/{MODEL}\.pt"),
    re.compile(r"extra/[A-Za-z0-9_.\-]+"),
)
PAYLOADS = {"weights": re.compile(r"weight_[0-9]+"), "constants": re.compile(r"tensor_[0-9]+")}
JSON_BYTES = 256 << 20  # the program's JSON: a few MB for a ViT-L

NAME = re.compile(r"[A-Za-z0-9_.]*")  # every string that can reach generated code: a dotted name
# strings that reach no code: metadata (stack traces, module paths), tree specs (parsed as JSON, their types
# looked up in torch's registry), string arguments (written into FX's code by repr) and torch's version
FREE_TEXT = {"metadata", "stack_trace", "in_spec", "out_spec", "as_string", "as_strings", "torch_version"}
FILE_OPS = {"from_file", "save"}  # ATen operators that open a path
SYM_OPS = {  # torch._export.serde.serialize._SYM_OPS as serialized, and getitem
    *(f"_operator.{n}" for n in ("add and_ eq floordiv ge gt le lshift lt mod mul ne neg or_ pos rshift sub").split()),
    *(f"_operator.{n}" for n in ("truediv", "getitem")),
    "math.trunc",
    *(f"torch.{n}" for n in ("_sym_sqrt", "sym_float", "sym_int", "sym_ite", "sym_max", "sym_min", "sym_not")),
}
ATEN_TARGET = re.compile(r"torch\.ops\.aten\.([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)")
INPUT_KINDS = {"user_input", "parameter", "buffer", "tensor_constant"}

# symbolic shapes: sympy classes and torch's sympy functions, never Pow (10**10**9 would be computed)
EXPR_NAMES = {
    *"Symbol Integer Float Rational Add Mul Max Min Abs Mod floor ceiling Piecewise ExprCondPair".split(),
    *"Eq Ne Lt Le Gt Ge Equality Unequality StrictLessThan StrictGreaterThan LessThan GreaterThan".split(),
    *"And Or Not true false True False None oo zoo nan Infinity NegativeInfinity".split(),
    *"FloorDiv ModularIndexing Where PythonMod CleanDiv CeilToInt FloorToInt CeilDiv LShift RShift".split(),
    *"FloatTrueDiv IntTrueDiv IsNonOverlappingAndDenseIndicator TruncToFloat TruncToInt RoundToInt".split(),
    *"RoundDecimal ToFloat Identity".split(),
}
EXPR_OPS = {"(", ")", ",", "=", "+", "-", "*", "/", "//", "%", "<", ">", "<=", ">=", "==", "!=", "&", "|", "~"}
SYMBOL = re.compile(r"[a-z]{1,3}[0-9]+")  # s0, u3, zf1, zuf2, ps4: torch's symbol names
EXPR_CHARS = 2000


def check_pt2(path: str | os.PathLike[str]) -> None:
    """Refuse ``path`` in one :class:`UserError` naming it and the entry unless it is an archive of the form the
    module doc describes. Every record is read through torch's own archive reader (``PyTorchFileReader``, what
    ``torch.export.load`` reads with), and :mod:`zipfile`'s view of the same file must agree with it entry by
    entry: a file holding two archives (bytes before the one :mod:`zipfile` finds, which it skips and torch's
    reader does not) would otherwise be checked as one and loaded as the other. Sample inputs are loaded
    weights-only; nothing else is unpickled."""
    import torch

    path = Path(path)

    def refuse(entry: str, what: str) -> UserError:
        return UserError(
            f"{path}: refused: {printable(entry, 120)}: {what} (a .pt2 file is loaded only as dmltrain export "
            "writes it: torch.export.load would run code of whoever wrote this)"
        )

    try:
        archive = zipfile.ZipFile(path)
        reader = torch._C.PyTorchFileReader(str(path))
        names = set(reader.get_all_records())
    except (OSError, RuntimeError, zipfile.BadZipFile) as e:
        raise UserError(f"{path}: not a readable .pt2 archive ({printable(e, 160)})") from None
    with archive:
        infos = archive.infolist()
        roots = {i.filename.split("/", 1)[0] for i in infos}
        if len(roots) != 1 or not NAME.fullmatch(next(iter(roots))):
            raise refuse("/", "not one folder of entries")
        root = next(iter(roots)) + "/"
        records: dict[str, zipfile.ZipInfo] = {}
        for info in infos:
            name = info.filename[len(root) :]
            if name in records:
                raise refuse(info.filename, "a second entry of that name")
            if not any(p.fullmatch(name) for p in ENTRIES):
                raise refuse(info.filename, "an entry torch.export.save does not write (pickled, compiled or legacy)")
            if info.compress_type != zipfile.ZIP_STORED:
                raise refuse(info.filename, "a compressed entry (torch.export.save stores them)")
            records[name] = info
        if names != set(records):
            extra = sorted(names ^ set(records))[0]
            raise refuse(root + extra, "torch's reader and zipfile read different archives from this file")
        for name, info in records.items():
            if reader.get_record_header_offset(name) != info.header_offset:
                raise refuse(root + name, "torch's reader finds it elsewhere than zipfile (bytes before the archive)")

    def read(name: str) -> bytes:
        if name not in records:
            raise refuse(root + name, "missing")
        try:
            return reader.get_record(name)
        except RuntimeError as e:  # a damaged record (its CRC): torch would fail on it too
            raise refuse(root + name, f"unreadable ({printable(e, 80)})") from None

    def load_json(name: str) -> Any:
        if name in records and records[name].file_size > JSON_BYTES:
            raise refuse(root + name, f"{records[name].file_size} bytes of JSON")
        try:
            return json.loads(read(name))
        except (ValueError, UnicodeDecodeError) as e:
            raise refuse(root + name, f"not JSON ({printable(e, 120)})") from None

    if read("archive_format").strip() != b"pt2":
        raise refuse(root + "archive_format", "not a pt2 archive")
    for kind, pattern in PAYLOADS.items():
        _check_payloads(load_json(f"data/{kind}/{MODEL}_{kind}_config.json"), kind, pattern, records, root, refuse)
    _check_sample_inputs(read(f"data/sample_inputs/{MODEL}.pt"), root + f"data/sample_inputs/{MODEL}.pt", refuse)
    program = load_json(f"models/{MODEL}.json")
    if not isinstance(program, dict):
        raise refuse(root + f"models/{MODEL}.json", "not a JSON object")
    _check_program(program, root + f"models/{MODEL}.json", refuse)


def _check_payloads(config: Any, kind: str, pattern: re.Pattern[str], records: dict, root: str, refuse: Any) -> None:
    """Weights and constants: plain tensor records of the archive, no pickle, no object."""
    where = f"{root}data/{kind}/{MODEL}_{kind}_config.json"
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        raise refuse(where, "no 'config' object")
    for fqn, meta in entries.items():
        if not NAME.fullmatch(fqn) or not isinstance(meta, dict):
            raise refuse(where, f"entry {fqn!r} is not a name with a payload")
        name, tensor = meta.get("path_name"), meta.get("tensor_meta")
        if meta.get("use_pickle") is not False:
            raise refuse(where, f"{fqn} is pickled (use_pickle)")
        if not isinstance(name, str) or not pattern.fullmatch(name):
            raise refuse(where, f"{fqn} is stored as {str(name)[:60]!r}, not a tensor record (custom or opaque object)")
        record = records.get(f"data/{kind}/{name}")
        if record is None:
            raise refuse(where, f"{fqn}'s record {name} is missing")
        sizes = tensor.get("sizes") if isinstance(tensor, dict) else None
        if not isinstance(sizes, list) or not all(isinstance(s, dict) and type(s.get("as_int")) is int for s in sizes):
            raise refuse(where, f"{fqn} has no concrete sizes")
        numel = 1
        for s in sizes:
            numel *= s["as_int"]
        if record.file_size == 0 and numel != 0:
            raise refuse(where, f"{fqn} declares {numel} elements in an empty record")


def _check_sample_inputs(data: bytes, where: str, refuse: Any) -> None:
    """The sample inputs load weights-only (torch falls back to full unpickling when they do not)."""
    import torch

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as inner:
            if any(i.compress_type != zipfile.ZIP_STORED for i in inner.infolist()):
                raise refuse(where, "compressed records")
        torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 — any failure means torch would unpickle it in full
        raise refuse(where, f"not loadable weights-only ({type(e).__name__})") from None


def _check_program(program: dict[str, Any], where: str, refuse: Any) -> None:
    if program.get("guards_code"):
        raise refuse(where, "guards_code (Python that .module() executes)")
    graph_module = program.get("graph_module")
    signature = graph_module.get("signature") if isinstance(graph_module, dict) else None
    specs = signature.get("input_specs") if isinstance(signature, dict) else None
    if not isinstance(specs, list):
        raise refuse(where, "no graph_module.signature.input_specs")
    for spec in specs:
        kind = next(iter(spec), None) if isinstance(spec, dict) and len(spec) == 1 else None
        if kind not in INPUT_KINDS:
            raise refuse(where, f"an input of kind {str(kind)[:40]!r} (tensors, parameters and buffers only)")
        if kind == "user_input" and "as_tensor" not in (spec[kind].get("arg") or {}):
            raise refuse(where, "a user input that is not a tensor")
    _walk(program, (), where, refuse)


def _walk(node: Any, path: tuple[str, ...], where: str, refuse: Any) -> None:
    """Every string of the program: a dotted name, an allowed target, a checked expression, or free text."""
    key = path[-1] if path else ""
    if isinstance(node, dict):
        if isinstance(node.get("target"), str) and "inputs" in node:
            _check_target(node["target"], where, refuse)
        for k, v in node.items():
            if not isinstance(k, str) or not NAME.fullmatch(k):
                raise refuse(where, f"key {str(k)[:60]!r} under {'.'.join(path[-3:])} is not a name")
            if k in FREE_TEXT:
                continue
            _walk(v, (*path, k), where, refuse)
    elif isinstance(node, list):
        for v in node:
            _walk(v, path, where, refuse)
    elif isinstance(node, str):
        if key == "expr_str":
            _check_expr(node, where, refuse)
        elif key == "as_operator":
            _check_target(node, where, refuse)
        elif not NAME.fullmatch(node):
            raise refuse(where, f"{'.'.join(path[-3:])} = {node[:60]!r} is not a name")


def _check_target(target: str, where: str, refuse: Any) -> None:
    """An ATen operator overload (resolved: ``torch.ops.aten.__class__.__class__`` matches the pattern and is
    ``type``), not one that opens a path, or one of torch's symbolic-shape operators."""
    if target in SYM_OPS:
        return
    m = ATEN_TARGET.fullmatch(target)
    if m is None or m.group(1) in FILE_OPS or not _is_aten_overload(m.group(1), m.group(2)):
        raise refuse(where, f"node target {target[:80]!r} (ATen operators only)")


def _is_aten_overload(op: str, overload: str) -> bool:
    import torch

    if op.startswith("__") or overload.startswith("__"):  # Python's own attributes, never an operator
        return False
    try:
        return isinstance(getattr(getattr(torch.ops.aten, op), overload), torch._ops.OpOverload)
    except (AttributeError, RuntimeError):
        return False


def _arguments(tokens: list[tokenize.TokenInfo], open_at: int) -> int:
    """How many arguments the call whose ``(`` is ``tokens[open_at]`` has (its top-level commas, plus one)."""
    depth, commas = 0, 0
    for t in tokens[open_at:]:
        if t.string == "(":
            depth += 1
        elif t.string == ")":
            depth -= 1
            if depth == 0:
                break
        elif t.string == "," and depth == 1:
            commas += 1
    return commas + 1


def _check_expr(expr: str, where: str, refuse: Any) -> None:
    """A symbolic shape that ``sympy.sympify`` may evaluate: names of :data:`EXPR_NAMES` (or symbols, or keyword
    names), numbers, quoted symbol names and arithmetic; no attribute, subscript, string or other name."""

    def bad(why: str) -> UserError:
        return refuse(where, f"expression {expr[:80]!r}: {why}")

    if len(expr) > EXPR_CHARS:
        raise bad(f"longer than {EXPR_CHARS} characters")
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(expr).readline) if t.string.strip()]
    except (tokenize.TokenError, SyntaxError, IndentationError):
        raise bad("not an expression") from None
    for i, t in enumerate(tokens):
        after = tokens[i + 1].string if i + 1 < len(tokens) else ""
        if t.type == tokenize.NAME:
            keyword = after == "=" and t.string.isidentifier() and not t.string.startswith("_")
            if not (t.string in EXPR_NAMES or SYMBOL.fullmatch(t.string) or keyword):
                raise bad(f"the name {t.string[:40]!r}")
            if t.string == "Float" and after == "(" and _arguments(tokens, i + 1) != 1:
                # Float(1, 3000000): its second argument is a precision, and torch prints every expression it
                # parses (printing at 3,000,000 digits held torch.export.load for two minutes)
                raise bad("Float with a precision")
        elif t.type == tokenize.NUMBER:
            if len(t.string) > 40:
                raise bad("a number of more than 40 characters")
        elif t.type == tokenize.STRING:
            if not (len(t.string) >= 3 and t.string[0] == t.string[-1] in "'\"" and SYMBOL.fullmatch(t.string[1:-1])):
                raise bad(f"the string {t.string[:40]}")
        elif t.type == tokenize.OP:
            if t.string not in EXPR_OPS:
                raise bad(f"the operator {t.string!r}")
        elif t.type not in (tokenize.NEWLINE, tokenize.ENDMARKER):
            raise bad(f"the token {t.string[:40]!r}")
