"""/metrics of a real server reports the resident memory of its two processes: the HTTP
process (the one started) and the engine process (its child), each as /proc has it."""

from __future__ import annotations


def vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_the_gauge_reports_the_http_and_the_engine_process(tiny_server) -> None:
    http_pid = tiny_server.process.pid
    with open(f"/proc/{http_pid}/task/{http_pid}/children") as f:
        children = [int(pid) for pid in f.read().split()]
    engine_pid = max(children, key=vm_rss)  # torch and the model: the largest child
    m = tiny_server.metrics()
    http = m['tokenmill_process_resident_memory_bytes{process=http}']
    engine = m['tokenmill_process_resident_memory_bytes{process=engine}']
    assert abs(http - vm_rss(http_pid)) < 0.1 * http
    assert abs(engine - vm_rss(engine_pid)) < 0.1 * engine
    assert engine > 100 << 20  # it holds torch; the HTTP process does not
