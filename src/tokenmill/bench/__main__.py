"""``python -m tokenmill.bench``: the same as ``tokenmill bench``."""

from __future__ import annotations

import sys

from tokenmill.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
