"""The engine's compute threads follow the CPUs it is given (affinity, cgroup quota) and
the CPU time it gets (``ThreadShare``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tokenmill.engine import cpu_share
from tokenmill.engine.cpu_share import (
    FIRST_BACKOFF_S,
    WINDOW_S,
    ThreadShare,
    cgroup_cpu_quota,
    idle_cpu_seconds,
    usable_cpus,
)


def write(root: Path, path: str, text: str) -> None:
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(text)


def test_cgroup_v2_quota_is_the_tightest_on_the_way_up(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/kubepods/pod1/app\n")
    write(tmp_path, "sys/fs/cgroup/kubepods/pod1/app/cpu.max", "max 100000\n")
    write(tmp_path, "sys/fs/cgroup/kubepods/pod1/cpu.max", "150000 100000\n")
    write(tmp_path, "sys/fs/cgroup/kubepods/cpu.max", "400000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 1.5
    assert usable_cpus(tmp_path) == 1  # whole CPUs only


def test_cgroup_v2_namespaced_root_holds_the_container_quota(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/\n")
    write(tmp_path, "sys/fs/cgroup/cpu.max", "50000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 0.5
    assert usable_cpus(tmp_path) == 1  # never below one


def test_cgroup_v1_cpu_controller(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup",
          "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n2:cpuset:/docker/abc\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "250000\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(tmp_path) == 2.5
    assert usable_cpus(tmp_path) == min(2, len(os.sched_getaffinity(0)))


def test_no_quota_anywhere_leaves_the_affinity_mask(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "1:cpu:/\n0::/\nnot a cgroup line\n")
    write(tmp_path, "sys/fs/cgroup/cpu/cpu.cfs_quota_us", "-1\n")
    write(tmp_path, "sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(tmp_path) is None
    assert cgroup_cpu_quota(tmp_path / "nothing") is None
    assert usable_cpus(tmp_path) == len(os.sched_getaffinity(0))


def test_idle_seconds_count_only_the_cpus_asked_for(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 10 900 100 0 0 0 0 0\n"
                    "cpu0 5 0 5 300 50 0 0 0 0 0\n"
                    "cpu1 5 0 5 600 50 0 0 0 0 0\n"
                    "intr 12345\n")
    assert idle_cpu_seconds({1}, stat) == 650 / cpu_share.CLOCK_TICKS
    assert idle_cpu_seconds({0, 1}, stat) == 1000 / cpu_share.CLOCK_TICKS
    assert idle_cpu_seconds({0}, tmp_path / "missing") == 0.0


class FakeHost:
    """Clocks and /proc readings a test drives: each step takes ``step_s`` of wall time, in
    which the engine's threads get ``cpus_got`` CPUs and ``idle_cpus`` CPUs sit idle."""

    def __init__(self, cpus: int = 2) -> None:
        self.now = self.cpu = self.idle = 0.0
        self.cpus, self.cpus_got, self.idle_cpus = cpus, 2.0, 0.0
        self.counts: list[int] = []
        self.share = ThreadShare(2, self.counts.append, cpus=lambda: self.cpus,
                                 allowed=lambda: {0, 1}, idle=lambda cpus: self.idle,
                                 clock=lambda: self.now, cpu_clock=lambda: self.cpu)

    def step(self, seconds: float = 0.125) -> None:  # exact in binary: windows of 4 steps
        with self.share.stepping():
            self.now += seconds
            self.cpu += seconds * self.cpus_got
            self.idle += seconds * self.idle_cpus

    def run(self, seconds: float) -> None:
        for _ in range(round(seconds / 0.125)):
            self.step()


def test_threads_that_get_their_cpus_stay() -> None:
    host = FakeHost()
    host.cpus_got = 1.9
    host.run(10)
    assert host.share.threads == 2 and host.counts == []


def test_threads_short_of_cpu_time_drop_to_what_they_get_and_grow_back_when_cpus_idle() -> None:
    host = FakeHost()
    host.cpus_got = 1.0  # two threads, one CPU's worth: a busy neighbour
    host.run(WINDOW_S)
    assert host.counts == []  # one window may be a burst
    host.run(WINDOW_S)
    assert host.counts == [1]
    host.run(10)  # one thread at its full CPU, nothing idle: stays
    assert host.counts == [1]
    host.idle_cpus = 0.9  # the neighbour left
    host.run(WINDOW_S)
    assert host.counts == [1, 2]
    host.cpus_got = 1.9
    host.run(10)
    assert host.counts == [1, 2]


def test_one_short_window_at_a_time_changes_nothing() -> None:
    host = FakeHost()
    for _ in range(20):  # bursts of other work: a short window, then a full one
        host.cpus_got = 1.3
        host.run(WINDOW_S)
        host.cpus_got = 1.9
        host.run(WINDOW_S)
    assert host.counts == []
    host.cpus_got = 1.3
    host.run(WINDOW_S)
    host.now += 2 * WINDOW_S  # a pause: the next short window is not the one after this
    host.run(WINDOW_S)
    assert host.counts == []
    host.run(WINDOW_S)  # short for good
    assert host.counts == [1]


def test_a_thread_added_and_taken_back_waits_longer_each_time() -> None:
    host = FakeHost()
    host.cpus_got = 1.0
    host.run(2 * WINDOW_S)
    host.idle_cpus = 0.6  # idle, but a second thread would not get it
    grown_at = []
    for _ in range(320):  # 40 s
        before = host.share.threads
        host.step()
        host.cpus_got = 0.9 if host.share.threads == 1 else 1.0
        if host.share.threads > before:
            grown_at.append(host.now)
    gaps = [b - a for a, b in zip(grown_at, grown_at[1:], strict=False)]
    assert len(grown_at) >= 3
    assert gaps[0] >= FIRST_BACKOFF_S and gaps[1] >= 2 * FIRST_BACKOFF_S - WINDOW_S


def test_fewer_cpus_given_lower_the_ceiling_at_once() -> None:
    host = FakeHost()
    host.cpus = 1  # taskset, or a cgroup quota lowered
    host.run(WINDOW_S)
    assert host.counts == [1]
    host.idle_cpus = 1.0
    host.run(10)
    assert host.counts == [1]  # idle CPUs it may not use do not count
    host.cpus = 2
    host.run(WINDOW_S)
    assert host.counts == [1, 2]


def test_pauses_between_steps_are_not_judged() -> None:
    host = FakeHost()
    host.cpus_got = 1.9
    for _ in range(20):
        host.step(0.05)
        host.now += 1.0  # an idle engine between requests: no CPU time, no stepping
    assert host.counts == []


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to take one away")
def test_the_real_affinity_mask_is_followed_while_stepping() -> None:
    allowed = os.sched_getaffinity(0)
    counts: list[int] = []
    share = ThreadShare(len(allowed), counts.append)
    os.sched_setaffinity(0, {min(allowed)})  # this thread only: what the engine's thread reads
    try:
        while not counts:
            with share.stepping():
                sum(range(100_000))
    finally:
        os.sched_setaffinity(0, allowed)
    assert counts == [1]
