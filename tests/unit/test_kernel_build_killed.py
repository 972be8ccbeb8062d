"""A process killed (SIGKILL) half-way through compiling kernels leaves nothing that stops
the next one: no half-written library taken for a build, no lock still held (its
compiler, orphaned, still running), and the next compiles and loads in its normal time."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

NAME = "tokenmill_build_kill_test"
SOURCE = 'extern "C" int tokenmill_answer() { return 42; }\n'
# Compiles (or loads) SOURCE in a cache folder, as a start compiles the kernels.
START = f"""
import ctypes, logging, sys
from pathlib import Path
from tokenmill.kernels.build import load_or_compile
logging.basicConfig(level=logging.INFO)
root = Path(sys.argv[2])
load_or_compile("{NAME}", [Path(sys.argv[1])], ["-O0"], [], root, why="a test")
print("answer", ctypes.CDLL(str(root / "{NAME}.so")).tokenmill_answer())
"""
# A compiler that takes a minute over each file: the kill lands while it compiles.
SLOW_COMPILER = """#!/bin/sh
case " $* " in *" -c "*) sleep 60 ;; esac
exec c++ "$@"
"""


def _start(source, root) -> list[str]:
    return [sys.executable, "-c", START, str(source), str(root)]


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler here")
def test_a_start_killed_while_compiling_does_not_stop_the_next(tmp_path) -> None:
    source = tmp_path / "answer.cpp"
    source.write_text(SOURCE)
    clean = tmp_path / "clean"
    began = time.monotonic()
    subprocess.run(_start(source, clean), capture_output=True, check=True, timeout=300)
    normal = time.monotonic() - began

    root = tmp_path / "cache"
    slow = tmp_path / "slow-c++"
    slow.write_text(SLOW_COMPILER)
    slow.chmod(0o755)
    first = subprocess.Popen(_start(source, root), start_new_session=True,
                             env={**os.environ, "CXX": str(slow)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list(root.glob("*.compiling-*/build.ninja")):
            assert first.poll() is None and time.monotonic() < deadline, "no compile began"
            time.sleep(0.05)
        time.sleep(1)  # the compiler is running
        assert first.poll() is None
        os.kill(first.pid, signal.SIGKILL)  # the compiler it started lives on, orphaned
        first.wait()
        assert not (root / f"{NAME}.so").exists()

        began = time.monotonic()
        second = subprocess.run(_start(source, root), capture_output=True, text=True,
                                timeout=120)
        took = time.monotonic() - began
    finally:
        with contextlib.suppress(ProcessLookupError):  # the orphaned compiler, if running
            os.killpg(first.pid, signal.SIGKILL)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "answer 42" in second.stdout
    assert "compiling the native CPU kernels" in second.stderr
    assert took < 3 * normal + 30, f"{took:.1f} s against {normal:.1f} s on a clean cache"
    assert (root / f"{NAME}.so").exists()
