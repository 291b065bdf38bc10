"""What dmltrain never prints, logs or writes: the userinfo of URLs, and storage options outside an allow-list.

:func:`redact` is the one function every output goes through that can carry a URL or fsspec storage options:
MLflow params and tags (:mod:`dmltrain.tracking.run`), the ``config.yaml`` artifact and ``dmltrain config show``
(:meth:`dmltrain.config.Config.to_yaml`), the config stored in model files (:func:`dmltrain.models.save_model`),
run records (``driver.json``), shard locations in messages (:class:`shards.storage.location.Location` prints
redacted), warnings, tables, and every error line the CLI prints. Two rules:

* the userinfo of a URL (``https://USER:PASSWORD@host/...``, ``postgresql://u:p@db/mlflow``) becomes
  :data:`REDACTED`, wherever the URL stands in the text;
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
    {
        # s3fs / botocore
        "anon", "endpoint_url", "requester_pays", "version_aware", "use_ssl", "default_block_size",
        "default_fill_cache", "default_cache_type", "cache_regions", "profile", "region_name", "max_concurrency",
        "fixed_upload_size", "client_kwargs.region_name", "client_kwargs.endpoint_url", "client_kwargs.verify",
        "client_kwargs.use_ssl", "client_kwargs.api_version", "config_kwargs.*",
        "s3_additional_kwargs.ServerSideEncryption", "s3_additional_kwargs.StorageClass", "s3_additional_kwargs.ACL",
        # gcsfs
        "project", "access", "consistency", "requests_timeout", "default_location", "endpoint",
        # aiohttp's ClientSession (gcsfs's and fsspec http's session_kwargs): named settings, never its headers or auth
        "session_kwargs.trust_env", "session_kwargs.timeout.*", "session_kwargs.read_timeout",
        "session_kwargs.conn_timeout", "session_kwargs.raise_for_status", "session_kwargs.auto_decompress",
        "session_kwargs.read_bufsize", "session_kwargs.max_line_size", "session_kwargs.max_field_size",
        # fsspec's http and common options
        "block_size", "simple_links", "same_scheme", "size_policy", "use_listings_cache", "listings_expiry_time",
        "max_paths", "skip_instance_cache", "timeout", "client_kwargs.timeout.*", "client_kwargs.trust_env",
        # adlfs: the account name is public (it is in every URL of the account)
        "account_name",
    }
)  # fmt: skip
#: gcsfs's ``token`` may name an authentication mode rather than hold a token: these values are kept
TOKEN_MODES = frozenset({"anon", "google_default", "cloud", "browser"})

# scheme://userinfo@ : the userinfo runs to the last "@" before the authority ends (/, ?, # or white space)
_NOT_USERINFO = r"/?#@\s\"<>`{}|\\^"  # characters that end it, or cannot stand in a URL
_USERINFO = re.compile(rf"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]*://)[^{_NOT_USERINFO}]*(?:@[^{_NOT_USERINFO}]*)*@")


def redact_url(text: str) -> str:
    """``text`` with the userinfo of every URL in it replaced: ``https://<redacted>@host/x``."""
    return _USERINFO.sub(lambda m: m.group(1) + REDACTED + "@", text) if "@" in text else text


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
