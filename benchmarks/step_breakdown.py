"""Where a serving step's time goes, at one stream and at many.

Runs the real ``tokenmill serve`` in this process (``server.run.serve``, with the engine
process's ``engine_setup`` hook), with timers wrapped around the engine's parts in its
engine process (which writes their totals to a file a
few times a second) and around output processing in this one, and drives it from a
``tokenmill bench`` subprocess (its own Python, as a real client would be):
``--input-len`` prompt tokens,
exactly ``--output-len`` output tokens, streaming, at each ``--concurrency`` in turn.
Per level it prints the mean milliseconds per engine step of:

- engine process: scheduling (``Scheduler.schedule``), input preparation (the runner's
  tensors and attention plan), forward (the decoder layers' matmuls, the MLP's SiLU gate
  with them, attention over the cache, the RMSNorms (``RMSNorm`` layers; Qwen3's and Gemma
  3's per-head q/k norms count in the rest), the rest: rotary and the KV store, embedding,
  residuals and the forward pass's own Python), decode layers (a step runs every
  Llama-family layer in one native call, ``DecodeLayers``, where its attention takes it: a
  step of decodes alone, and one with prompt chunks where the native prefill attention
  takes them; its matmuls, attention and norms are not split; ``--module-layers`` runs
  every step layer module by layer module instead, which splits them and costs the
  Python between them), the LM head
  (the output projection to the vocabulary), sampling (settings + sampler, log-probabilities
  included where the requests ask for them: ``--logprobs``), update (stop checks,
  outputs), other (the rest of ``EngineCore.step``: sending results, the queue state),
  idle (between steps, from the level's first working step to its last: waiting for
  work or the inbox; not the load generator's own start-up and exit);
- server process, event-loop thread (CPU time): output processing (detokenisation, stop strings,
  stats) and HTTP/SSE (everything else it does: parsing, JSON, streaming).

The timers cost a few microseconds per call (about 150 calls per step); the figures
are for comparing parts, not for absolute throughput. Usage::

    python benchmarks/step_breakdown.py [--concurrency 1 64] [--requests-per-stream 1]
                                        [--logprobs N] [--module-layers] [--out FILE]
                                        [-- SERVER OPTIONS]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
from report_file import write_report  # noqa: E402  (sibling module)
from rich.console import Console
from rich.table import Table

from tokenmill import cli
from tokenmill.core.engine_core import EngineCore
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.sampler import Sampler
from tokenmill.frontend import request_state
from tokenmill.models.attention.backend import AttentionBackend
from tokenmill.models.attention.native import NativeDecode, NativePrefill
from tokenmill.models.attention.sdpa import SdpaDecode, SdpaPrefill
from tokenmill.models.causal_lm import PagedCausalLM
from tokenmill.models.families.llama import LlamaForCausalLM
from tokenmill.models.layers.linear import GatedLinear, Linear
from tokenmill.models.layers.norms import RMSNorm
from tokenmill.server.run import serve

SNAPSHOT_ENV = "STEP_BREAKDOWN_FILE"
MODULE_LAYERS_ENV = "STEP_BREAKDOWN_MODULE_LAYERS"  # "1": no native decode layers
SNAPSHOT_PERIOD_S = 0.2
ENGINE_PARTS = ("schedule", "prepare", "matmuls", "attention", "norms", "decode_layers",
                "forward_rest", "lm_head", "sampling", "update", "other", "idle")
LOOP_PARTS = ("output_processing", "http_sse")


class Timers:
    """Cumulative seconds per part; ``work_clocks`` holds the clock at the start of each
    engine step that ran work (their count is the steps')."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.work_clocks: list[float] = []
        self.running: list[str] = []  # the parts whose timed calls are under way

    def wrap(self, owner, name: str, part: str, not_inside: str | None = None) -> None:
        """Time every call of ``owner.name`` into ``part``, except calls made while a
        call timed into ``not_inside`` runs (they count there)."""
        original = getattr(owner, name)
        seconds, running = self.seconds, self.running

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if not_inside in running:
                return original(*args, **kwargs)
            running.append(part)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start
                running.pop()

        setattr(owner, name, timed)

    def snapshot(self) -> dict:
        clocks = list(self.work_clocks)
        return {"seconds": dict(self.seconds), "steps": len(clocks),
                "clock": time.perf_counter(), "work_clocks": clocks}


class TimedDecodeLayers:
    """A model's ``DecodeLayers``, its ``run`` and ``run_mixed`` Python methods (for
    ``Timers.wrap``)."""

    def __init__(self, stack) -> None:
        self.stack = stack

    def run(self, *args):
        return self.stack.run(*args)

    def run_mixed(self, *args):
        return self.stack.run_mixed(*args)


def instrument_engine(timers: Timers, module_layers: bool) -> None:
    """Timers around the engine's parts; ``module_layers``: every step runs layer module
    by layer module, not in one native call."""
    timers.wrap(Scheduler, "schedule", "schedule")
    timers.wrap(Scheduler, "update_from_output", "update")
    timers.wrap(EngineCore, "step", "step")
    timers.wrap(ModelRunner, "_prepare", "prepare")
    timers.wrap(AttentionBackend, "plan", "plan")  # inside forward, counted as preparation
    timers.wrap(ModelRunner, "_sampling_batch", "sampling")
    timers.wrap(Linear, "forward", "matmuls", not_inside="lm_head")
    timers.wrap(Linear, "forward_add", "matmuls")
    timers.wrap(GatedLinear, "forward", "matmuls")  # with its SiLU gate
    timers.wrap(RMSNorm, "forward", "norms")
    timers.wrap(PagedCausalLM, "compute_logits", "lm_head")
    for attention in (NativeDecode, NativePrefill, SdpaDecode, SdpaPrefill):
        timers.wrap(attention, "__call__", "attention")  # after rotary and the store
    timers.wrap(PagedCausalLM, "forward", "forward")
    timers.wrap(TimedDecodeLayers, "run", "decode_layers")
    timers.wrap(TimedDecodeLayers, "run_mixed", "decode_layers")
    pack = LlamaForCausalLM.pack

    def instrumented_pack(self) -> None:
        pack(self)
        if self.decode_layers is not None:
            self.decode_layers = None if module_layers else TimedDecodeLayers(
                self.decode_layers)

    LlamaForCausalLM.pack = instrumented_pack
    timers.wrap(Sampler, "__call__", "sampling")
    schedule = Scheduler.schedule

    def counting_schedule(self, *args, **kwargs):
        start = time.perf_counter()
        output = schedule(self, *args, **kwargs)
        if not output.is_empty:
            timers.work_clocks.append(start)
        return output

    Scheduler.schedule = counting_schedule


def start_engine_timers() -> None:
    """The engine process's setup hook: timers around the engine's parts, whose cumulative
    totals are written to ``$STEP_BREAKDOWN_FILE`` every ``SNAPSHOT_PERIOD_S``."""
    timers = Timers()
    instrument_engine(timers, os.environ.get(MODULE_LAYERS_ENV) == "1")
    path = os.environ[SNAPSHOT_ENV]

    def write_snapshots() -> None:
        while True:
            with open(path + ".tmp", "w") as f:
                json.dump(timers.snapshot(), f)
            os.replace(path + ".tmp", path)
            time.sleep(SNAPSHOT_PERIOD_S)

    threading.Thread(target=write_snapshots, daemon=True).start()


def read_snapshot() -> dict:
    time.sleep(3 * SNAPSHOT_PERIOD_S)  # let the engine write the figures of the last step
    with open(os.environ[SNAPSHOT_ENV]) as f:
        return json.load(f)


def thread_cpu_seconds(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def http_thread_id() -> int:
    for thread in threading.enumerate():
        if thread.name == "tokenmill-http":
            return thread.native_id
    raise RuntimeError("the server's HTTP thread is not running")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(base_url: str) -> None:
    for _ in range(600):
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not start")


def level_breakdown(before: dict, after: dict, loop_seconds: collections.Counter,
                    loop_cpu: float) -> dict:
    s = collections.Counter(after["seconds"])
    s.subtract(before["seconds"])
    steps = max(after["steps"] - before["steps"], 1)
    # from the level's first working step to the end of its last (taken as a mean step)
    clocks = after["work_clocks"][before["steps"]:after["steps"]]
    wall = clocks[-1] - clocks[0] + s["step"] / steps if clocks else 0.0
    parts = {
        "schedule": s["schedule"], "prepare": s["prepare"] + s["plan"],
        "matmuls": s["matmuls"], "attention": s["attention"], "norms": s["norms"],
        "decode_layers": s["decode_layers"],
        "forward_rest": (s["forward"] - s["matmuls"] - s["attention"] - s["norms"] - s["plan"]
                         - s["decode_layers"]),
        "lm_head": s["lm_head"], "sampling": s["sampling"], "update": s["update"]}
    parts["other"] = s["step"] - sum(parts.values())
    parts.update({
        "idle": max(wall - s["step"], 0.0),
        "output_processing": loop_seconds["output_processing"],
        "http_sse": max(loop_cpu - loop_seconds["output_processing"], 0.0),
    })
    return {"steps": after["steps"] - before["steps"], "working_wall_s": wall,
            "ms_per_step": {k: 1000 * v / steps for k, v in parts.items()}}


def drive(args: argparse.Namespace, base_url: str, loop_timers: Timers) -> list[dict]:
    levels = []
    loop_thread = http_thread_id()
    for seed, concurrency in enumerate(args.concurrency):
        with tempfile.NamedTemporaryFile(suffix=".json") as result:
            command = [sys.executable, "-m", "tokenmill.cli", "bench", "--base-url", base_url,
                       "--concurrency", str(concurrency),
                       "--num-requests", str(concurrency * args.requests_per_stream),
                       "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                       "--ignore-eos", "--seed", str(seed), "--no-progress",
                       *(["--logprobs", str(args.logprobs)] if args.logprobs else []),
                       "--result-json", result.name]
            subprocess.run([*command[:-2], "--num-requests", "1", "--seed", "999"],
                           check=True, capture_output=True)  # warm-up
            before = read_snapshot()
            loop_timers.seconds.clear()
            loop_start = thread_cpu_seconds(loop_thread)
            subprocess.run(command, check=True, capture_output=True)
            loop_cpu = thread_cpu_seconds(loop_thread) - loop_start
            after = read_snapshot()
            summary = json.load(open(result.name))["summary"]
        level = level_breakdown(before, after, loop_timers.seconds, loop_cpu)
        level.update(concurrency=concurrency, output_tok_s=summary["output_throughput"])
        levels.append(level)
        print(f"  c{concurrency}: {level['output_tok_s']:.1f} tok/s, {level['steps']} steps",
              flush=True)
    return levels


def print_table(report: dict) -> None:
    table = Table(title="mean ms per engine step (event-loop parts: CPU ms per step)")
    table.add_column("part")
    for level in report["levels"]:
        table.add_column(f"c{level['concurrency']}", justify="right")
        table.add_column("share", justify="right")
    for part in (*ENGINE_PARTS, *LOOP_PARTS):
        cells = []
        for level in report["levels"]:
            ms = level["ms_per_step"]
            total = sum(ms[p] for p in ENGINE_PARTS)
            cells += [f"{ms[part]:.2f}", f"{ms[part] / total:.0%}" if part in ENGINE_PARTS
                      else f"{ms[part] / total:.0%}*"]
        table.add_row(part, *cells, end_section=part == "idle")
    table.add_row("output tok/s", *[c for level in report["levels"]
                                    for c in (f"{level['output_tok_s']:.1f}", "")])
    Console(width=120).print(table)
    print("* event-loop CPU time per step, as a share of the engine step's wall time; it "
          "runs on the same cores")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--requests-per-stream", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--logprobs", type=int, default=None, metavar="N",
                        help="every request asks for the N most likely tokens' log-probabilities")
    parser.add_argument("--module-layers", action="store_true",
                        help="decodes layer module by layer module (splits the decode "
                             "layers' time into matmuls, attention, norms and the rest)")
    parser.add_argument("--out", default="benchmarks/results/step_breakdown.json")
    args, server_args = parser.parse_known_args()
    os.environ[MODULE_LAYERS_ENV] = "1" if args.module_layers else "0"
    server_args = [a for a in server_args if a != "--"]
    loop_timers = Timers()
    loop_timers.wrap(request_state.ChoiceState, "process", "output_processing")
    snapshot_dir = tempfile.mkdtemp()
    os.environ[SNAPSHOT_ENV] = os.path.join(snapshot_dir, "engine_timers.json")
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    report: dict = {"server_args": server_args, "args": vars(args)}

    def run_load() -> None:
        try:
            wait_ready(base_url)
            report["levels"] = drive(args, base_url, loop_timers)
        finally:
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=run_load, daemon=True).start()
    serve_args = cli.parse_args(["serve", "--port", str(port), "--disable-log-stats",
                                 *server_args])
    logging.basicConfig(level=logging.WARNING)
    serve(cli.server_config_from(serve_args), cli.engine_config_from(serve_args),
          engine_setup=start_engine_timers)
    if "levels" in report:
        print_table(report)
        write_report(report, args.out)


if __name__ == "__main__":
    main()
