"""Shared test set-up: no model hub, ever; helper modules importable by name."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
for sub in ("unit", "e2e"):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), sub))
sys.path.insert(0, os.path.dirname(__file__))
