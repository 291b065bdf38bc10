"""The docs site: its generated reference misses no config key and no command-line option, the pages name only
config keys the schema has, and the two tutorials run as their pages write them.

The reference Markdown comes from the functions the site's build hook uses (``docs/hooks/reference.py``); what it
must hold is read here from the schema and the parsers directly. ``mkdocs build --strict`` itself (broken links,
anchors, pages missing from the nav) runs in ``make test`` before the suite (``make docs-check``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def _load_hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", DOCS / "hooks/reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = _load_hook()


# -- config keys -----------------------------------------------------------------------------------
def schema_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of ``model``, read from pydantic's fields (sections, and sections that may be null, too)."""
    keys = []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        keys.append(key)
        for arg in (field.annotation, *getattr(field.annotation, "__args__", ())):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                keys += schema_keys(arg, key)
    return keys


def missing_keys(markdown: str, model: type[BaseModel]) -> list[str]:
    """The keys of ``model`` that no row of the config reference names (a row starts with the key's code span)."""
    rows = {m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", markdown, re.M)}
    # the top-level sections are headings, not rows
    return [k for k in schema_keys(model) if k not in rows and not ("." not in k and f"## `{k}`" in markdown)]


def test_the_config_reference_lists_every_key_with_its_default_and_bounds():
    from dmltrain.config import Config

    markdown = reference.config_markdown()
    assert missing_keys(markdown, Config) == []
    assert len(schema_keys(Config)) > 150  # the walk reached the nested sections
    row = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([^`]+)` \|.*$", markdown, re.M)}
    # type, default, bounds and description of a few keys, as the schema has them
    assert row["train.grad_accum"].startswith("| `train.grad_accum` | `int` | `1` | ≥ 1, ≤ 1024 | micro-batches")
    assert '| `uniform | hard | mixed | proportional` | `"uniform"` |' in row["loss.classifier.sampling"]
    assert "| `float | null` | `null` | &gt; 0, &lt; 1 |" in row["train.ema_decay"]
    assert "[section](#config-data-augment-color-jitter)" in row["data.augment.color_jitter"]
    assert "length ≤ 200, pattern `^[A-Za-z0-9][A-Za-z0-9_.-]*$` |" in row["train.run_name"]
    # the loss kinds with their parameters, from the loss registry
    assert (
        "| `arcface` | `scale`: 64 (positive), `margin`: 0.5 (in [0, pi)), `subcenters`: 1 (in [1, 1024]) |" in markdown
    )
    assert re.search(r"^\| `ice` \| .*`scale`: 64", markdown, re.M)


def test_a_key_added_to_the_schema_is_in_the_reference_without_writing_it(monkeypatch):
    import dmltrain.config as config

    before = reference.config_markdown()

    class WiderTrain(config.TrainConfig):
        warm_knob: float = Field(0.5, gt=0, le=2, description="a key added by this test")

    class WiderConfig(config.Config):
        train: WiderTrain = Field(default_factory=WiderTrain)

    monkeypatch.setattr(config, "Config", WiderConfig)
    # the check fails on a reference that lacks the key ...
    assert missing_keys(before, WiderConfig) == ["train.warm_knob"]
    # ... and the generator writes it, with what the schema says
    after = reference.config_markdown()
    assert missing_keys(after, WiderConfig) == []
    assert "| `train.warm_knob` | `float` | `0.5` | &gt; 0, ≤ 2 | a key added by this test |" in after


# -- command-line options ----------------------------------------------------------------------------
def all_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every parser the commands build, by walking the subparsers of each command's own build."""
    from dmltrain import gpu_check
    from dmltrain.bench import BENCHES, bench_parser
    from dmltrain.cli import COMMANDS, build_parser

    def subparsers(parser):
        return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})

    found = []

    def walk(name, parser):
        found.append((name, parser))
        for sub_name, sub in subparsers(parser).items():
            walk(f"{name} {sub_name}", sub)

    for command in COMMANDS:
        walk(f"dmltrain {command}", subparsers(build_parser([command]))[command])
    found += [(f"dmltrain bench {name}", bench_parser(name)) for name in BENCHES]
    check = argparse.ArgumentParser(prog="python -m dmltrain.gpu_check")
    gpu_check.add_arguments(check)
    found.append(("python -m dmltrain.gpu_check", check))
    return found


def missing_options(markdown: str, parsers) -> list[str]:
    """``"<command> <option>"`` for each option string (and each visible positional) of each parser that the
    command's section of the CLI reference does not name."""
    sections = {}
    for m in re.finditer(r"^#+ `([^`]+)` \{#cli-[^}]*\}\n(.*?)(?=^#+ `|\Z)", markdown, re.M | re.S):
        sections[m.group(1)] = m.group(2)
    missing = []
    for name, parser in parsers:
        section = sections.get(name)
        if section is None:
            missing.append(name)
            continue
        for action in parser._actions:
            if (
                isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
                or action.help == argparse.SUPPRESS
            ):
                continue
            for option in action.option_strings or [action.metavar or action.dest]:
                if f"`{option}`" not in section:
                    missing.append(f"{name} {option}")
    return missing


def test_the_cli_reference_lists_every_command_and_option():
    parsers = all_parsers()
    markdown = reference.cli_markdown()
    assert missing_options(markdown, parsers) == []
    names = [name for name, _ in parsers]
    assert {
        "dmltrain shards build",
        "dmltrain index query",
        "dmltrain study subsampling",
        "dmltrain bench eval",
    } <= set(names)
    assert sum(len(p._option_string_actions) for _, p in parsers) > 300
    # a flag with its value, default and help as the parser has them
    assert "| `--kind` | `KIND` | `flat` | flat (exact), ivf-pq or hnsw (default flat) |" in markdown
    assert "| `--kind` | `{normsoftmax,cosface,arcface,softmax_ce}` | `normsoftmax` |" in markdown


def test_a_flag_added_to_a_command_is_in_the_reference_without_writing_it(monkeypatch):
    import cluster.launch as launch

    before = reference.cli_markdown()
    original = launch.add_arguments

    def add_arguments(parser):
        original(parser)
        parser.add_argument("--warm-flag", metavar="N", default=3, help="a flag added by this test")

    monkeypatch.setattr(launch, "add_arguments", add_arguments)
    parsers = all_parsers()
    assert missing_options(before, parsers) == ["dmltrain train --warm-flag"]
    after = reference.cli_markdown()
    assert missing_options(after, parsers) == []
    assert "| `--warm-flag` | `N` | `3` | a flag added by this test |" in after


# -- hand-written pages ------------------------------------------------------------------------------
def test_pages_may_name_only_keys_the_schema_has():
    keys = set(reference.config_keys())
    text = (
        "`train.ema_decay`, `data.shards=s3://b/x`, `loss.classifier.params.temperature`, `model.pt`, "
        "`data.storage_options.anon`, `eval.rerank_params.`, `data.crop_scale` (refused with its new name), "
        "`train.ema_decy`, `loss.classifier.nearest_too: 3`, `cluster.gpus`"
    )
    assert reference.unknown_keys(text, keys) == ["train.ema_decy", "loss.classifier.nearest_too", "cluster.gpus"]
    for page in DOCS.rglob("*.md"):
        assert reference.unknown_keys(page.read_text(), keys) == [], page


# -- the tutorials ------------------------------------------------------------------------------------
MARKER = re.compile(r"^<!-- tutorial: ([a-z0-9-]+) -->\n```bash\n(.*?)^```$", re.M | re.S)
TUTORIALS = {"quickstart": DOCS / "getting-started.md", "own-images": DOCS / "how-to/own-images.md"}


def tutorial_commands(name: str, text: str | None = None) -> list[list[str]]:
    """Tutorial ``name``'s command lines, in page order, as argument lists: the lines of each ```bash fence right
    after a ``<!-- tutorial: name -->`` line of its page (or of ``text``), comments dropped and ``\\``
    continuations joined, so that what the page shows is what runs. A block may hold ``dmltrain`` and ``python``
    commands only, without shell syntax (variables, pipes, redirections, ``&&``, ``;``), so that running each line
    as :func:`run_tutorial` does is what a shell would run."""
    text = TUTORIALS[name].read_text() if text is None else text
    blocks = [m.group(2) for m in MARKER.finditer(text) if m.group(1) == name]
    assert len(blocks) == text.count(f"<!-- tutorial: {name} -->"), (
        f"tutorial {name}: a <!-- tutorial: {name} --> marker not followed by a ```bash block"
    )
    commands = []
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        code = line.split(" #", 1)[0]
        assert argv[0] in ("dmltrain", "python") and not re.search(r"[$|&;<>`]", code), (
            f"tutorial {name}: a line the test cannot run as a shell would: {line}"
        )
        commands.append(argv)
    return commands


def test_the_tutorial_blocks_are_marked():
    for name in TUTORIALS:
        assert len(tutorial_commands(name)) >= 4, name
    assert tutorial_commands("quickstart")[3][:3] == ["dmltrain", "train", "configs/demo.yaml"]
    assert tutorial_commands("own-images")[-1][:3] == ["dmltrain", "index", "query"]
    page = "<!-- tutorial: t -->\n```bash\ndmltrain eval x \\\n  --shards d   # the best\n```\n"
    assert tutorial_commands("t", page) == [["dmltrain", "eval", "x", "--shards", "d"]]
    with pytest.raises(AssertionError, match="cannot run as a shell would"):
        tutorial_commands("t", page.replace("--shards d", "--shards $D | tee log"))
    with pytest.raises(AssertionError, match="marker not followed"):
        tutorial_commands("t", page.replace("```bash", "```text"))


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for both tutorials (each `dmltrain train` joins it, as `dmltrain train` does a Ray already
    started in its process), stopped at the end."""
    import ray

    from cluster.launch import start_local_ray

    start_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def run_tutorial(name: str, where: Path, monkeypatch) -> str:
    """Run tutorial ``name``'s command lines in order from ``where``, as a reader would from the repository root
    (its ``configs/`` and ``docs/`` linked there): ``dmltrain`` lines through ``dmltrain.cli.main``, what the
    ``dmltrain`` script calls, in this process (one Ray, no import per command: the two tutorials would otherwise
    cost minutes of start-up); ``python`` lines as a process of this environment's Python. Every line must exit 0;
    the output of all of them."""
    from dmltrain.cli import main

    for folder in ("configs", "docs"):
        (where / folder).symlink_to(REPO / folder)
    monkeypatch.chdir(where)
    for key in [k for k in os.environ if k.startswith("MLFLOW_")]:  # the page's default store, ./mlflow.db
        monkeypatch.delenv(key)
    output = []
    for argv in tutorial_commands(name):
        if argv[0] == "dmltrain":
            # a buffer of its own, never closed: a logging handler made during one command (MLflow's, Ray's)
            # keeps the stream it found, which capsys would close at the end of the test
            buffer = io.StringIO()
            with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
                code = main(argv[1:])
            text = buffer.getvalue()
        else:
            done = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, stdin=subprocess.DEVNULL)
            code, text = done.returncode, done.stdout + done.stderr
        output.append(f"$ {shlex.join(argv)}\n{text}")
        assert code == 0, f"tutorial {name}: {shlex.join(argv)} exited {code}:\n{text[-4000:]}"
    return "\n".join(output)


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_the_quick_start_runs_as_written(tmp_path, local_ray, monkeypatch):
    output = run_tutorial("quickstart", tmp_path, monkeypatch)
    assert re.search(r"recall@1: [0-9.]+ before training -> [0-9.]+ after", output), output[-3000:]
    assert (tmp_path / "runs/first/best_model/model.pt").is_file()
    assert (tmp_path / "mlflow.db").is_file()
    assert "\n  shards: data/first\n" in output  # config show's resolved YAML


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_own_images_to_a_search_service_runs_as_written(tmp_path, local_ray, monkeypatch):
    output = run_tutorial("own-images", tmp_path, monkeypatch)
    assert "largest absolute difference to PyTorch" in output
    assert (tmp_path / "runs/mine/best_model/model.onnx.json").is_file()
    assert (tmp_path / "emb/mine/index-hnsw/index_eval.json").is_file()
    # the query image is in the gallery: its first answer is itself
    assert re.search(r"1\. photos/product-045/0\.jpg +cosine 1\.0000 +label sku-045", output), output[-3000:]
