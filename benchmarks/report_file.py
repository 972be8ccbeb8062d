"""Writing a benchmark's JSON report (shared by the scripts in this folder)."""

from __future__ import annotations

import json
import os


def write_report(report: dict, path: str) -> None:
    """Write ``report`` as indented JSON at ``path`` (creating its folder) and say where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")
