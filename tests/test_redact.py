"""Secrets in URLs and storage options (:mod:`dmltrain.redact`): refused where they are plainly credentials, and
redacted in everything printed, logged or written (``config show``, model files, run records, manifest summaries,
tables, summaries and error lines; MLflow params, tags and artifacts are checked in ``test_tracking.py``, against
its SQLite store).

Every test plants a secret and then searches what came out for it, so a path that forgets to redact fails.
"""

from __future__ import annotations

import json

import pytest
import torch

from dmltrain.cli import main
from dmltrain.config import load_config
from dmltrain.redact import REDACTED, redact, redact_url, without_redacted
from dmltrain.text import cell, csv_text, markdown_table, one_line

PASSWORD = "hunter2-PASSWORD"
SECRET = "s3cr3t-VALUE"
LEAKS = (PASSWORD, SECRET)
# a secret in the shards URL, the tracking URI, and an option under a name no deny-list knows
OVERRIDES = [
    f"data.shards=https://reader:{PASSWORD}@files.example/shards",
    f"data.storage_options.headers.X-Custom-Header={SECRET}",
    "data.storage_options.anon=true",
    "data.storage_options.client_kwargs.region_name=eu-west-1",
    "data.storage_options.endpoint_url=http://minio.example:9000",
]


def _clean(text: str) -> bool:
    return not any(s in text for s in LEAKS)


def test_urls_lose_their_userinfo_and_options_outside_the_allow_list_their_values():
    assert redact_url(f"https://user:{PASSWORD}@host/shards") == "https://<redacted>@host/shards"
    assert redact_url(f"see http://KEY:{SECRET}@minio:9000/x, then") == "see http://<redacted>@minio:9000/x, then"
    assert redact_url("postgresql://u:p@ss@db/mlflow?x=@") == "postgresql://<redacted>@db/mlflow?x=@"
    for same in ("s3://bucket/key@v2", "sqlite:////tmp/mlflow.db", "me@example.com", '"http://x","me@y"'):
        assert redact_url(same) == same
    tree = {"data": {"shards": f"https://u:{PASSWORD}@h/s", "storage_options": {"anon": True, "token": "anon"}}}
    tree["data"]["storage_options"]["headers"] = {"Authorization": SECRET, "User-Agent": "x"}
    tree["data"]["storage_options"]["config_kwargs"] = {"s3": {"addressing_style": "path"}}
    out = redact(tree)
    opts = out["data"]["storage_options"]
    assert opts["headers"] == {"Authorization": REDACTED, "User-Agent": REDACTED}
    assert (
        opts["anon"] is True and opts["token"] == "anon" and opts["config_kwargs"]["s3"]["addressing_style"] == "path"
    )
    assert out["data"]["shards"] == "https://<redacted>@h/s" and tree["data"]["shards"].count(PASSWORD) == 1
    # the flattened MLflow params are redacted alike, key by dotted key
    flat = redact({"data.storage_options.headers.Authorization": SECRET, "data.storage_options.anon": True})
    assert flat == {"data.storage_options.headers.Authorization": REDACTED, "data.storage_options.anon": True}
    assert without_redacted(opts) == (
        {"anon": True, "token": "anon", "headers": {}, "config_kwargs": {"s3": {"addressing_style": "path"}}},
        ["headers.Authorization", "headers.User-Agent"],
    )


def test_a_query_strings_secrets_are_redacted_and_its_other_parameters_kept():
    """A presigned URL's signature, credential and session token, Azure's SAS signature, a token or key: their values
    go, the rest of the URL stays (what it names, when it expires); applied twice it changes nothing more."""
    url = (
        "https://b.s3.amazonaws.com/a/img.jpg?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA%2F20260101"
        f"&X-Amz-Date=20260101T000000Z&X-Amz-Expires=600&X-Amz-Security-Token={SECRET}&X-Amz-Signature={SECRET}"
    )
    want = (
        "https://b.s3.amazonaws.com/a/img.jpg?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=<redacted>"
        "&X-Amz-Date=20260101T000000Z&X-Amz-Expires=600&X-Amz-Security-Token=<redacted>&X-Amz-Signature=<redacted>"
    )
    assert redact_url(url) == want and redact_url(want) == want
    assert redact_url(f"'https://acct.blob.core.windows.net/c/x.jpg?sv=2024&se=2026&sig={SECRET}' failed") == (
        "'https://acct.blob.core.windows.net/c/x.jpg?sv=2024&se=2026&sig=<redacted>' failed"
    )
    assert redact_url(f"https://u:{PASSWORD}@h/x?access_token={SECRET};api_key={SECRET}#f") == (
        "https://<redacted>@h/x?access_token=<redacted>;api_key=<redacted>#f"
    )
    for name in ("pwd", "pass", "auth_key", "jwt", "hmac", "Signature"):  # short and CDN forms (CloudFront's too)
        assert redact_url(f"https://h/x.jpg?{name}={SECRET}&w=2") == f"https://h/x.jpg?{name}=<redacted>&w=2", name
    for same in ("https://h/x?page=2&size=10", "a?b=c", "--storage-option token=anon", "x.jpg?version=3"):
        assert redact_url(same) == same


