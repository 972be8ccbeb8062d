"""Shared test set-up: no model hub, ever; helper modules importable by name.

Ray, where tests use it, stays on the loopback interface with token authentication, in
this process and in the servers it starts. Ray reads both settings once, when it is
first imported, so they are set here, before any test module imports it: without
them, a driver joining the server's Ray instance at 127.0.0.1 would look for it on the
host's other address and, once there, be refused for lack of a token.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # 127.0.0.1 stays 127.0.0.1
os.environ.setdefault("RAY_AUTH_MODE", "token")  # as a new local Ray instance enables it
for sub in ("unit", "e2e"):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), sub))
sys.path.insert(0, os.path.dirname(__file__))


def pytest_sessionstart(session) -> None:
    """Build the native CPU kernels once, here, before any test starts a server: servers
    then load the finished build instead of each compiling it (or waiting for another
    that does) within its start-up timeout."""
    from tokenmill.kernels import native_kernels

    native_kernels()
