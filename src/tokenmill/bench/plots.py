"""PNG plots of a run (matplotlib, Agg canvas; no pyplot, no global backend state).

- ``latency_cdf.png``: CDFs of TTFT, TPOT, ITL and E2EL over the same requests as
  the figures (``stats.py``: TTFT and ITL include cut-off requests);
- ``output_throughput.png``: output tokens/s over time, from every request's chunks
  (partial requests included), in bins of ``bin_s``;
- ``ttft_vs_prompt.png``: TTFT against prompt length, one point per request with a TTFT.

Bins: the run is cut into ``NUM_BINS`` bins of ``bin_s`` (at least ``MIN_BIN_S``)::

    0      bin_s    2 bin_s   ...   (n-1) bin_s   duration
    |  b0   |   b1   |   ...   |  b(n-1)  |             token at run time t -> bin t // bin_s
    rate of a bin = its tokens / its width (the last bin may be narrower)
"""

from __future__ import annotations

import math
import os

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

NUM_BINS = 50
MIN_BIN_S = 0.1
OK, TIMED = ("ok",), ("ok", "cut_off")
LATENCY_KEYS = (("ttft_s", "TTFT", TIMED), ("tpot_s", "TPOT", OK), ("itl_s", "ITL", TIMED),
                ("e2e_s", "E2EL", OK))


def write_plots(result: dict, directory: str) -> list[str]:
    """Write the three plots of ``result`` (its JSON form) into ``directory``; return paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, draw in (("latency_cdf.png", _latency_cdfs),
                       ("output_throughput.png", _throughput_over_time),
                       ("ttft_vs_prompt.png", _ttft_vs_prompt)):
        fig = Figure(figsize=(8, 5), layout="constrained")
        FigureCanvasAgg(fig)
        draw(fig, result)
        path = os.path.join(directory, name)
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths


def _having(result: dict, statuses: tuple[str, ...]) -> list[dict]:
    return [r for r in result["requests"] if r["status"] in statuses]


def _latency_cdfs(fig: Figure, result: dict) -> None:
    axes = fig.subplots(2, 2).flat
    for ax, (key, name, statuses) in zip(axes, LATENCY_KEYS, strict=True):
        values = []
        for r in _having(result, statuses):
            value = r[key]
            values.extend(value if isinstance(value, list) else [value])
        ms = sorted(v * 1000.0 for v in values if v is not None)
        if ms:
            ax.step(ms, [(i + 1) / len(ms) for i in range(len(ms))], where="post")
        ax.set_title(f"{name} ({len(ms)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
    fig.suptitle(f"latency CDFs: {result['info']['model']}")


def _throughput_over_time(fig: Figure, result: dict) -> None:
    duration_s = result["summary"]["duration_s"]
    bin_s = max(duration_s / NUM_BINS, MIN_BIN_S)
    counts = [0] * max(1, math.ceil(duration_s / bin_s))
    for r in result["requests"]:
        for offset_s, tokens in r["chunks"]:
            index = min(int((r["start_s"] + offset_s) / bin_s), len(counts) - 1)
            counts[index] += tokens
    # the last bin ends with the run, so it may be narrower than the others
    edges = [i * bin_s for i in range(len(counts))] + [max(duration_s, (len(counts) - 1) * bin_s)]
    widths = [max(b - a, 1e-9) for a, b in zip(edges, edges[1:], strict=False)]
    ax = fig.subplots()
    ax.stairs([c / w for c, w in zip(counts, widths, strict=True)], edges)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"output throughput over time (bins of {bin_s:.2f} s)")
    ax.grid(alpha=0.3)


def _ttft_vs_prompt(fig: Figure, result: dict) -> None:
    points = [(r["prompt_tokens"], r["ttft_s"] * 1000.0)
              for r in _having(result, TIMED) if r["ttft_s"] is not None]
    ax = fig.subplots()
    ax.scatter([p for p, _ in points], [t for _, t in points], s=12)
    ax.set_xlabel(f"prompt tokens ({result['info']['prompt_length_method']} or server usage)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT vs prompt length")
    ax.grid(alpha=0.3)
