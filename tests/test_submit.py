"""``dmltrain submit``: the job it builds, the CLI flow, and real jobs on a local Ray head.

The last test starts a real Ray head (``ray start --head`` on loopback, with its own temp
dir and ports), submits a tiny training through the head's Job API exactly as a user does,
and checks the MLflow run and what was uploaded. The head's processes are ended by their
session id, never with ``ray stop`` (which would end every Ray on the machine).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from netcheck import beyond_loopback

from cluster import submit as sub
from cluster.launch import local_ray_env
from dmltrain.cli import build_parser, main
from dmltrain.config import load_config
from dmltrain.errors import UserError

REPO = Path(__file__).resolve().parents[1]
DEMO = "configs/demo.yaml"


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def parse_entrypoint(entrypoint: str):
    tokens = shlex.split(entrypoint)
    assert tokens[:3] == ["python", "-m", "dmltrain"], entrypoint
    argv = tokens[3:]
    return build_parser(argv).parse_args(argv)


# -- the job description ----------------------------------------------------------------------------
def test_plan_job_entrypoint_is_a_valid_train_command(in_repo):
    spec = sub.plan_job(DEMO, ["optim.lr=0.02", "eval.ks=[1, 2]"])
    assert re.fullmatch(r"dmltrain-demo-\d{8}-\d{6}-[0-9a-f]{4}", spec.submission_id)
    args = parse_entrypoint(spec.entrypoint)
    assert args.command == "train" and args.config == DEMO
    assert args.overrides == [
        "optim.lr=0.02",
        "eval.ks=[1, 2]",
        "cluster.address=auto",
        f"train.run_name={spec.submission_id}",
    ]
    cfg = load_config(args.config, args.overrides)  # what the job will load
    assert cfg.train.run_name == spec.submission_id and cfg.cluster.address == "auto"
    assert cfg.optim.lr == 0.02 and cfg.eval.ks == [1, 2]
    env = spec.runtime_env
    assert "working_dir" not in env and env["env_vars"]["PYTHONUNBUFFERED"] == "1" and "pip" not in env
    files = dict(spec.upload.files)
    assert spec.upload.root == REPO and {DEMO, "dmltrain/cli.py", "cluster/submit.py", "pyproject.toml"} <= set(files)
    assert not any(f.startswith(("tests/", ".git/", ".venv/")) or "__pycache__" in f for f in files)
    assert spec.submit_kwargs("/tmp/x.zip")["runtime_env"]["working_dir"] == "/tmp/x.zip"
    assert spec.metadata["dmltrain.run_name"] == spec.submission_id and spec.metadata["dmltrain.config"] == DEMO
    assert spec.submission_id != sub.plan_job(DEMO).submission_id


def test_plan_job_respects_explicit_run_name_address_and_options(in_repo, tmp_path):
    req = tmp_path / "requirements.txt"
    req.write_text("# extras\nfaiss-gpu-cu12>=1.8\n\nsome-pkg==1.0  # pinned\n")
    spec = sub.plan_job(
        DEMO,
        ["train.run_name=resume-me", "cluster.address=ray://h:10001"],
        requirements=req,
        excludes=["notebooks/"],
        env={"NCCL_DEBUG": "INFO"},
        submission_id="my-job.1",
    )
    args = parse_entrypoint(spec.entrypoint)
    assert args.overrides == ["train.run_name=resume-me", "cluster.address=ray://h:10001"]
    assert spec.submission_id == "my-job.1" and spec.metadata["dmltrain.run_name"] == "resume-me"
    assert spec.runtime_env["pip"] == {"packages": ["faiss-gpu-cu12>=1.8", "some-pkg==1.0"], "pip_check": False}
    assert spec.runtime_env["env_vars"]["NCCL_DEBUG"] == "INFO"


def test_plan_job_refuses_what_the_job_could_not_run(in_repo, tmp_path):
    outside = tmp_path / "c.yaml"
    outside.write_text("train: {epochs: 1}\n")
    with pytest.raises(UserError, match="outside the working directory"):
        sub.plan_job(outside)
    wd = tmp_path / "proj"
    (wd / "configs").mkdir(parents=True)
    (wd / "data").mkdir()
    (wd / "data" / "c.yaml").write_text("{}\n")
    with pytest.raises(UserError, match="excluded from the upload"):
        sub.plan_job(wd / "data" / "c.yaml", working_dir=wd)
    (wd / "configs" / "child.yaml").write_text("extends: ../../c.yaml\n")  # the parent is outside wd
    with pytest.raises(UserError, match=r"c\.yaml: outside the working directory"):
        sub.plan_job(wd / "configs" / "child.yaml", working_dir=wd)
    with pytest.raises(UserError, match="optim.lr"):
        sub.plan_job(DEMO, ["optim.lr=-1"])
    with pytest.raises(UserError, match="--requirements"):
        sub.plan_job(DEMO, requirements=tmp_path / "missing.txt")
    with pytest.raises(UserError, match="--submission-id"):
        sub.plan_job(DEMO, submission_id="has space")


def test_placement_warnings_name_the_paths_a_cluster_would_lose(in_repo):
    warns = " ".join(sub.plan_job(DEMO).warnings)
    for key in ("tracking.uri", "train.output_dir", "data.shards"):
        assert key in warns
    shared = [
        "tracking.uri=http://mlflow:5000",
        "cluster.storage_path=/mnt/shared/runs",
        "data.shards=/mnt/shared/shards/demo",
    ]
    assert sub.plan_job(DEMO, shared).warnings == []


def _project(root, files):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _minimal_project(root):
    return _project(
        root,
        {
            "configs/demo.yaml": (REPO / DEMO).read_text(),
            "configs/base.yaml": "train: {epochs: 2}\n",
            "configs/child.yaml": "extends: base.yaml\n",
            "dmltrain/cli.py": "x = 1\n",
            "cluster/submit.py": "x = 2\n",
            "pyproject.toml": "[project]\n",
            "README.md": "hi\n",
        },
    )


# what a home folder or a busy project folder holds beside the code: none of it may travel with a job
PLANTED = {
    ".env": "MLFLOW_TRACKING_PASSWORD=hunter2\n",
    ".aws/credentials": "[default]\n",
    ".ssh/id_rsa": "key\n",
    ".netrc": "machine x\n",
    ".ray/auth_token": "tok\n",
    "credentials.json": "{}\n",
    "secrets.yaml": "a: b\n",
    "server.pem": "pem\n",
    "mlflow.db": "",
    "mlflow.db-wal": "",
    "mlflow.db-journal": "",
    "runs.sqlite": "",
    "env/pyvenv.cfg": "home = /usr\n",
    "env/lib/site.py": "",
    ".venv/bin/python": "",
    "data/sop/train-000000.tar": "",
    "shards-out/manifest.json": "{}\n",
    "shards-out/train-000000.tar": "",
    "runs/r1/model.pt": "",
    "notebooks/x.ipynb": "{}",
    ".git/HEAD": "ref\n",
}


def test_dry_run_uploads_the_allow_list_only(tmp_path, monkeypatch, capsys):
    """A folder planted with credentials, stores, environments and shards: the dry run lists the code and
    configs only, with their sizes, and does not contact a cluster."""
    wd = _project(_minimal_project(tmp_path / "home"), PLANTED)
    monkeypatch.chdir(wd)
    monkeypatch.setattr(sub, "connect", lambda address: pytest.fail("a dry run must not contact the cluster"))
    assert main(["submit", "configs/child.yaml", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    printed = json.loads(out)
    listed = printed["upload"]["list"]
    assert set(listed) == {
        "configs/demo.yaml",
        "configs/base.yaml",
        "configs/child.yaml",
        "dmltrain/cli.py",
        "cluster/submit.py",
        "pyproject.toml",
    }
    assert listed["dmltrain/cli.py"] == 6 and printed["upload"]["bytes"] == sum(listed.values())
    assert printed["upload"]["files"] == 6 and printed["upload"]["from"] == str(wd)
    assert "would upload 6 files" in err and "working_dir" in printed["runtime_env"]


# files a deny-list of names misses: what gives them away is their content, reported by line, never quoted
SECRET_TEXT = {
    "configs/notes.txt": ("-----BEGIN OPENSSH " + "PRIVATE KEY-----\nb3Blbn\n", 1),
    "configs/aws.yaml": ("key: AKIA" + "ABCDEFGHIJKLMNOP\n", 1),
    "configs/kube/config": ("apiVersion: v1\nusers:\n- name: ci\n  user:\n    token: eyJhbGciOi.JSUzI1Ni.Isx9Q\n", 5),
    "configs/mlflow.ini": ("[mlflow]\nmlflow_tracking_username = admin\nmlflow_tracking_password = Pw-0f-mine\n", 3),
    "configs/netrc.txt": ("machine mlflow.example login admin password Pw-0f-mine\n", 1),
    "configs/db.txt": ("# the database\nDB_HOST=db\nDB_PASSWORD=Pw-0f-mine\n", 3),
    "cluster/sa.json": ('{"type": "service_account",\n "private_key": "MIIEvQIBADAN"}\n', 2),
    "configs/curl.sh": ("curl -H 'Authorization: Bearer 0123456789abcdefXYZ' https://x\n", 1),
    "dmltrain/keys.py": ('API_TOKEN = "0123456789abcdef"\n', 1),
}


@pytest.mark.parametrize("planted, why", [
    ("configs/.env", "name is that of a credential"), ("configs/secrets.yaml", "name is that of a credential"),
    ("cluster/deploy.pem", "name is that of a credential"), ("configs/.ssh/id_ed25519", "name is that of a credential"),
    ("dmltrain/.ray/auth_token", "name is that of a credential"),
    *((name, f"line {line} looks like a secret") for name, (_, line) in SECRET_TEXT.items()),
])  # fmt: skip
def test_a_credential_that_would_go_is_refused_with_one_line(tmp_path, monkeypatch, capsys, planted, why):
    wd = _minimal_project(tmp_path / "proj")
    _project(wd, {planted: SECRET_TEXT.get(planted, ("x\n", 0))[0]})
    monkeypatch.chdir(wd)
    monkeypatch.setattr(sub, "connect", lambda address: pytest.fail("refused before contacting the cluster"))
    assert main(["submit", DEMO, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"dmltrain: error: {wd / planted}: would be uploaded") and why in err, err
    assert not any(s in err for s in ("Pw-0f-mine", "eyJhbGci", "0123456789", "MIIEvQ", "AKIAABCD")), err
    # leaving it out, or sending it anyway, is the user's explicit choice
    assert main(["submit", DEMO, "--dry-run", "--exclude", planted]) == 0
    assert planted not in json.loads(capsys.readouterr().out)["upload"]["list"]
    assert main(["submit", DEMO, "--dry-run", "--allow-file", planted]) == 0
    assert planted in json.loads(capsys.readouterr().out)["upload"]["list"]
    assert main(["submit", DEMO, "--dry-run", "--allow-file", "configs/nothing.yaml"]) == 2
    assert "--allow-file configs/nothing.yaml: not a file of the upload" in capsys.readouterr().err


# passwords whose value starts like a reference, is cut at "#", or sits under a key name the first scan missed
MISSED_SECRETS = [
    ("app.env", "DB_PASSWORD=!Xk9pQ2zL\n"),
    ("app.env", "DB_PASSWORD=@dm1nPw9\n"),
    ("app.env", "DB_PASSWORD=ab#cdefgh\n"),
    ("app.env", "DB_PASS=Xk9pQ2zL\n"),
    ("app.env", "MYSQL_PWD=Xk9pQ2zL\n"),
    ("db.yaml", 'password: "*Hunter2*xyz"\n'),
    ("db.yaml", "db:\n  password: |\n    Xk9pQ2zL\n"),
    ("settings.py", 'PASSWORD = "!Xk9pQ2zL"\n'),
    ("azure.txt", "conn = DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=bXlrZXkxMjM0NTY3OA==;\n"),
    ("docker.json", '{"auths": {"registry.example": {"auth": "dXNlcjpYazlwUTJ6TA=="}}}\n'),
    ("curl.sh", "curl -H 'Authorization: Basic dXNlcjpYazlwUTJ6TA==' https://x\n"),
    # missed until #35: a bare pw in an INI file, a token scheme's header, a Hugging Face token, a key's passphrase
    ("app.ini", "[db]\npw = Xk9pQ2zL\n"),
    ("app.env", "DB_PW=Xk9pQ2zL\n"),
    ("curl.sh", "curl -H 'Authorization: Token Xk9pQ2zLab12' https://x\n"),
    ("notes.txt", "hf_Xk9pQ2zLXk9pQ2zLXk9pQ2zLXk9pQ2zLab\n"),
    ("ssh.yaml", "deploy:\n  passphrase: Xk9pQ2zL\n"),
]
# references, placeholders and code: no finding
NOT_SECRETS = [
    ("app.env", "DB_PASSWORD=${DB_PASSWORD}\nAPI_TOKEN=$(cat /run/token)\nPASS=$SMTP_PASS\nPWD=/home/me/work\n"),
    ("db.yaml", 'password: "${DB_PASSWORD}"\ntoken: <your-token>\nsecret: "{{ vault_secret }}"\npassword: changeme\n'),
    ("db.yaml", "x: &pw Hunter2xyz\npassword: *pw\nPassword: !Ref DbPassword\ncredentials: ~/.aws/credentials\n"),
    ("db.yaml", "token_file: /var/run/secrets/token\nauth: null\ncredentials: {type: env}\npassword: >-\n  ${PW}\n"),
    ("app.ini", "password = %(db_password)s\n"),
    ("keys.py", "token = args.token\npassword = os.environ['DB_PASSWORD']\nauth = request.auth\n"),
    ("notes.md", "# the secret: kubectl get secret mlflow\nauthors = [{name = 'x'}]\nbypass: always\n"),
    ("login.py", "pw = getpass.getpass()\nfrom huggingface_hub import hf_hub_download\n"),
    ("notes.md", "Authorization: Token headers are sent as they are\nPWD=~/work\npassphrase: ${KEY_PASSPHRASE}\n"),
]


@pytest.mark.parametrize("name, text", MISSED_SECRETS)
def test_the_content_scan_finds_passwords_in_every_common_form(tmp_path, name, text):
    from cluster.credential_scan import find_secret

    found = find_secret(tmp_path / name, text.encode())
    key_line = text.count("\n") - text.endswith("|\n    Xk9pQ2zL\n")  # a block scalar: the line of its key
    assert found is not None and found.line == key_line, (text, found)
    assert not any(part in found.what for part in ("Xk9p", "Hunter2", "dXNl", "bXlr")), found


@pytest.mark.parametrize("name, text", NOT_SECRETS)
def test_the_content_scan_leaves_references_placeholders_and_code(tmp_path, name, text):
    from cluster.credential_scan import find_secret

    assert find_secret(tmp_path / name, text.encode()) is None


def test_the_repository_itself_is_accepted_and_its_dry_run_shows_no_password(in_repo, monkeypatch, capsys):
    """The project's own code, configs, cluster files and README pass the content scan (no false positive), and
    the job printed by --dry-run hides a tracking URI's password."""
    monkeypatch.setattr(sub, "connect", lambda address: pytest.fail("a dry run must not contact the cluster"))
    uri = "tracking.uri=http://admin:Pw-0f-mine@mlflow.example:5000"
    assert main(["submit", DEMO, "--dry-run", "--include", "README.md", "--include", "Makefile", uri]) == 0
    out, err = capsys.readouterr()
    listed = json.loads(out)["upload"]["list"]
    assert {"README.md", "cluster/ray-cluster.yaml", "cluster/rayjob.yaml", "dmltrain/cli.py"} <= set(listed)
    assert "http://<redacted>@mlflow.example:5000" in out and "Pw-0f-mine" not in out + err


