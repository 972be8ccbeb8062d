"""Tables for the terminal (rich): one run's report, and two runs side by side.

Both read the JSON form of a result (``BenchResult.to_json()``), so ``compare`` works on
files written by any earlier run. ``figures()`` is the one list of rows both print.
"""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.table import Table

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL"))
STATS = ("mean", "p50", "p90", "p99")
MAX_ERRORS_SHOWN = 5


def figures(summary: dict) -> list[tuple[str, float | int | None]]:
    """(label, value) for every figure of a summary, in report order."""
    rows: list[tuple[str, float | int | None]] = [
        ("requests ok", summary["num_ok"]),
        ("requests failed", summary["num_failed"]),
        ("requests cut off", summary["num_cut_off"]),
        ("duration (s)", summary["duration_s"]),
        ("request throughput (req/s)", summary["request_throughput"]),
        ("output token throughput (tok/s)", summary["output_throughput"]),
        ("total token throughput (tok/s)", summary["total_token_throughput"]),
        ("prompt tokens", summary["total_prompt_tokens"]),
        ("output tokens", summary["total_output_tokens"]),
        # NOTE: .get: results written before these figures existed lack them
        ("tokens per chunk (mean)", summary.get("mean_tokens_per_chunk")),
        ("tokens per chunk (max)", summary.get("max_tokens_per_chunk")),
        ("load generator CPU (cores)", summary.get("client_cpus")),
    ]
    for key, name in LATENCIES:
        rows.extend((f"{name} {stat} (ms)", summary[key][stat]) for stat in STATS)
    if summary["goodput"] is not None:
        slos = " ".join(f"{k}<={v:g}ms" for k, v in summary["goodput_slos_ms"].items())
        rows.append((f"goodput (req/s, {slos})", summary["goodput"]))
    return rows


def fmt(value: float | int | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.2f}"


def print_report(result: dict, console: Console) -> None:
    info, summary = result["info"], result["summary"]
    console.print(f"[bold]tokenmill bench[/bold]: {info['model']} at {info['base_url']} "
                  f"({info['endpoint']})")
    console.print(f"load: {info['load']}; prompts: {info['prompts']}")
    table = Table(show_header=True, header_style="bold")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for label, value in figures(summary):
        table.add_row(label, fmt(value))
    console.print(table)
    methods = ", ".join(f"{m}: {n}" for m, n in summary["counting_methods"].items()) or "-"
    console.print(f"token counting: {summary['counting_method']} ({methods}); "
                  f"prompt lengths: {info['prompt_length_method']}")
    for note in result["notes"]:
        console.print(f"note: {note}")
    errors = Counter(r["error"] for r in result["requests"] if r["status"] == "failed")
    for error, num in errors.most_common(MAX_ERRORS_SHOWN):
        console.print(f"failed x{num}: {error}", markup=False)


def print_comparison(a: dict, b: dict, a_name: str, b_name: str, console: Console) -> None:
    """Figures of runs A and B side by side, with B/A ("-" where A is 0 or missing)."""
    for tag, name, run in (("A", a_name, a), ("B", b_name, b)):
        info = run["info"]
        console.print(f"{tag}: {name}: {info['model']} at {info['base_url']}; {info['load']}",
                      markup=False)
    table = Table(show_header=True, header_style="bold")
    table.add_column("figure")
    for column in ("A", "B", "B/A"):
        table.add_column(column, justify="right")
    b_rows = dict(figures(b["summary"]))
    for label, a_value in figures(a["summary"]):
        b_value = b_rows.get(label)
        table.add_row(label, fmt(a_value), fmt(b_value), ratio(a_value, b_value))
    console.print(table)


def ratio(a: float | int | None, b: float | int | None) -> str:
    if a is None or b is None or a == 0:
        return "-"
    return f"{b / a:.3f}"
