"""A local stand-in for the Hugging Face Hub, for tests: point ``HF_ENDPOINT`` at
``HubStandIn(repos).url`` and ``huggingface_hub`` lists and downloads the repositories in
``repos`` (repo id -> local folder) from it.

Only the routes ``huggingface_hub`` calls to fetch a model, answered as the Hub answers:

- ``GET /api/models/{repo}[/revision/{rev}]``: the repository's commit and files;
- ``GET /api/models/{repo}/tree/{rev}``: its files, with sizes;
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: a file with ``X-Repo-Commit``, ``ETag``
  and ``Content-Length``; ``Range: bytes=N-`` resumes (206);
- an unknown repository is a 404 with ``X-Error-Code: RepoNotFound``, an unknown file or
  revision ``EntryNotFound`` or ``RevisionNotFound``, as ``huggingface_hub`` expects.

Every request's method and path is kept in ``requests``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

API = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?")
TREE = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?")
RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)")


class HubStandIn:
    def __init__(self, repos: dict[str, str]) -> None:
        self.repos = repos
        self.requests: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    @staticmethod
    def commit(repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def files(self, repo: str) -> list[str]:
        folder = self.repos[repo]
        return sorted(os.path.relpath(os.path.join(d, name), folder)
                      for d, _, names in os.walk(folder) for name in names)


def _handler(hub: HubStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
            self._answer(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append(f"{self.command} {path}")
            for pattern, route in ((TREE, self._tree), (API, self._info),
                                   (RESOLVE, self._resolve)):
                match = pattern.fullmatch(path)
                if match:
                    repo, rev = match["repo"], match["rev"]
                    if repo not in hub.repos:
                        return self._error("RepoNotFound", f"Repository {repo} not found")
                    if rev not in (None, "main", hub.commit(repo)):
                        return self._error("RevisionNotFound", f"Invalid rev id: {rev}", repo)
                    return route(match, body)
            self._error("NotFound", "no such route")

        def _info(self, match: re.Match, body: bool) -> None:
            repo = match["repo"]
            self._json({"id": repo, "modelId": repo, "sha": hub.commit(repo), "private": False,
                        "siblings": [{"rfilename": f} for f in hub.files(repo)]}, body)

        def _tree(self, match: re.Match, body: bool) -> None:
            repo, folder = match["repo"], hub.repos[match["repo"]]
            self._json([{"type": "file", "path": f, "oid": _etag(os.path.join(folder, f)),
                         "size": os.path.getsize(os.path.join(folder, f))}
                        for f in hub.files(repo)], body)

        def _resolve(self, match: re.Match, body: bool) -> None:
            repo, name = match["repo"], match["path"]
            if name not in hub.files(repo):
                return self._error("EntryNotFound", f"{name} does not exist", repo)
            with open(os.path.join(hub.repos[repo], name), "rb") as f:
                data = f.read()
            start = _range_start(self.headers.get("Range"))
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", hub.commit(repo))
            self.send_header("ETag", f'"{_etag(os.path.join(hub.repos[repo], name))}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if body:
                self.wfile.write(data[start:])

        def _json(self, value, body: bool) -> None:
            data = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _error(self, code: str, message: str, repo: str | None = None) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(404)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            if repo is not None:
                self.send_header("X-Repo-Commit", hub.commit(repo))
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(data)

    return Handler


def _etag(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _range_start(header: str | None) -> int:
    match = re.fullmatch(r"bytes=(\d+)-", header or "")
    return int(match[1]) if match else 0