def test_upload_honours_ignore_files_includes_and_links(tmp_path):
    wd = _minimal_project(tmp_path / "proj")
    _project(
        wd,
        {
            ".gitignore": "*.log\nconfigs/scratch/\n",
            "configs/.rayignore": "draft.yaml\n",
            "configs/run.log": "",
            "configs/scratch/a.yaml": "",
            "configs/draft.yaml": "",
            "tools/plot.py": "",
            "tools/cache.db": "",
        },
    )
    files = dict(sub.plan_job(wd / "configs/child.yaml", working_dir=wd).upload.files)
    assert not {"configs/run.log", "configs/scratch/a.yaml", "configs/draft.yaml", "README.md"} & set(files)
    files = dict(sub.plan_job(wd / "configs/child.yaml", working_dir=wd, includes=["tools", "README.md"]).upload.files)
    assert {"tools/plot.py", "README.md"} <= set(files) and "tools/cache.db" not in files
    with pytest.raises(UserError, match="--include ../x: outside the working directory"):
        sub.plan_job(wd / "configs/child.yaml", working_dir=wd, includes=["../x"])
    outside = tmp_path / "elsewhere.yaml"
    outside.write_text("a: 1\n")
    (wd / "configs" / "linked.yaml").symlink_to(outside)
    with pytest.raises(UserError, match=r"linked\.yaml: a link to .*outside the working directory"):
        sub.plan_job(wd / "configs/child.yaml", working_dir=wd)


