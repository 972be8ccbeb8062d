"""Every example in the user docs (README.md and docs/*.md) is checked against the code,
so that none can go stale.

Run, against the tiny test server (``tiny_server``), with the default address
``http://127.0.0.1:8000`` rewritten to it:

- Python blocks: executed, each in a fresh namespace; they must print something.
- Shell blocks (``bash``, ``sh``, ``shell``, ``console``): run by ``bash -e`` in one
  temporary folder per doc, in the doc's order (later blocks use earlier ones' files,
  e.g. docs/bench.md's ``prompts.jsonl`` and ``a.json``), with ``tokenmill`` and
  ``python`` from this interpreter's environment. ``tokenmill bench`` lines get
  ``--num-requests 4 --no-progress`` appended (argparse keeps the last value) so that
  they stay short; they must report no failed request. A ``json`` block right after a
  run block is its expected output, compared exactly (the served model's name aside).
  Otherwise a block's output must be non-empty and carry no ``"error"``.

Not run: the blocks in ``NOT_RUN``, one entry per block saying why. They install
packages, start a server on the default port (the test server stands in for it), or need
what a test cannot have offline (a Ray cluster, Prometheus). Every other shell and Python
block is run; one that would install, serve, run tests or talk to any server but the
test server fails instead (``NEVER_RUN``), and so does an unlisted PromQL block or a
``NOT_RUN`` entry that matches no block. Other blocks (``yaml``, ``json``, unlabelled
output) are data, checked as below.

Checked in every doc, run or not:

- every ``tokenmill ...`` / ``python -m tokenmill...`` command line in a block, and every
  inline ``tokenmill serve|generate|bench ... --flag`` span, parses with the real CLI
  parser, without running anything (a renamed flag fails here);
- every ``--flag`` named anywhere is an option of ``tokenmill`` (or, next to a
  ``benchmarks/*.py`` script, of that script), or is in ``FOREIGN_FLAGS``;
- every ``tokenmill_*`` and ``vllm:*`` metric named is one the server exports, and every
  ``model_name="..."`` filter names the embedded model's default served name;
- YAML blocks parse, and the KEDA, HPA and prometheus-adapter examples agree with
  deploy/kubernetes/ (a doc's example may leave fields out, not change them);
- the documented JSON shapes (docs/api.md's per-request metrics and engine state,
  docs/bench.md's result file) have the keys the server and ``tokenmill bench`` produce;
- the documented mid-stream error event is the body the server builds;
- relative links and their ``#anchors`` point at files and headings that exist.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass

import httpx
import pytest
import yaml

from tokenmill import cli
from tokenmill.bench import cli as bench_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT)
                             for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded model's served name
SHELL = {"bash", "sh", "shell", "console"}
COMMAND_LANGUAGES = SHELL | {"python", "promql"}
BENCH_SMALL = ["--num-requests", "4", "--no-progress"]

# (doc, start of the block's first line) -> why the block is not run. Its tokenmill
# command lines are still parsed.
NOT_RUN = {
    ("docs/api.md", "# against a server started with --scheduling-policy priority"):
        "needs a server that schedules by priority (the test server schedules first come, "
        "first served); tests/e2e/test_priority_server.py sends the same request",
    ("README.md", "python3 -m venv .venv && . .venv/bin/activate && pip install -e . &&"):
        "installs packages, then serves on the default port 8000",
    ("README.md", "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]'"):
        "installs packages, then runs the whole test suite",
    ("README.md", "sudo apt-get install -y chromium chromium-driver"):
        "installs system packages (the test file it names is checked to exist)",
    ("README.md", "tokenmill serve --ray"):
        "starts a Ray instance and serves on the default port 8000 (tests/ray_serve runs Ray)",
    ("docs/bench.md", "tokenmill serve"):
        "serves on the default port 8000; the test server stands in for it",
    ("docs/metrics.md", "histogram_quantile(0.95,"):
        "PromQL needs a Prometheus (its metric names and labels are checked)",
    ("docs/models.md", "tokenmill serve HuggingFaceTB/SmolLM2-135M-Instruct"):
        "downloads from the Hugging Face Hub and serves on the default port 8000 "
        "(tests/e2e/test_models_by_name.py fetches from a local stand-in for the Hub)",
    ("docs/ray.md", "pip install -e '.[ray]'"): "installs packages",
    ("docs/ray.md", "tokenmill serve --ray --min-replicas 2\n"):
        "starts a Ray instance and serves on the default port 8000",
    ("docs/ray.md", "tokenmill serve --ray --min-replicas 1 --max-replicas 2"):
        "starts a Ray instance and serves on the default port 8000",
    ("docs/ray.md", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=token python -c"):
        "needs the Ray instance of a running `tokenmill serve --ray`",
    ("docs/ray.md", "tokenmill serve --ray --min-replicas 2 --ray-metrics-export-port 8080"):
        "starts a Ray instance; its curl reads that instance's metrics port",
    ("docs/speculative.md", "tokenmill serve --speculative-ngram 4"):
        "serves on the default port 8000 (tests/e2e/test_spec_decode_server.py serves with "
        "speculation; the doc's curl runs here against the test server)",
}

# --flags that are not tokenmill's, with whose they are
FOREIGN_FLAGS = {"--no-deps": "pip install's",
                 "--allow-requantize": "llama.cpp's llama-quantize (docs/gguf.md)",
    "--no-repack": "llama.cpp's llama-perplexity and llama-server (docs/gguf.md)",
                 "--cpus": "docker run's CPU quota (docs/performance.md)"}

# Metric names the docs use that no server exports: the prometheus-adapter's custom metric.
NOT_EXPORTED = {"tokenmill_token_demand"}


@dataclass
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    language: str
    source: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def read(doc: str) -> str:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return f.read()


def blocks_of(doc: str) -> list[Block]:
    """The fenced blocks of a doc, indented ones (inside a list item) dedented."""
    blocks, lines = [], read(doc).splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)```\s*([\w-]*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        indent, language = len(opening.group(1)), opening.group(2).lower()
        body, j = [], i + 1
        while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
            body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
            j += 1
        blocks.append(Block(doc, i + 1, language, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def prose_of(doc: str) -> str:
    """The doc without its fenced blocks."""
    return re.sub(r"^\s*```.*?^\s*```\s*$", "", read(doc), flags=re.S | re.M)


BLOCKS = {doc: blocks_of(doc) for doc in DOCS}
ALL_BLOCKS = [b for doc in DOCS for b in BLOCKS[doc]]


def not_run_reason(block: Block) -> str | None:
    source = block.source.lstrip()
    reasons = [why for (doc, start), why in NOT_RUN.items()
               if doc == block.doc and source.startswith(start)]
    assert len(reasons) <= 1, f"{block.where}: several NOT_RUN entries match"
    return reasons[0] if reasons else None


# ------------------------------------------------------------------ the CLI, parse only
def parse_only(argv: list[str], bench: bool = False) -> None:
    """Parse ``argv`` as ``tokenmill`` (or ``python -m tokenmill.bench``) would, running
    nothing; a bad command line fails the test with argparse's message."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            if bench:
                bench_cli.build_parser().parse_args(argv)
            else:
                cli.parse_args(argv)
    except SystemExit as done:
        if done.code:  # --help and --version exit 0 once parsed
            pytest.fail(f"`{shlex.join(argv)}` does not parse: {stderr.getvalue().strip()}")


