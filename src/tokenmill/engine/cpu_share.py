"""How many compute threads the engine runs: no more than the CPUs it is given, and no
more than the CPU time it gets.

Given: the CPUs this process may run on (its affinity mask: ``taskset``, a container's
cpuset) and the CPU time a cgroup quota allows (``docker --cpus``, a Kubernetes CPU
limit: cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``). ``usable_cpus`` reads both.

Gets: other programs busy on the same CPUs take their share, whatever their ``nice``
level when they run in another session (kernel autogroup, on in most distributions, puts
each session in a scheduling group of its own). The compute threads meet at a barrier
after every parallel kernel, and a thread that arrives first spins there for a while
before it sleeps: the fastest way alone, but when a thread gets only part of a core, the
one its peers wait for is off the CPU for whole time slices, and a step takes tens of
times longer. ``ThreadShare`` watches the CPU time the engine's threads get while it
steps, runs fewer threads when they get much less than all of it, and more again (up to
the CPUs it is given) when CPUs it may run on sit idle.

Nothing here imports torch: the server's HTTP process imports this module (through the
engine process's entry point) and never loads torch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("tokenmill")

WINDOW_S = 0.5  # stepping time between two decisions
LOW_UTILIZATION = 0.7  # below this share of their CPUs, the threads are too many
IDLE_TO_GROW = 0.5  # CPUs idle on average over a window: room for one more thread
FIRST_BACKOFF_S = 5.0  # after a thread added is taken back, wait this long to try again
MAX_BACKOFF_S = 80.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def usable_cpus(root: Path = Path("/")) -> int:
    """The CPUs this process may keep busy: its affinity mask, capped by the whole CPUs a
    cgroup quota allows (rounded down, at least one) on any level of its cgroup."""
    cpus = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota(root)
    return cpus if quota is None else max(1, min(cpus, math.floor(quota)))


def cgroup_cpu_quota(root: Path = Path("/")) -> float | None:
    """CPUs' worth of time per period the tightest cgroup quota above this process allows,
    or ``None`` where there is none (or none is readable). Reads ``/proc/self/cgroup`` and
    the cgroup filesystems mounted at ``/sys/fs/cgroup`` (v2, or v1's ``cpu``
    controller), from the process's own cgroup up to the mount's root."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        if line.count(":") < 2:
            continue
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:
            quotas += _quotas(root / "sys/fs/cgroup", path, _v2_quota)
        elif "cpu" in controllers.split(","):
            for mount in (controllers, "cpu", "cpu,cpuacct"):
                quotas += _quotas(root / "sys/fs/cgroup" / mount, path, _v1_quota)
    return min(quotas, default=None)