def test_the_zip_sent_is_the_list_shown(tmp_path):
    """What Ray unpacks as the job's working directory is exactly the planned files, byte for byte, and the
    same files give the same package (Ray reuses an upload it already holds)."""
    from ray._private.runtime_env.packaging import get_uri_for_package, unzip_package

    wd = _project(_minimal_project(tmp_path / "proj"), PLANTED)
    upload = sub.plan_job(wd / "configs/child.yaml", working_dir=wd).upload
    z1, z2 = upload.write_zip(tmp_path / "a.zip"), upload.write_zip(tmp_path / "b.zip")
    assert get_uri_for_package(z1) == get_uri_for_package(z2)
    unzip_package(str(z1), str(tmp_path / "unpacked"), remove_top_level_directory=False, unlink_zip=False)
    got = {
        p.relative_to(tmp_path / "unpacked").as_posix(): p.read_bytes()
        for p in (tmp_path / "unpacked").rglob("*")
        if p.is_file()
    }
    assert got == {rel: (wd / rel).read_bytes() for rel, _ in upload.files}


# -- the command, against a scripted Job API ------------------------------------------------------------
class ScriptedJobs:
    """Stands in for ``JobSubmissionClient``: a job that logs ``chunks`` and ends in ``final``."""

    def __init__(self, final="SUCCEEDED", chunks=("step 1\n", "step 2\n"), message="Job finished successfully."):
        self.final, self.chunks, self.message = final, list(chunks), message
        self.submitted, self.stopped, self.polls = [], [], 0

    def submit_job(self, **kw):
        self.submitted.append(kw)
        return kw["submission_id"]

    def get_job_status(self, job_id):
        self.polls += 1
        return self.final if self.polls > 1 else "RUNNING"

    def get_job_info(self, job_id):
        if job_id == "nope":
            raise RuntimeError("Request failed with status code 404: Job nope does not exist.")
        meta = {"dmltrain.run_name": job_id, "dmltrain.experiment": "dmltrain-demo"}
        return SimpleNamespace(
            status=self.final,
            message=self.message,
            entrypoint="python -m dmltrain train x.yaml",
            start_time=1_700_000_000_000,
            end_time=1_700_000_095_000,
            metadata=meta,
            submission_id=job_id,
        )

    async def tail_job_logs(self, job_id):
        for c in self.chunks:
            yield c

    def get_job_logs(self, job_id):
        return "".join(self.chunks)

    def stop_job(self, job_id):
        self.stopped.append(job_id)
        return True

    def list_jobs(self):
        return [self.get_job_info("a"), self.get_job_info("b")]