def all_options(parser: argparse.ArgumentParser) -> set[str]:
    options = set()
    for action in parser._actions:
        options.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options |= all_options(sub)
    return options


COMMAND = re.compile(
    r"(?:^|&&|\|\||;|\|)[ \t]*((?:tokenmill|python3? -m tokenmill[\w.]*)[ \t][^&|;\n]*)", re.M)


def command_lines(block: Block) -> list[list[str]]:
    """argv (without the program) of every tokenmill command in a shell block."""
    text = block.source.replace("\\\n", " ")
    commands = []
    for match in COMMAND.finditer(text):
        words = shlex.split(match.group(1), comments=True)
        commands.append(words)
    return commands


def check_parses(words: list[str], where: str) -> None:
    if words[0] == "tokenmill":
        parse_only(words[1:])
    elif words[2] in ("tokenmill", "tokenmill.cli"):
        parse_only(words[3:])
    elif words[2] == "tokenmill.bench":
        parse_only(words[3:], bench=True)
    else:
        pytest.fail(f"{where}: no CLI known for {shlex.join(words)}")


# ------------------------------------------------------------------ running examples
def run_python(block: Block, base_url: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.source.replace(DEFAULT_URL, base_url), block.where, "exec"), {})
    return out.getvalue()


def shell_script(block: Block, base_url: str) -> str:
    lines = []
    for line in block.source.replace(DEFAULT_URL, base_url).splitlines():
        words = line.split()
        if words[:2] == ["tokenmill", "bench"] and words[2:3] != ["compare"]:
            line += " " + shlex.join(BENCH_SMALL)
        lines.append(line)
    return "\n".join(lines) + "\n"