def _quotas(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    found = []
    directory = mount / path.strip("/")
    while True:
        quota = read(directory)
        if quota is not None:
            found.append(quota)
        if directory == mount or mount not in directory.parents:
            return found
        directory = directory.parent


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 else quota / period


def idle_cpu_seconds(cpus: set[int], stat: Path = Path("/proc/stat")) -> float:
    """Seconds ``cpus`` have spent idle (idle + iowait) since boot; 0 where the kernel's
    counters cannot be read (then no idle time is ever seen, and threads never grow)."""
    try:
        text = stat.read_text()
    except OSError:
        return 0.0
    ticks = 0
    for line in text.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks += int(fields[3]) + int(fields[4])
    return ticks / CLOCK_TICKS


@dataclass(slots=True)
class _Window:
    """Stepping time and CPU time since the window began, and the idle CPU seconds then."""

    started: float
    idle_at_start: float
    stepping_s: float = 0.0
    cpu_s: float = 0.0


class ThreadShare:
    """Keeps the compute thread count between 1 and ``ceiling`` (the count at start, capped
    by ``usable_cpus`` as it is now) and near the CPU time the engine gets.

    Each step runs inside ``stepping()``. Over every ``WINDOW_S`` of stepping: when the
    threads got less than ``LOW_UTILIZATION`` of the CPUs they ran on (process CPU time
    over stepping time and threads) in this window and the one before it at this count,
    the count drops to the CPUs' worth they got (at least one fewer); when the CPUs this
    process may use sat idle for ``IDLE_TO_GROW`` CPUs or more and the count is below the
    ceiling, it grows by the idle CPUs (at least one). A count grown and then dropped in
    the next two windows doubles the wait before the next try (``FIRST_BACKOFF_S`` up to
    ``MAX_BACKOFF_S``). One short window alone changes nothing: the server's own HTTP
    process and other bursty work take a CPU for moments (with 64 streams and the load
    generator on the same two cores, two threads dip to 1.26 to 1.62 CPUs in a window now
    and then, and get 1.7 to 1.97 in the next), where busy neighbours take it for good. A
    pause between steps longer than a window starts a new window (and breaks a row of
    short ones): only stepping is judged. ``set_threads`` is called with each new count,
    from the thread that steps.
    """

    def __init__(self, threads: int, set_threads: Callable[[int], None], *,
                 cpus: Callable[[], int] = usable_cpus,
                 allowed: Callable[[], set[int]] = lambda: os.sched_getaffinity(0),
                 idle: Callable[[set[int]], float] = idle_cpu_seconds,
                 clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.process_time) -> None:
        self.threads = self.start_threads = threads
        self._set_threads = set_threads
        self._cpus, self._allowed, self._idle = cpus, allowed, idle
        self._clock, self._cpu_clock = clock, cpu_clock
        self._window: _Window | None = None
        self._last_step_end = -math.inf
        self._backoff_s = FIRST_BACKOFF_S
        self._grow_after = -math.inf
        self._just_grew = False
        self._short = False  # the last window at this count was short of CPU time

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Times one step; at the end of a window, changes the thread count if it should."""
        start, cpu_start = self._clock(), self._cpu_clock()
        paused = start - self._last_step_end > WINDOW_S
        if paused:
            self._short = False  # windows a pause apart are not in a row
        if self._window is None or paused:
            self._window = _Window(start, self._idle(self._allowed()))
        try:
            yield
        finally:
            end = self._last_step_end = self._clock()
            window = self._window
            window.stepping_s += end - start
            window.cpu_s += self._cpu_clock() - cpu_start
            if window.stepping_s >= WINDOW_S:
                self._judge(window, end)
                self._window = None

    def _judge(self, window: _Window, now: float) -> None:
        ceiling = min(self.start_threads, self._cpus())
        cpus_got = window.cpu_s / window.stepping_s
        idle = (self._idle(self._allowed()) - window.idle_at_start) / (now - window.started)
        short = self.threads > 1 and cpus_got < LOW_UTILIZATION * self.threads
        was_short, self._short = self._short, short
        if self.threads > ceiling:
            self._change(ceiling, f"the CPUs it may use are now {ceiling}")
        elif short and not was_short:
            return  # a burst, or the first window of a lasting shortfall: the next tells
        elif short:
            if self._just_grew:  # the thread added did not get a CPU: wait longer
                self._grow_after = now + self._backoff_s
                self._backoff_s = min(2 * self._backoff_s, MAX_BACKOFF_S)
            self._change(max(1, min(self.threads - 1, round(cpus_got))),
                         f"its {self.threads} threads got {cpus_got:.2f} CPUs")
        elif self.threads < ceiling and idle >= IDLE_TO_GROW and now >= self._grow_after:
            self._change(min(ceiling, self.threads + max(1, math.floor(idle))),
                         f"{idle:.2f} CPUs it may use were idle")
            self._just_grew = True
            return
        elif self._just_grew:
            self._backoff_s = FIRST_BACKOFF_S  # the threads added held their CPUs
        self._just_grew = False

    def _change(self, threads: int, why: str) -> None:
        logger.info("compute threads %d -> %d: %s", self.threads, threads, why)
        self.threads = threads
        self._short = False
        self._set_threads(threads)
