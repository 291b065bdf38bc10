"""What in a file's content looks like a credential: the scan ``dmltrain submit`` runs on every file it would upload.

A file name tells little (a kubeconfig saved as ``configs/kube/config``, MLflow's credentials renamed ``.ini``,
``netrc.txt``), so every uploaded file is read whole, line by line, for the shapes secrets take:

* key material: PEM and OpenSSH private keys, a service-account JSON's ``"private_key"``, kubeconfig's
  ``client-key-data``;
* tokens with a known form: AWS access key ids (``AKIA...``/``ASIA...``), GitHub, Slack, Hugging Face (``hf_...``)
  and Google API keys, ``Bearer`` tokens, the credentials of an ``Authorization`` header (``Basic``, ``Token``,
  ``Digest``, ``ApiKey``...), a password inside a URL (``https://user:PASSWORD@host``), a ``.netrc`` line;
* assignments of a literal to a name that says what it holds (``password``, ``passwd``, ``passphrase``,
  ``secret``, ``token``, ``api_key``, ``access_key``, ``account_key``, ``private_key``, ``credential``,
  ``connection_string``; ``pw`` and ``pwd`` on their own; or ``pass``, ``pwd``, ``pw``, ``auth`` after ``_``/``-``
  or quoted: ``DB_PASS``, ``MYSQL_PWD``, ``DB_PW``, docker's ``"auth"``), in
  ``KEY=VALUE``, ``key: value`` and ``"key": "value"`` forms (``.env``, YAML, INI, JSON, shell); a YAML block
  scalar (``password: |``) is read on its next line.

False positives are kept low where the project itself would trip them: in source code (``.py`` and the like)
only a quoted literal counts (``token = args.token`` is code, ``token = "ab12..."`` is a secret), and
references and placeholders never do, quoted or not: ``${VAR}``, ``$VAR``, ``$(cmd)``, ``%(name)s``,
``{{ secret }}``, a whole ``<your-token>`` or ``[expression]``, a format's field (``%s``, ``{}``), a path
(``~/.aws/credentials``, ``/run/secrets/x``), ``changeme``, ``null``, a type name; nor, unquoted, a mapping or
a list (``{type: env}``), or in a YAML file an alias or a tag (``*pw``, ``!Ref DbPassword``). Anything else is
a literal, whatever character it starts with (``DB_PASSWORD=!Xk9...``), and ``#`` ends an unquoted value only
after white space (``ab#cd`` is one value, as ``.env`` files and YAML read it). A binary file is searched for
the key shapes only.

:func:`find_secret` returns the first finding with its line and a description that never quotes the secret.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

YAML_SUFFIXES = frozenset({".yaml", ".yml"})
# files whose unquoted right-hand sides are code, not literals
CODE_SUFFIXES = frozenset(
    (".py .pyi .pyx .ipynb .js .ts .go .rs .java .scala .kt .c .h .cc .cpp .hpp .cu .cuh .rb .jl .r").split()
)
# right-hand sides that say nothing (types, booleans, placeholders)
PLACEHOLDERS = frozenset(
    (
        "none null nil true false yes no required optional changeme change-me "
        "example placeholder redacted <redacted> secret password token string str bytes "
        "int bool dict list any env environ default empty unset mask masked "
        "anon google_default cloud browser"
    ).split()
)
_SHAPES = (
    (re.compile(rb"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----"), "a private key"),
    (re.compile(rb"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), "an AWS access key id"),
    (re.compile(rb"\bgh[pousr]_[A-Za-z0-9]{36,}|\bgithub_pat_[A-Za-z0-9_]{22,}"), "a GitHub token"),
    (re.compile(rb"\bxox[abprs]-[A-Za-z0-9-]{10,}"), "a Slack token"),
    (re.compile(rb"\bAIza[0-9A-Za-z_-]{35}\b"), "a Google API key"),
    (re.compile(rb"\bhf_[A-Za-z0-9]{30,}\b"), "a Hugging Face token"),
    (re.compile(rb'"private_key"\s*:\s*"[^"]'), 'a service-account key ("private_key")'),
    (re.compile(rb"\bclient-key-data\s*:\s*[A-Za-z0-9+/=]{16,}"), "a kubeconfig client key (client-key-data)"),
)
_BEARER = re.compile(r"\bbearer\s+[A-Za-z0-9._~+/=-]{16,}", re.IGNORECASE)
# an Authorization header's scheme and credentials (Basic, a token scheme, an API key, a signature)
_AUTH_HEADER = re.compile(
    r"\bauthorization[\"']?\s*[:=]\s*[\"']?(?P<scheme>basic|token|digest|api-?key|key|sharedkey|hmac|"
    r"aws4-hmac-sha256|negotiate|ntlm|sso-key|bot|otp)\s+(?P<value>[A-Za-z0-9+/=._~:,-]{8,})",
    re.IGNORECASE,
)
# a .netrc entry on one line (machine HOST login USER password PASS), or its password on a line of its own
_NETRC = re.compile(r"\bmachine\s+\S+\s.*\bpassword\s+(?P<value>\S+)|^\s*password\s+(?P<alone>\S+)\s*$", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s:@\"'<>]*:(?P<value>[^/?#\s@\"'<>]+)@")
_ASSIGNMENT = re.compile(
    r"""(?P<key>(?:[A-Za-z0-9_.-]*(?:password|passwd|passphrase|secret|token|api[_-]?key|access[_-]?key"""
    r"""|account[_-]?key|private[_-]?key|credentials?|connection[_-]?string)[A-Za-z0-9_.-]*"""
    r"""|[A-Za-z0-9_.-]*[A-Za-z0-9][_-](?:pass|pwd|pw|auth)(?![A-Za-z0-9_.-])"""
    r"""|(?<![A-Za-z0-9_.$-])(?:pw|pwd)(?![A-Za-z0-9_.-])|(?<=["'])(?:pass|pwd|pw|auth)(?=["'])))"""
    r"""["']?\s*(?<![=!<>:])(?:=|:)(?!=)\s*(?P<value>.*)""",
    re.IGNORECASE,
)
# what a value refers to rather than holds, quoted or not: ${VAR}, $(cmd), {{ tpl }}, %(x)s, $VAR, %VAR%, a whole
# <token> or [expression], a format's field (%s, {}, {self.password})
_REFERENCE = re.compile(
    r"\$\{|\$\(|\{\{|%\(\w|%[-#0 +]*\d*(?:\.\d+)?[sd](?![A-Za-z0-9])|^\$[A-Za-z_]\w*$|^%\w+%$|^<[^<>]+>$"
    r"|^\[[^\[\]]+\]$|^\{[^{}\s]*\}$"
)
# a path: ~/x, ./x, ../x, or an absolute one of two parts or more (/run/secrets/x)
_PATH = re.compile(r"^(?:(?:~|\.\.?)/\S*|/[^/\s]+(?:/[^/\s]*)+)$")
# unquoted, what is no scalar: a mapping or list ({type: env}, [a, b]), and in YAML an alias (*pw) or a tag (!Ref X)
_STRUCTURE = re.compile(r"^[{\[(]")
_YAML_REFERENCE = re.compile(r"^(?:\*[\w.-]+$|!!?[A-Za-z][\w.-]*\s+\S)")
_YAML_ANCHOR = re.compile(r"^&[\w.-]+\s+")  # &pw VALUE: the value follows
_BLOCK_SCALAR = re.compile(r"^[|>][-+0-9]*$")  # password: |  (the value on the next line)
_COMMENT = re.compile(r"^\s*(?:#|//|;|--|\*)|\s#\s")  # a comment line, or a trailing comment
TEXT_PROBE = 8192  # a NUL byte among the first bytes: a binary file


@dataclass(frozen=True)
class Finding:
    """What looks like a credential, and where: ``line`` is 1-based; ``what`` never quotes the secret."""

    line: int
    what: str


def _value(text: str, yaml: bool = False) -> tuple[str | None, bool]:
    """The literal at the start of ``text`` and whether it was quoted (and the quote closed on the line); None when
    the unquoted text is no scalar (a mapping or list; in YAML an alias or a tag)."""
    text = text.strip()
    if yaml:
        text = _YAML_ANCHOR.sub("", text)
    if text[:1] in ("'", '"'):
        end = text.find(text[0], 1)
        return (text[1:end], True) if end > 0 else (text[1:], False)  # unclosed: the key was inside a string
    if _STRUCTURE.match(text) or (yaml and _YAML_REFERENCE.match(text)):
        return None, False
    return re.split(r"[\s,;})\]`]", text, maxsplit=1)[0], False


def _literal(value: str | None) -> bool:
    """Whether ``value`` reads as a secret rather than a reference, a path, a placeholder or nothing."""
    v = (value or "").strip()
    if len(v) < 4 or v.lower() in PLACEHOLDERS or _REFERENCE.search(v) or _PATH.match(v) or len(set(v)) == 1:
        return False
    return not re.fullmatch(r"[.…_*x-]+", v, re.IGNORECASE)  # "...", "xxxx", "****"


def _line_finding(line: str, code: bool, yaml: bool = False, following: str = "") -> str | None:
    """What on ``line`` looks like a secret; ``following``: the next line (a YAML block scalar's value)."""
    if _BEARER.search(line):
        return "a bearer token"
    m = _AUTH_HEADER.search(line)
    # a token has a digit (prose such as "Authorization: Token headers" has none); Basic's base64 may not
    if (
        m
        and _literal(m.group("value"))
        and (m.group("scheme").lower() == "basic" or re.search(r"\d", m.group("value")))
    ):
        scheme = m.group("scheme")
        if scheme.lower() == "basic":
            return "basic-auth credentials (Authorization: Basic)"
        return f"credentials in an Authorization header (Authorization: {scheme.title()})"
    m = _URL_PASSWORD.search(line)
    if m and _literal(m.group("value")):
        return "a password in a URL"
    if not code:
        m = _NETRC.search(line)
        if m and _literal(m.group("value") or m.group("alone")):
            return "a .netrc password"
    comment = _COMMENT.search(line)
    for m in _ASSIGNMENT.finditer(line):
        if comment is not None and comment.start() <= m.start():
            continue  # prose in a comment ("# from the secret: kubectl get secret ...")
        value, quoted = _value(m.group("value"), yaml)
        if not code and not quoted and value is not None and _BLOCK_SCALAR.match(value):
            value = following.strip()  # password: |  then the value, indented, on the next line
        if (quoted or not code) and _literal(value):
            return f"a value assigned to {m.group('key')!r}"
    return None


def find_secret(path: Path, data: bytes | None = None) -> Finding | None:
    """The first thing in the file at ``path`` (or in ``data``, its bytes) that looks like a credential, or None."""
    if data is None:
        data = path.read_bytes()
    line_of = lambda pos: data.count(b"\n", 0, pos) + 1  # noqa: E731 — used twice below
    for pattern, what in _SHAPES:
        m = pattern.search(data)
        if m:
            return Finding(line_of(m.start()), what)
    if b"\0" in data[:TEXT_PROBE]:
        return None
    code, yaml = path.suffix.lower() in CODE_SUFFIXES, path.suffix.lower() in YAML_SUFFIXES
    lines = data.decode("utf-8", errors="replace").splitlines()
    for n, line in enumerate(lines, 1):
        what = _line_finding(line, code, yaml, lines[n] if n < len(lines) else "")
        if what:
            return Finding(n, what)
    return None
