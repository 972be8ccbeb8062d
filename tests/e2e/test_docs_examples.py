"""Every example in the user docs runs: Python blocks are executed and curl commands
are run, pointed at a live test server instead of the default address."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md", "docs/api.md", "docs/speculative.md", "docs/structured-outputs.md"]
DEFAULT_URL = "http://127.0.0.1:8000"


def code_blocks(language: str) -> list[tuple[str, str]]:
    blocks = []
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        for i, block in enumerate(re.findall(rf"```{language}\n(.*?)```", text, re.S)):
            blocks.append((f"{doc}#{i}", block))
    return blocks


PYTHON = code_blocks("python")
CURL = [(name, b) for name, b in code_blocks("bash") if b.lstrip().startswith("curl")]


@pytest.mark.parametrize("name,source", PYTHON, ids=[n for n, _ in PYTHON])
def test_python_examples_run(tiny_server, name, source, capsys) -> None:
    exec(compile(source.replace(DEFAULT_URL, tiny_server.base_url), name, "exec"), {})
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("name,command", CURL, ids=[n for n, _ in CURL])
def test_curl_examples_run(tiny_server, name, command) -> None:
    result = subprocess.run(["bash", "-c", command.replace(DEFAULT_URL, tiny_server.base_url)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert '"error"' not in result.stdout and ("text" in result.stdout), result.stdout
