"""``BenchResult``: what a run returns, and its JSON file.

JSON layout (``format`` names it, so a reader can refuse other files)::

    {"format": "tokenmill-bench/1",
     "info":    {base_url, model, endpoint, load, prompts, prompt_length_method, ...},
     "summary": {every field of stats.Summary; distributions as {count, mean, p50, p90, p99}},
     "notes":   ["...", ...],
     "requests": [RequestRecord.to_json(), ...]}
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from tokenmill.bench.records import RequestRecord
from tokenmill.bench.stats import Summary

FORMAT = "tokenmill-bench/1"


@dataclass
class BenchResult:
    info: dict  # what was measured and how: server, model, load, prompt source, ...
    summary: Summary
    notes: list[str]  # remarks a reader must see (counting fallbacks, approximations)
    requests: list[RequestRecord]

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "info": self.info,
            "summary": asdict(self.summary),
            "notes": self.notes,
            "requests": [r.to_json() for r in self.requests],
        }

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")


def load_result_json(path: str) -> dict:
    """The decoded JSON of a result file; ``ValueError`` if it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc.msg}") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a tokenmill bench result ({FORMAT})")
    return data