def test_an_aiohttp_sessions_headers_are_redacted_and_its_harmless_settings_kept(capsys):
    """gcsfs's and fsspec-http's ``session_kwargs`` go to aiohttp's ClientSession, headers included: only named
    harmless settings keep their values, nested and flattened alike, in ``config show`` too."""
    opts = {
        "session_kwargs": {
            "headers": {"X-Auth-Token": SECRET, "PRIVATE-TOKEN": PASSWORD},
            "auth": SECRET,
            "trust_env": True,
            "timeout": {"total": 30},
        }
    }
    out = redact(opts, "storage_options")["session_kwargs"]
    assert out["headers"] == {"X-Auth-Token": REDACTED, "PRIVATE-TOKEN": REDACTED} and out["auth"] == REDACTED
    assert out["trust_env"] is True and out["timeout"] == {"total": 30}
    flat = {"data.storage_options.session_kwargs.headers.X-Auth-Token": SECRET}
    assert redact(flat) == {"data.storage_options.session_kwargs.headers.X-Auth-Token": REDACTED}
    assert (
        main(
            [
                "config",
                "show",
                f"data.storage_options.session_kwargs.headers.X-Auth-Token={SECRET}",
                f"data.storage_options.session_kwargs.headers.PRIVATE-TOKEN={PASSWORD}",
                "data.storage_options.session_kwargs.trust_env=true",
            ]
        )
        == 0
    )
    shown = capsys.readouterr().out
    assert _clean(shown) and "X-Auth-Token: <redacted>" in shown and "trust_env: true" in shown


@pytest.mark.parametrize(
    "override, key",
    [
        (f"data.storage_options.headers.Authorization=Bearer {SECRET}", "headers.Authorization"),
        (f"data.storage_options.s3_additional_kwargs.SSECustomerKey={SECRET}", "SSECustomerKey"),
        (f"data.storage_options.credential={SECRET}", "storage_options.credential"),
        (f"data.storage_options.endpoint_url=http://AKIAKEY:{SECRET}@minio:9000", "endpoint_url"),
        (f"data.storage_options.client_kwargs.aws_secret_access_key={SECRET}", "aws_secret_access_key"),
    ],
)
def test_plain_credentials_in_storage_options_are_refused_in_one_line(capsys, override, key):
    assert main(["config", "show", override]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and key in err and "do not belong in storage options" in err and _clean(err), err


def test_config_show_and_the_model_file_hold_no_secret(tmp_path, capsys):
    from dmltrain.models import build_model, load_model, save_model

    assert main(["config", "show", *OVERRIDES]) == 0
    shown = capsys.readouterr().out
    assert _clean(shown) and "https://<redacted>@files.example/shards" in shown
    assert "X-Custom-Header: <redacted>" in shown and "region_name: eu-west-1" in shown
    cfg = load_config(None, [*OVERRIDES, "model.backbone=small_cnn", "model.embedding_dim=64"])
    assert PASSWORD in cfg.to_dict()["data"]["shards"]  # what runs keeps it; what is written does not
    model = build_model(cfg.model, load_pretrained=False)
    save_model(tmp_path / "model.pt", model, cfg.to_dict())
    raw = torch.load(tmp_path / "model.pt", weights_only=True)
    assert _clean(json.dumps(raw["config"])) and raw["config"]["data"]["storage_options"]["anon"] is True
    assert (
        load_model(tmp_path / "model.pt")[1]["data"]["storage_options"]["endpoint_url"] == "http://minio.example:9000"
    )


def test_run_records_summaries_tables_and_error_lines_are_redacted(tmp_path, capsys):
    from cluster.launch import TrainSummary
    from cluster.run_records import RECORD_FILE, RunRecord

    uri = f"http://admin:{PASSWORD}@mlflow.example:5000"
    RunRecord.for_this_driver("r", None, "abc", uri).write(tmp_path)
    assert _clean((tmp_path / RECORD_FILE).read_text())
    summary = TrainSummary("r", False, "abc", uri, None, str(tmp_path), error=f"OSError: https://u:{PASSWORD}@h/x")
    assert _clean(summary.render()) and "http://<redacted>@mlflow.example:5000" in summary.render()
    row = [f"https://u:{PASSWORD}@h/shards", 0.5]
    assert _clean(cell(row[0])) and _clean(one_line(OSError(f"{row[0]}: failed")))
    assert _clean(markdown_table(["shards", "x"], [row])) and _clean(csv_text(["shards", "x"], [row]))
    # every error line the CLI prints
    assert main(["shards", "inspect", f"https://reader:{PASSWORD}@files.example/shards?x=1"]) == 2
    err = capsys.readouterr().err
    assert "not a folder URL" in err and _clean(err)
