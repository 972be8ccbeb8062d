"""Every example of docs/bench.md runs, pointed at a stand-in server.

Blocks run in order in one temporary folder (later examples use earlier files):
``tokenmill bench`` lines go through the CLI with ``--num-requests 3`` appended to keep
them short; other bash blocks (creating files) run in bash; Python blocks are executed.
A block starting with ``tokenmill serve`` is skipped: the stand-in serves instead.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess

from tokenmill.bench.cli import main

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "bench.md")
DEFAULT_URL = "http://127.0.0.1:8000"


def test_every_documented_example_runs(standin, tmp_path, monkeypatch, capsys):
    _, root = standin
    url = f"{root}/k=2"
    monkeypatch.chdir(tmp_path)
    with open(DOC, encoding="utf-8") as f:
        blocks = re.findall(r"```(bash|python)\n(.*?)```", f.read(), re.S)
    ran = 0
    for language, source in blocks:
        source = source.replace(DEFAULT_URL, url)
        if source.startswith("tokenmill serve"):
            continue
        if language == "python":
            exec(compile(source, "docs/bench.md", "exec"), {})
        elif "tokenmill bench" in source:
            for line in filter(None, source.splitlines()):
                argv = shlex.split(line)[2:]
                if argv[0] != "compare":
                    argv += ["--num-requests", "3", "--no-progress"]
                assert main(argv) == 0, (line, capsys.readouterr().err)
        else:
            subprocess.run(["bash", "-c", source], check=True, timeout=30)
        ran += 1
    out = capsys.readouterr().out
    assert ran >= 5 and "B/A" in out
    assert sorted(os.listdir(tmp_path / "plots")) == ["latency_cdf.png", "output_throughput.png",
                                                      "ttft_vs_prompt.png"]
