"""A local stand-in for the Hugging Face hub's HTTP API, so that ``huggingface_hub``'s real download code runs.

It answers what ``snapshot_download`` asks (``HF_ENDPOINT`` pointed at it): model info at a revision
(``/api/models/ORG/NAME[/revision/REV]``), the tree listing (``/api/models/ORG/NAME/tree/REV``) and files
(``HEAD``/``GET /ORG/NAME/resolve/REV/PATH`` with ``X-Repo-Commit``, ``ETag``, ``Content-Length``), with the
hub's error codes (``X-Error-Code``: RepoNotFound, RevisionNotFound, GatedRepo, EntryNotFound). Every file
request is recorded, so a test sees exactly which files the client fetched. Nothing in huggingface_hub is
replaced: the client is the real one, only the server is local.
"""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.parse
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from hub_cache import commit_hash, git_blob_sha1, is_lfs


class FakeHub:
    """Repositories (id -> {commit: files}) with refs (id -> {branch or tag: commit}); ``gated`` ids refuse files."""

    def __init__(self) -> None:
        self.commits: dict[str, dict[str, dict[str, bytes]]] = {}
        self.refs: dict[str, dict[str, str]] = {}
        self.gated: set[str] = set()
        self.requested: list[tuple[str, str, str]] = []  # (method, repo id, file) of every file request
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, repo_id: str, files: Mapping[str, bytes], refs: tuple[str, ...] = ("main",)) -> str:
        """Add a commit of ``repo_id`` holding ``files`` and point ``refs`` at it; return its hash."""
        commit = commit_hash(repo_id, files)
        self.commits.setdefault(repo_id, {})[commit] = dict(files)
        for ref in refs:
            self.refs.setdefault(repo_id, {})[ref] = commit
        return commit

    def files_requested(self, method: str = "GET") -> list[str]:
        return sorted(f"{repo}/{name}" for m, repo, name in self.requested if m == method)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _commit(self, repo_id: str, revision: str) -> str | None:
        revision = urllib.parse.unquote(revision)
        if revision in self.commits.get(repo_id, {}):
            return revision
        return self.refs.get(repo_id, {}).get(revision)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._answer(head=True)

            def do_GET(self) -> None:
                self._answer(head=False)

            def _send(self, status: int, body: bytes = b"", headers: Mapping[str, str] | None = None, head=False):
                self.send_response(status)
                for key, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
                    self.send_header(key, value)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _error(self, status: int, code: str, message: str, head: bool, commit: str | None = None) -> None:
                headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}
                if commit:
                    headers["X-Repo-Commit"] = commit
                self._send(status, json.dumps({"error": message}).encode(), headers, head)

            def _answer(self, head: bool) -> None:
                path = urllib.parse.urlparse(self.path).path
                parts = path.strip("/").split("/")
                api = parts[:2] == ["api", "models"]
                repo_id = "/".join(parts[2:4] if api else parts[:2])
                if repo_id not in hub.commits:
                    return self._error(404, "RepoNotFound", "Repository not found", head)
                if api and len(parts) == 4:  # model info of the default branch
                    parts += ["revision", "main"]
                if api and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                    commit = hub._commit(repo_id, parts[5])
                    if commit is None:
                        return self._error(404, "RevisionNotFound", f"Invalid rev id: {parts[5]}", head)
                    files = hub.commits[repo_id][commit]
                    if parts[4] == "revision":
                        info = {"id": repo_id, "sha": commit, "siblings": [{"rfilename": f} for f in sorted(files)]}
                        return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
                    tree = [_tree_entry(name, data) for name, data in sorted(files.items())]
                    return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head)
                if not api and len(parts) >= 5 and parts[2] == "resolve":
                    commit = hub._commit(repo_id, parts[3])
                    if commit is None:
                        return self._error(404, "RevisionNotFound", f"Invalid rev id: {parts[3]}", head)
                    name = urllib.parse.unquote("/".join(parts[4:]))
                    hub.requested.append(("HEAD" if head else "GET", repo_id, name))
                    if repo_id in hub.gated:
                        return self._error(401, "GatedRepo", "Access to this model is restricted", head, commit)
                    data = hub.commits[repo_id][commit].get(name)
                    if data is None:
                        return self._error(404, "EntryNotFound", f"{name} does not exist", head, commit)
                    etag = hashlib.sha256(data).hexdigest() if is_lfs(name) else git_blob_sha1(data)
                    return self._send(200, data, {"X-Repo-Commit": commit, "ETag": f'"{etag}"'}, head)
                return self._error(404, "EntryNotFound", f"no route {path}", head)

        return Handler


def _tree_entry(name: str, data: bytes) -> dict:
    entry = {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": name}
    if is_lfs(name):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry
