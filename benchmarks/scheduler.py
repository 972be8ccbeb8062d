"""Per-step scheduling cost with a long waiting queue vs a short one, side by side.

Two engine cores (a real scheduler and KV-cache manager; a tiny fake executor that
samples a token for every request in O(batch), so the step time is the engine's own
work) hold the same running batch: ``--running`` requests decoding, which fill
``max_num_seqs``, so nothing waiting can be admitted. One core also holds ``--few``
waiting requests, the other ``--many``. The waiting requests stay waiting for the
whole measurement (checked). Measured, per step:

- scheduler: ``Scheduler.schedule()`` + ``Scheduler.update_from_output()`` (the fake
  executor runs between them, untimed);
- engine: ``EngineCore.step()`` (schedule, fake execute, update, stats).

The two cores step in alternating blocks of ``--block`` steps, so both see the same
machine noise and the same context lengths (the running requests grow one token per
step). Reported: the median time per step of each and many / few (target <= 1.05);
also the mean, and the garbage collector's passes during the measurement (a full
collection walks every live object, waiting requests included). ``--profile`` adds a
cProfile listing of the many-waiting steps. Prints a table and writes JSON. Usage::

    python benchmarks/scheduler.py [--many 20000] [--few 10] [--steps 1000] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import itertools
import os
import platform
import pstats
import random
import statistics
import time
from collections.abc import Callable

from report_file import write_report  # noqa: E402  (sibling module)
from rich.console import Console
from rich.table import Table

from tokenmill.config import EngineConfig
from tokenmill.core.engine_core import EngineCore
from tokenmill.core.request import EngineCoreRequest
from tokenmill.core.types import ModelRunnerOutput, SchedulerOutput
from tokenmill.sampling_params import SamplingParams

TARGET_RATIO = 1.05
BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
VOCAB = 1000


class TinyExecutor:
    """Samples one token, ``position % VOCAB``, for every request that samples:
    O(batch) per step."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(
            sampled={r.req_id: ((r.start_pos + len(r.token_ids)) % VOCAB,)
                     for r in scheduler_output.requests if r.sample})


def build_core(num_waiting: int, args: argparse.Namespace) -> EngineCore:
    """A core whose ``args.running`` requests are all decoding and fill ``max_num_seqs``,
    with ``num_waiting`` requests queued behind them."""
    rng = random.Random(args.seed)
    ids = itertools.count()
    max_tokens = args.warmup + 2 * args.steps + 16  # never finishes during the measurement
    num_blocks = args.running * -(-(args.prompt_len + max_tokens) // BLOCK_SIZE) + 64
    config = EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=num_blocks,
                          max_num_seqs=args.running,
                          max_num_batched_tokens=args.running * args.prompt_len)
    core = EngineCore(config, TinyExecutor(), num_blocks, MAX_MODEL_LEN)

    def add(max_new: int) -> None:
        core.add_request(EngineCoreRequest(
            req_id=f"req-{next(ids)}",
            prompt_token_ids=tuple(rng.randrange(VOCAB) for _ in range(args.prompt_len)),
            sampling_params=SamplingParams(max_tokens=max_new, ignore_eos=True),
            eos_token_ids=frozenset({VOCAB})))

    for _ in range(args.running):
        add(max_tokens)
    while core.scheduler.num_waiting or any(r.is_prefilling for r in core.scheduler.running):
        core.step()
    for _ in range(num_waiting):
        add(args.output_len)
    check_state(core, args.running, num_waiting)
    return core


def check_state(core: EngineCore, num_running: int, num_waiting: int) -> None:
    scheduler = core.scheduler
    assert len(scheduler.running) == num_running, "a running request finished or was preempted"
    assert not any(r.is_prefilling for r in scheduler.running), "a running request is prefilling"
    assert scheduler.num_waiting == num_waiting, "a waiting request was admitted"


class GCWatch:
    """Counts the garbage collector's passes by generation, and their seconds."""

    def __init__(self) -> None:
        self.passes = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.passes[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start


def scheduler_step(core: EngineCore) -> float:
    """Seconds in schedule() + update_from_output(); the fake forward is not timed."""
    scheduler = core.scheduler
    start = time.perf_counter()
    scheduler_output = scheduler.schedule()
    scheduled = time.perf_counter()
    runner_output = core.executor.execute(scheduler_output)
    resumed = time.perf_counter()
    scheduler.update_from_output(scheduler_output, runner_output)
    scheduler.take_step_counters()
    return (scheduled - start) + (time.perf_counter() - resumed)


def engine_step(core: EngineCore) -> float:
    start = time.perf_counter()
    core.step()
    return time.perf_counter() - start


def compare(step: Callable[[EngineCore], float], cores: dict[str, EngineCore],
            args: argparse.Namespace) -> tuple[dict[str, list[float]], dict[str, GCWatch]]:
    """Per-step seconds of each core, and the GC passes during its steps; the cores take
    turns in blocks of ``args.block`` steps."""
    for core in cores.values():
        for _ in range(args.warmup):
            step(core)
    times: dict[str, list[float]] = {name: [] for name in cores}
    watches = {name: GCWatch() for name in cores}
    for _ in range(0, args.steps, args.block):
        for name, core in cores.items():
            gc.callbacks.append(watches[name])
            times[name] += [step(core) for _ in range(args.block)]
            gc.callbacks.remove(watches[name])
    return times, watches


def summarize(times: dict[str, list[float]], watches: dict[str, GCWatch]) -> dict:
    result = {}
    for name, samples in times.items():
        us = [t * 1e6 for t in samples]
        result[name] = {"steps": len(us), "median_us": statistics.median(us),
                        "mean_us": statistics.fmean(us),
                        "p90_us": statistics.quantiles(us, n=10)[-1],
                        "max_us": max(us),
                        "gc_passes_by_generation": watches[name].passes,
                        "gc_ms_by_generation": [s * 1e3 for s in watches[name].seconds]}
    result["ratio_median"] = result["many"]["median_us"] / result["few"]["median_us"]
    result["ratio_mean"] = result["many"]["mean_us"] / result["few"]["mean_us"]
    result["meets_target"] = result["ratio_median"] <= TARGET_RATIO
    return result


def profile(step: Callable[[EngineCore], float], core: EngineCore, steps: int) -> str:
    """cProfile of ``steps`` steps of ``core``: the top functions by cumulative time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step(core)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
    return out.getvalue()


def measure(args: argparse.Namespace) -> dict:
    report: dict = {"args": vars(args), "python": platform.python_version(),
                    "machine": platform.machine(), "cpu_count": os.cpu_count()}
    profiles = {}
    for part, step in (("scheduler", scheduler_step), ("engine", engine_step)):
        cores = {"few": build_core(args.few, args), "many": build_core(args.many, args)}
        report[part] = summarize(*compare(step, cores, args))
        for name, num_waiting in (("few", args.few), ("many", args.many)):
            check_state(cores[name], args.running, num_waiting)
        if args.profile:
            profiles[part] = profile(step, cores["many"], args.steps // 2)
    if profiles:
        report["profiles"] = profiles
    return report


def print_table(report: dict) -> None:
    args = report["args"]
    table = Table(title=f"time per step, {args['running']} running decodes "
                        f"(= max_num_seqs), {args['steps']} steps each")
    for column in ("measured", "waiting", "median us", "mean us", "max us",
                   "GC passes gen0/1/2", "GC ms", "ratio median", "ratio mean"):
        table.add_column(column, justify="right")
    labels = {"scheduler": "schedule + update", "engine": "EngineCore.step()"}
    for part, label in labels.items():
        r = report[part]
        for name in ("few", "many"):
            row = r[name]
            last = name == "many"
            table.add_row(
                label if not last else "", str(args[name]), f"{row['median_us']:.1f}",
                f"{row['mean_us']:.1f}", f"{row['max_us']:.0f}",
                "/".join(map(str, row["gc_passes_by_generation"])),
                f"{sum(row['gc_ms_by_generation']):.1f}",
                f"{r['ratio_median']:.3f} {'ok' if r['meets_target'] else 'MISSED'}"
                if last else "", f"{r['ratio_mean']:.3f}" if last else "",
                end_section=last)
    console = Console(width=130)
    console.print(table)
    console.print(f"ratio = {args['many']} waiting / {args['few']} waiting; "
                  f"target: median ratio <= {TARGET_RATIO}")
    for part, text in report.get("profiles", {}).items():
        console.print(f"{labels[part]}, {args['many']} waiting: cProfile")
        print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--many", type=int, default=20_000, help="waiting requests, long queue")
    parser.add_argument("--few", type=int, default=10, help="waiting requests, short queue")
    parser.add_argument("--running", type=int, default=16, help="decodes = max_num_seqs")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128, help="of waiting requests")
    parser.add_argument("--steps", type=int, default=1000, help="measured steps per core")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--block", type=int, default=50, help="steps per turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/scheduler.json")
    args = parser.parse_args()
    if args.steps % args.block:
        parser.error("--steps must be a multiple of --block")
    report = measure(args)
    print_table(report)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
