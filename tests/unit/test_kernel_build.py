"""The kernels' build is cached under a name made from its sources: every file the build
compiles or includes must be among them, or an edit to it would load the stale build."""

from __future__ import annotations

from pathlib import Path

from tokenmill.kernels.build import HEADERS, SOURCES


def test_the_cache_name_covers_every_kernel_file() -> None:
    folder = Path(SOURCES[0]).parent
    assert set(SOURCES) == set(folder.glob("*.cpp"))
    assert set(HEADERS) == set(folder.glob("*.h"))