@pytest.fixture
def scripted(monkeypatch):
    holder = {}

    def connect(address):
        holder["address"] = address
        return holder["client"]

    monkeypatch.setattr(sub, "connect", connect)
    return holder


def test_submit_follows_logs_and_exits_with_the_job(in_repo, scripted, capsys):
    scripted["client"] = jobs = ScriptedJobs()
    rc = main(["submit", DEMO, "optim.lr=0.02", "--address", "head:8265"])
    out, err = capsys.readouterr()
    assert rc == 0 and out == "step 1\nstep 2\n"
    assert scripted["address"] == "http://head:8265"
    (kw,) = jobs.submitted
    assert parse_entrypoint(kw["entrypoint"]).overrides[0] == "optim.lr=0.02"
    assert f"submitted job {kw['submission_id']}" in err and f"job {kw['submission_id']} SUCCEEDED in 1m35s" in err

    scripted["client"] = ScriptedJobs(final="FAILED", message="Job entrypoint command failed with exit code 1")
    assert main(["submit", DEMO, "--address", "http://head:8265"]) == 1
    assert "FAILED in 1m35s: Job entrypoint command failed with exit code 1" in capsys.readouterr().err


def test_no_wait_status_logs_stop_list(in_repo, scripted, capsys):
    scripted["client"] = jobs = ScriptedJobs()
    assert main(["submit", DEMO, "--no-wait", "--submission-id", "sid-1", "--address", "h:1"]) == 0
    assert capsys.readouterr().out.strip() == "sid-1" and jobs.polls == 0
    assert main(["submit", "--status", "sid-1", "--address", "h:1"]) == 0
    out = capsys.readouterr().out
    assert "job sid-1: SUCCEEDED" in out and "ran 1m35s" in out and "http://h:1/#/jobs/sid-1" in out
    assert main(["submit", "--logs", "sid-1", "--address", "h:1", "--no-wait"]) == 0
    assert capsys.readouterr().out == "step 1\nstep 2\n"
    assert main(["submit", "--stop", "sid-1", "--address", "h:1"]) == 0
    assert jobs.stopped == ["sid-1"] and "job sid-1: SUCCEEDED" in capsys.readouterr().out
    assert main(["submit", "--list", "--address", "h:1"]) == 0
    assert re.search(r"^b\s+SUCCEEDED", capsys.readouterr().out, re.M)
    assert main(["submit", "--status", "nope", "--address", "h:1"]) == 1
    assert (
        capsys.readouterr().err.strip()
        == "dmltrain: error: job nope: no such job on this cluster (dmltrain submit --list shows them)"
    )


