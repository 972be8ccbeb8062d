"""``tokenmill serve`` runs the engine in a child process of its own, which serves through
the server and never outlives it, however the server ends; the HTTP process never loads
torch, a model or a kernel."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest
from server_process import ServerProcess


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if ppid == pid:
                found.append(int(entry))
    return found


def engine_process(server_pid: int) -> int:
    """The server's child that runs the engine (multiprocessing also starts a tracker)."""
    engines = []
    for pid in children(server_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                engines.append(pid)
    assert len(engines) == 1, f"expected one engine process, found {engines}"
    return engines[0]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def mapped_files(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1] for line in f if len(line.split()) >= 6}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def test_engine_runs_in_its_own_process_and_ends_with_the_server(tiny_model):
    server = ServerProcess(tiny_model, "--max-model-len", "256")
    try:
        engine = engine_process(server.process.pid)
        r = httpx.post(server.base_url + "/v1/completions", timeout=30, json={
            "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200
        health = httpx.get(server.base_url + "/health", timeout=10)
        assert health.json() == {"status": "ok", "model": os.path.basename(tiny_model),
                                 "engine_alive": True}
        assert any("libtorch" in f for f in mapped_files(engine))
        loaded = [f for f in mapped_files(server.process.pid)
                  if "libtorch" in f or "tokenmill_kernels" in f]
        assert not loaded, f"the HTTP process loaded torch or the native kernels: {loaded}"
        print(f"RSS: HTTP process {rss_mib(server.process.pid):.0f} MiB, "
              f"engine {rss_mib(engine):.0f} MiB")
        os.kill(engine, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
        os.kill(engine, signal.SIGTERM)
        time.sleep(0.5)
        assert alive(engine), "the engine must leave shutdown to the server"
    finally:
        server.stop()
    assert wait_gone(engine, 30), "the engine outlived a stopped server"


def test_engine_ends_when_the_server_is_killed(tiny_model):
    server = ServerProcess(tiny_model, "--max-model-len", "256")
    engine = engine_process(server.process.pid)
    server.process.kill()  # no clean-up at all: the engine sees its pipe close
    server.process.wait()
    server.stop()
    assert wait_gone(engine, 30), "the engine outlived a killed server"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to take one away")
def test_engine_threads_follow_the_cpus_it_is_given_while_it_serves(tiny_model):
    """``taskset`` on a running server: the engine drops to one compute thread (two
    threads on one CPU wait for each other a whole time slice at every barrier)."""
    server = ServerProcess(tiny_model, "--max-model-len", "256")
    try:
        engine = engine_process(server.process.pid)
        one_cpu = {min(os.sched_getaffinity(0))}
        for task in os.listdir(f"/proc/{engine}/task"):
            os.sched_setaffinity(int(task), one_cpu)
        deadline = time.monotonic() + 60
        while not re.search(r"compute threads \d+ -> 1:", server.log()):
            assert time.monotonic() < deadline, f"threads never followed:\n{server.log()}"
            r = httpx.post(server.base_url + "/v1/completions", timeout=30, json={
                "prompt": "hello", "max_tokens": 64, "ignore_eos": True, "n": 4})
            assert r.status_code == 200
    finally:
        server.stop()