# What a block must never do here, however it was classified: list such blocks in NOT_RUN.
NEVER_RUN = re.compile(r"\btokenmill serve\b|\bpip install\b|\bapt-get\b|\bpytest\b|--ray\b")


def run_shell(block: Block, base_url: str, cwd: str) -> str:
    script = shell_script(block, base_url)
    assert not NEVER_RUN.search(script), (
        f"{block.where} would install, serve or run tests: list it in NOT_RUN with why")
    other = set(re.findall(r"https?://(?:127\.0\.0\.1|localhost)(?::\d+)?", script)) - {base_url}
    assert not other, f"{block.where} talks to {other}, not the test server: list it in NOT_RUN"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "COLUMNS": "120",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script],
                            cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (f"{block.where} exited {result.returncode}:\n"
                                    f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    if re.search(r"^tokenmill bench (?!compare)", block.source, re.M):
        failed = re.findall(r"requests failed\W+(\d+)", result.stdout)
        assert failed and set(failed) == {"0"}, f"{block.where}:\n{result.stdout}"
    return result.stdout


def expected_output(block: Block) -> Block | None:
    """The json block right after ``block`` (nothing but blank lines between), if any."""
    blocks = BLOCKS[block.doc]
    following = blocks[blocks.index(block) + 1:]
    if not following or following[0].language != "json":
        return None
    lines = read(block.doc).splitlines()
    end = block.line + block.source.count("\n")  # the closing fence, 0-based
    between = lines[end + 1:following[0].line - 1]
    return following[0] if not "".join(between).strip() else None


def served_name(base_url: str) -> str:
    return httpx.get(base_url + "/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.mark.parametrize("doc", DOCS)
def test_doc_examples_run(tiny_server, doc, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # Python examples write files too (docs/bench.md)
    base_url, ran = tiny_server.base_url, 0
    for block in BLOCKS[doc]:
        if block.language not in COMMAND_LANGUAGES or not_run_reason(block):
            continue
        assert block.language != "promql", f"{block.where}: PromQL cannot run; add to NOT_RUN"
        if block.language == "python":
            out = run_python(block, base_url)
        else:
            out = run_shell(block, base_url, str(tmp_path))
        expected = expected_output(block)
        if expected is not None:
            want = json.loads(expected.source.replace(DEFAULT_MODEL_NAME, served_name(base_url)))
            assert json.loads(out) == want, f"{block.where}: output differs from {expected.where}"
        elif re.match(r"\s*cat > \S+ <<", block.source):
            pass  # writes a file for the next examples, prints nothing
        else:
            assert out.strip(), f"{block.where} printed nothing"
            assert '"error"' not in out, f"{block.where}:\n{out}"
        ran += 1
    if doc == "docs/bench.md":
        check_bench_result_schema(tmp_path)
    runnable = [b for b in BLOCKS[doc] if b.language in COMMAND_LANGUAGES]
    assert ran == len([b for b in runnable if not not_run_reason(b)])


def test_not_run_entries_name_real_blocks() -> None:
    matched = set()
    for block in ALL_BLOCKS:
        source = block.source.lstrip()
        for key in NOT_RUN:
            if key[0] == block.doc and source.startswith(key[1]):
                matched.add(key)
        if block.language in SHELL:
            assert block.source.strip(), f"{block.where}: empty block"
    assert not set(NOT_RUN) - matched, f"NOT_RUN entries with no block: {set(NOT_RUN) - matched}"
    assert len([b for b in ALL_BLOCKS if b.language in COMMAND_LANGUAGES]) >= 25


# ------------------------------------------------------------------ flags and commands
def test_every_tokenmill_command_line_parses() -> None:
    checked = 0
    for block in ALL_BLOCKS:
        if block.language not in SHELL:
            continue
        for words in command_lines(block):
            check_parses(words, block.where)
            checked += 1
    for doc in DOCS:
        for span in re.findall(r"`(tokenmill (?:serve|generate|bench) [^`]*--[^`]*)`",
                               prose_of(doc)):
            check_parses(shlex.split(span), doc)
            checked += 1
    assert checked >= 15


def test_every_flag_named_in_the_docs_exists() -> None:
    options = all_options(cli.build_parser()[0])
    for doc in DOCS:
        text = read(doc)
        # a script's flags are checked against that script: `benchmarks/x.py --flag`
        for line in text.splitlines():
            for script in re.findall(r"\bbenchmarks/\w+\.py", line):
                with open(os.path.join(ROOT, script), encoding="utf-8") as f:
                    code = f.read()
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line):
                    assert flag in options or f'"{flag}"' in code, (
                        f"{doc}: {flag} is neither tokenmill's nor {script}'s")
            if "benchmarks/" in line:
                continue
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line):
                assert flag in options or flag in FOREIGN_FLAGS, (
                    f"{doc}: {flag} is not an option of tokenmill: {line.strip()}")


def test_files_named_in_commands_exist() -> None:
    for block in ALL_BLOCKS:
        if block.language in SHELL:
            for path in re.findall(r"\b((?:tests|benchmarks)/[\w/.-]+\.py)\b", block.source):
                assert os.path.isfile(os.path.join(ROOT, path)), f"{block.where}: no {path}"


# ------------------------------------------------------------------ metrics and queries
def test_metric_names_and_model_labels_are_real(tiny_server) -> None:
    exported = set()
    text = httpx.get(tiny_server.base_url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("# TYPE ") or line.startswith("# HELP "):
            exported.add(line.split()[2])
        elif line and not line.startswith("#"):
            exported.add(re.split(r"[{ ]", line)[0])
    assert "tokenmill_kv_cache_tokens_used" in exported and "vllm:num_requests_running" in exported
    named = 0
    for doc in DOCS:
        text = read(doc)
        for name in re.findall(r"(?<![\w.:])(tokenmill_[a-z0-9_]*[a-z0-9]|vllm:[a-z0-9_:]+)",
                               text):
            assert name in exported | NOT_EXPORTED, f"{doc}: {name} is not exported"
            named += 1
        for value in re.findall(r'model_name="([^"]*)"', text):
            assert value == DEFAULT_MODEL_NAME, (
                f'{doc}: model_name="{value}" matches no series of the embedded model')
    assert named > 50


# ------------------------------------------------------------------ YAML and deploy/
def _normalize_query(value):
    if isinstance(value, str) and "tokenmill_" in value:
        return re.sub(r"\s+", "", re.sub(r"\{[^}]*\}", "", value))
    return value


def assert_within(part, whole, where: str, path: str = "", whole_name: str = "deploy/") -> None:
    """Every field of ``part`` is in ``whole`` with the same value (queries compared
    without label filters and spaces)."""
    if isinstance(part, dict):
        assert isinstance(whole, dict), f"{where}: {path} is not a mapping in {whole_name}"
        for key, value in part.items():
            assert key in whole, f"{where}: {path}.{key} is not in {whole_name}"
            assert_within(value, whole[key], where, f"{path}.{key}", whole_name)
    elif isinstance(part, list):
        assert isinstance(whole, list) and len(part) == len(whole), (
            f"{where}: {path} differs from {whole_name}")
        for i, (a, b) in enumerate(zip(part, whole, strict=True)):
            assert_within(a, b, where, f"{path}[{i}]", whole_name)
    else:
        assert _normalize_query(part) == _normalize_query(whole), (
            f"{where}: {path} is {part!r} here, {whole!r} in {whole_name}")


def _adapter_rules() -> list:
    """The prometheus-adapter rules written as a comment in deploy/kubernetes/hpa.yaml."""
    with open(os.path.join(ROOT, "deploy", "kubernetes", "hpa.yaml"), encoding="utf-8") as f:
        comment = [line[1:] for line in f.read().splitlines() if line.startswith("#  ")]
    return yaml.safe_load("\n".join(comment))


def test_yaml_examples_parse_and_agree_with_deploy() -> None:
    deploy = {}
    for name in ("keda-scaledobject.yaml", "hpa.yaml"):
        with open(os.path.join(ROOT, "deploy", "kubernetes", name), encoding="utf-8") as f:
            manifest = yaml.safe_load(f)
        deploy[manifest["kind"]] = manifest
    compared = 0
    for block in ALL_BLOCKS:
        if block.language != "yaml":
            continue
        example = yaml.safe_load(block.source)
        if example.get("kind") in deploy:
            real = deploy[example["kind"]]
            assert_within(example, real, block.where)
            # what scales, and on what, is all there: no trigger or metric field left out
            key = "triggers" if real["kind"] == "ScaledObject" else "metrics"
            assert_within(real["spec"][key], example["spec"][key], block.where,
                          f".spec.{key}", "the doc's example")
            compared += 1
        elif "rules" in example:
            assert_within(example["rules"], _adapter_rules(), block.where)
            compared += 1
    assert compared >= 4  # README's KEDA, and metrics.md's KEDA, adapter rule and HPA


# ------------------------------------------------------------------ documented JSON shapes
TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\.\.\.|[{}\[\],:]|[^\s{}\[\],:"]+')


@dataclass
class Shape:
    """A documented object: its keys (a key without a value is only named), and whether
    ``...`` says that more keys exist."""

    keys: dict
    more: bool


def parse_shape(text: str):
    """The docs' JSON-ish notation: JSON, plus ``...`` anywhere, bare words for values and
    keys named without a value (``{"a", "b": 1, ...}``). Returns Shape, [item shape] or
    None (a value that is not checked)."""
    tokens = TOKEN.findall(text)
    pos = 0

    def value():
        nonlocal pos
        token = tokens[pos]
        pos += 1
        if token == "{":
            keys, more = {}, False
            while tokens[pos] != "}":
                if tokens[pos] == "...":
                    more, pos = True, pos + 1
                else:
                    key = json.loads(tokens[pos])
                    pos += 1
                    keys[key] = None
                    if tokens[pos] == ":":
                        pos += 1
                        keys[key] = value()
                if tokens[pos] == ",":
                    pos += 1
            pos += 1
            return Shape(keys, more)
        if token == "[":
            items = []
            while tokens[pos] != "]":
                items.append(value())
                if tokens[pos] == ",":
                    pos += 1
            pos += 1
            return items[:1] if items and items[0] is not None else None
        return None

    shape = value()
    assert pos == len(tokens), f"unparsed: {tokens[pos:]}"
    return shape


def assert_shape(shape, actual, where: str, path: str = "") -> None:
    if isinstance(shape, Shape):
        assert isinstance(actual, dict), f"{where}: {path} is not an object"
        named, real = set(shape.keys), set(actual)
        assert named <= real, f"{where}: {path or 'top level'}: no {sorted(named - real)}"
        assert shape.more or named == real, (
            f"{where}: {path or 'top level'} does not document {sorted(real - named)}")
        for key, sub in shape.keys.items():
            assert_shape(sub, actual[key], where, f"{path}.{key}")
    elif isinstance(shape, list) and actual:
        assert_shape(shape[0], actual[0], where, f"{path}[0]")


def documented_shape(doc: str, start: str):
    (block,) = [b for b in BLOCKS[doc] if b.source.lstrip().startswith(start)]
    source = block.source.strip()
    if not source.startswith("{"):
        source = "{" + source + "}"
    return parse_shape(source), block.where


def check_bench_result_schema(folder) -> None:
    with open(os.path.join(folder, "a.json"), encoding="utf-8") as f:
        result = json.load(f)
    shape, where = documented_shape("docs/bench.md", '{"format": "tokenmill-bench/1"')
    assert_shape(shape, result, where)


def test_documented_responses_have_the_real_keys(tiny_server) -> None:
    base = tiny_server.base_url
    completion = httpx.post(base + "/v1/completions", timeout=30, json={
        "prompt": "Hello", "max_tokens": 4, "include_metrics": True}).json()
    shape, where = documented_shape("docs/api.md", '"metrics": [')
    assert_shape(shape, {"metrics": completion["metrics"]}, where)
    state = httpx.get(base + "/v1/engine/state", timeout=10).json()
    shape, where = documented_shape("docs/api.md", '{"object": "engine.state"')
    assert_shape(shape, state, where)


def test_documented_mid_stream_error_is_the_servers() -> None:
    from tokenmill.server.errors import error_body

    (event,) = [line for b in BLOCKS["docs/api.md"] for line in b.source.splitlines()
                if line.startswith('data: {"error"')]
    documented = json.loads(event.removeprefix("data: ").replace('{...}', "{}"))
    real = error_body(500, "...")
    assert documented["error"] == real["error"] and set(documented) == {"error", "usage"}


# ------------------------------------------------------------------ links
def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_and_anchors_exist() -> None:
    checked = 0
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose_of(doc)):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), path)) if path \
                else os.path.join(ROOT, doc)
            assert os.path.exists(file), f"{doc}: link to {target}: no such file"
            if anchor:
                headings = re.findall(r"^#+\s+(.*)$", prose_of(os.path.relpath(file, ROOT)),
                                      re.M)
                assert anchor in {slug(h) for h in headings}, f"{doc}: no #{anchor} in {path}"
            checked += 1
    assert checked >= 20