def test_user_errors_are_one_line(in_repo, monkeypatch, capsys):
    monkeypatch.setattr(sub, "connect", lambda address: pytest.fail("must not contact the cluster"))
    assert main(["submit", DEMO, "optim.lr=-1"]) == 2
    assert main(["submit", "--status", "x", DEMO]) == 2
    assert main(["submit", DEMO, "--env", "NOEQUALS"]) == 2
    assert main(["submit"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("dmltrain: error: ") for line in err)
    assert main(["submit", DEMO, "--dry-run"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)  # JSON is YAML
    assert parse_entrypoint(printed["entrypoint"]).command == "train"


def test_unreachable_address_is_one_line(in_repo, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    assert main(["submit", "--status", "x", "--address", f"127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(
        f"dmltrain: error: --address http://127.0.0.1:{port}: cannot reach the Ray Job API"
    )


# -- real jobs on a local Ray head --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_pids(sid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[3]) == sid and int(d.name) != os.getpid():
                pids.append(int(d.name))
    return pids


def _end_session(sid: int, grace: float = 3.0) -> None:
    """SIGTERM every process of the head's session, SIGKILL what is left after ``grace`` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        for pid in _session_pids(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while _session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A Ray head on loopback with 2 CPUs, its own temp dir and ports; ended by session id afterwards."""
    tmp = tmp_path_factory.mktemp("rayhead")
    temp_dir = Path("/tmp") / f"dmlt-ray-{os.getpid()}-{tmp.name}"  # short: Ray's socket paths have a length limit
    gcs, dash, agent = _free_port(), _free_port(), _free_port()
    try:
        import ray.dashboard.optional_deps  # noqa: F401 — what `ray start` checks before serving the Job API
    except ImportError as e:
        pytest.fail(f"the Ray Job API needs ray[default] ({e}); reinstall with `make setup`")
    bin_dir = Path(sys.executable).parent
    # Token auth follows ~/.ray/auth_token when RAY_AUTH_MODE is unset; pin it so the head, its jobs and this
    # process agree whatever that file holds (a loopback-only head).
    saved_mode = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_USAGE_STATS_ENABLED": "0",
        **local_ray_env(),
    }
    cmd = [
        str(bin_dir / "ray"),
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash}",
        f"--dashboard-agent-listen-port={agent}",
        "--num-cpus=2",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]
    if (
        importlib.util.find_spec("grpc") is not None
    ):  # with ray[client] the head also serves Ray Client, on 10001 unless told
        cmd.append(f"--ray-client-server-port={_free_port()}")
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=180)
        if proc.returncode != 0:
            pytest.fail(f"ray start failed:\n{out[-3000:]}")
        exposed = beyond_loopback(_session_pids(proc.pid))
        assert not exposed, f"the local head listens beyond loopback: {exposed}"
        yield SimpleNamespace(gcs=f"127.0.0.1:{gcs}", dashboard=f"http://127.0.0.1:{dash}", temp_dir=temp_dir, tmp=tmp)
    finally:
        if proc.poll() is None:
            proc.kill()
        _end_session(proc.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)
        if saved_mode is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved_mode


@pytest.mark.ray
@pytest.mark.timeout(420)
def test_tiny_training_submitted_as_a_ray_job(ray_head, in_repo, capsys):
    """``dmltrain submit configs/demo.yaml`` (tiny) runs a real training in a Ray job and lands in MLflow."""
    from mlflow import MlflowClient

    tmp = ray_head.tmp
    uri = f"sqlite:///{tmp}/mlflow.db"
    overrides = [
        "train.epochs=1",
        "eval.before_training=false",
        "eval.plots=false",
        "data.synthetic.classes=20",
        "data.synthetic.per_class=8",
        f"data.shards={tmp}/shards",
        "cluster.num_workers=2",
        "data.loader_workers=0",
        f"tracking.uri={uri}",
        "tracking.experiment=submit-test",
        "tracking.system_metrics=false",
        "tracking.log_models=false",
        f"train.output_dir={tmp}/runs",
    ]
    rc = main(["submit", DEMO, *overrides, "--address", ray_head.dashboard])
    out, err = capsys.readouterr()
    sid = re.search(r"submitted job (\S+)", err).group(1)
    assert rc == 0, (out + err)[-4000:]
    assert f"run {sid}: finished" in out and f"job {sid} SUCCEEDED" in err
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("submit-test")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`dmltrain.run_name` = '{sid}'")
    assert run.info.status == "FINISHED" and run.data.params["train.run_name"] == sid
    assert any(k.startswith("eval/recall") for k in run.data.metrics)
    # the job ran in the uploaded copy of the project: code and configs, no environment, data or VCS
    (pkg,) = {
        p.resolve()
        for p in ray_head.temp_dir.glob("session_*/runtime_resources/working_dir_files/_ray_pkg_*")
        if p.is_dir()
    }
    uploaded = {p.name for p in pkg.iterdir()}
    assert {"dmltrain", "cluster", "shards", "configs", "pyproject.toml"} <= uploaded
    assert not {".venv", ".git", ".pytest_cache", "dmltrain.egg-info", "data", "runs", "mlflow.db"} & uploaded

    # the finished job as the other commands see it
    addr = ["--address", ray_head.dashboard]
    assert main(["submit", "--status", sid, *addr]) == 0
    status = capsys.readouterr().out
    assert f"job {sid}: SUCCEEDED" in status and f"run name:   {sid} (MLflow experiment submit-test)" in status
    assert main(["submit", "--logs", sid, "--no-wait", *addr]) == 0
    assert f"run {sid}: finished" in capsys.readouterr().out
    assert main(["submit", "--list", *addr]) == 0
    assert re.search(rf"^{re.escape(sid)}\s+SUCCEEDED", capsys.readouterr().out, re.M)

    # a second training, submitted without waiting, then stopped
    assert main(["submit", DEMO, *overrides, "--no-wait", "--submission-id", f"{sid}-stop", *addr]) == 0
    assert capsys.readouterr().out.strip() == f"{sid}-stop"
    assert main(["submit", "--stop", f"{sid}-stop", *addr]) == 0
    assert capsys.readouterr().out.strip() == f"job {sid}-stop: STOPPED"
