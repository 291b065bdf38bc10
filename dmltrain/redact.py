"""What dmltrain never prints, logs or writes: the userinfo of URLs, their query strings' secrets, and storage
options outside an allow-list.

:func:`redact` is the one function every output goes through that can carry a URL or fsspec storage options:
MLflow params and tags (:mod:`dmltrain.tracking.run`), the ``config.yaml`` artifact and ``dmltrain config show``
(:meth:`dmltrain.config.Config.to_yaml`), the config stored in model files (:func:`dmltrain.models.save_model`),
run records (``driver.json``), shard locations in messages (:class:`shards.storage.location.Location` prints
redacted), warnings, tables, and every error line the CLI prints. Three rules:

* the userinfo of a URL (``https://USER:PASSWORD@host/...``, ``postgresql://u:p@db/mlflow``) becomes
  :data:`REDACTED`, wherever the URL stands in the text;
* so does the value of a query-string parameter whose name says it holds a secret (:func:`secret_query_name`:
  a presigned URL's ``X-Amz-Signature``, ``X-Amz-Credential`` and ``X-Amz-Security-Token``, Azure's ``sig``,
  ``token``, ``access_token``, ``api_key``...): ``img.jpg?X-Amz-Expires=60&X-Amz-Signature=<redacted>``. The
  other parameters stay, so the path still says what it is;
* under a ``storage_options`` key (nested, or a dotted MLflow param name), a value is kept only when its key is
  in :data:`SAFE_STORAGE_OPTIONS` (endpoints, region, anonymous access, timeouts...); any other key's value
  becomes :data:`REDACTED`. An allow-list, not a deny-list: a header, an SDK argument or an option this module
  has never heard of is redacted, so a secret under a new name still stays out.

The options themselves are not changed where they are used (fsspec still gets them); what is written is the
redacted copy. A value read back from a written copy (a model file's config) may hold :data:`REDACTED`:
:func:`without_redacted` drops those options before they are used again.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"

#: fsspec storage options (dotted below ``storage_options``) whose values are written as they are: no secret
#: goes there. A key ending in ``.*`` keeps everything below it.
SAFE_STORAGE_OPTIONS = frozenset(
    (
        # s3fs / botocore
        "anon endpoint_url requester_pays version_aware use_ssl default_block_size "
        "default_fill_cache default_cache_type cache_regions profile region_name max_concurrency "
        "fixed_upload_size client_kwargs.region_name client_kwargs.endpoint_url client_kwargs.verify "
        "client_kwargs.use_ssl client_kwargs.api_version config_kwargs.* "
        "s3_additional_kwargs.ServerSideEncryption s3_additional_kwargs.StorageClass s3_additional_kwargs.ACL "
        # gcsfs
        "project access consistency requests_timeout default_location endpoint "
        # aiohttp's ClientSession (gcsfs's and fsspec http's session_kwargs): named settings, never its headers or auth
        "session_kwargs.trust_env session_kwargs.timeout.* session_kwargs.read_timeout "
        "session_kwargs.conn_timeout session_kwargs.raise_for_status session_kwargs.auto_decompress "
        "session_kwargs.read_bufsize session_kwargs.max_line_size session_kwargs.max_field_size "
        # fsspec's http and common options
        "block_size simple_links same_scheme size_policy use_listings_cache listings_expiry_time "
        "max_paths skip_instance_cache timeout client_kwargs.timeout.* client_kwargs.trust_env "
        # adlfs: the account name is public (it is in every URL of the account)
        "account_name"
    ).split()
)
# names that hold credentials, compared lower-cased without "_" and "-": these exact names, or names containing one
# of the parts (aws_secret_access_key, headers.Authorization, sse_customer_key, ...); the storage options'
# check (:func:`shards.storage.location.check_storage_options`) and the query-string rule share them
SECRET_NAMES = frozenset({"key", "auth", "token", "credential", "credentials", "sig", "signature"})
SECRET_PARTS = tuple(
    (
        "secret password passwd credential authorization bearer cookie apikey accesskey "
        "privatekey sessiontoken sastoken accesstoken refreshtoken customerkey accountkey "
        "connectionstring"
    ).split()
)
# in a query string also any name with these in it (X-Amz-Signature, X-Amz-Security-Token, X-Goog-Signature);
# not among the storage options, where botocore's signature_version is a setting
QUERY_SECRET_PARTS = (*SECRET_PARTS, "signature", "token", "authkey", "jwt", "hmac")
# and these exact names, which are short forms of a password in a query string (?pwd=, ?pass=)
QUERY_SECRET_NAMES = frozenset({*SECRET_NAMES, "pw", "pwd", "pass"})

#: gcsfs's ``token`` may name an authentication mode rather than hold a token: these values are kept
TOKEN_MODES = frozenset({"anon", "google_default", "cloud", "browser"})

# scheme://userinfo@ : the userinfo runs to the last "@" before the authority ends (/, ?, # or white space)
_NOT_USERINFO = r"/?#@\s\"<>`{}|\\^"  # characters that end it, or cannot stand in a URL
_USERINFO = re.compile(rf"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]*://)[^{_NOT_USERINFO}]*(?:@[^{_NOT_USERINFO}]*)*@")


# ?name=value or &name=value (or ;): a query parameter, its value running to the next separator, quote or space
_QUERY_PARAM = re.compile(rf"(?<=[?&;])([^=&;#?\s\"'<>`]+)=({re.escape(REDACTED)}|[^&;#\s\"'<>`]*)")


def _name(name: str) -> str:
    return re.sub(r"[-_]", "", name.lower())


def secret_name(name: str) -> bool:
    """Whether an option named ``name`` holds a credential (:data:`SECRET_NAMES`, :data:`SECRET_PARTS`)."""
    key = _name(name)
    return key in SECRET_NAMES or any(part in key for part in SECRET_PARTS)


def secret_query_name(name: str) -> bool:
    """Whether a URL's query parameter ``name`` holds a secret: :func:`secret_name`, a name with ``signature``,
    ``token``, ``authkey``, ``jwt`` or ``hmac`` in it (a presigned URL's ``X-Amz-Signature``,
    ``X-Amz-Security-Token``), or ``pw``, ``pwd`` or ``pass``."""
    key = _name(name)
    return key in QUERY_SECRET_NAMES or any(part in key for part in QUERY_SECRET_PARTS)


def redact_url(text: str) -> str:
    """``text`` with the userinfo of every URL in it replaced (``https://<redacted>@host/x``), and the value of every
    query-string parameter named like a secret (``?X-Amz-Signature=<redacted>``)."""
    if "@" in text:
        text = _USERINFO.sub(lambda m: m.group(1) + REDACTED + "@", text)
    if "=" in text:
        text = _QUERY_PARAM.sub(
            lambda m: f"{m.group(1)}={REDACTED}" if secret_query_name(m.group(1)) else m.group(0), text
        )
    return text


def safe_option(key: str, value: Any = None) -> bool:
    """Whether the storage option ``key`` (dotted below ``storage_options``) may be written as it is."""
    if key in SAFE_STORAGE_OPTIONS or (key == "token" and isinstance(value, str) and value in TOKEN_MODES):
        return True
    parts = key.split(".")
    return any(".".join(parts[:i]) + ".*" in SAFE_STORAGE_OPTIONS for i in range(1, len(parts)))


def redact(value: Any, key: str = "") -> Any:
    """``value`` as it may be printed, logged or written (see the module doc); ``key`` is its dotted name.

    Mappings are copied with every value redacted under its own dotted key (so a nested config and its
    flattened MLflow params are redacted alike); lists and tuples item by item; strings lose URL userinfo;
    anything else is returned as is. Nothing is modified in place.
    """
    parts = key.split(".") if key else []
    if "storage_options" in parts:
        option = ".".join(parts[len(parts) - parts[::-1].index("storage_options") :])
        if option and not isinstance(value, Mapping) and not safe_option(option, value):
            return REDACTED
    if isinstance(value, Mapping):
        return {k: redact(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v, key) for v in value)
    if isinstance(value, str):
        return redact_url(value)
    return value


def redact_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Storage options as they may be written: :func:`redact` under ``storage_options``."""
    return redact(dict(options), "storage_options")


def without_redacted(options: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``options`` read back from a written copy, less the values that were redacted there, and the dotted keys
    dropped (the options to use again, and what the user must give anew)."""
    dropped: list[str] = []

    def walk(d: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        out = {}
        for k, v in d.items():
            name = f"{prefix}{k}"
            if isinstance(v, Mapping):
                out[k] = walk(v, name + ".")
            elif isinstance(v, str) and REDACTED in v:
                dropped.append(name)
            else:
                out[k] = v
        return out

    return walk(options, ""), dropped
