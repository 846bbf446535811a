"""A small Hub-compatible HTTP server on 127.0.0.1 for push / download tests (no network, no LFS).

It answers the endpoints that ``huggingface_hub`` 2.x calls for ``create_repo``, ``upload_folder`` /
``create_commit`` (preupload answers ``uploadMode: regular``, so file bytes arrive base64-encoded in
the NDJSON commit body), ``repo_info``, ``list_repo_tree``, ``snapshot_download`` / ``hf_hub_download``
(``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` with ``X-Repo-Commit``, ``ETag``, ``Content-Length``),
``whoami`` and ``validate-yaml`` (the endpoints huggingface_hub's client calls). Every ``/api`` write needs
``Authorization: Bearer <token>``; a wrong token gets 401. ``fail_with`` makes every request answer
that status (a "failing server"). Everything pushed is kept in ``server.repos[repo_id][path] = bytes``
and each request's path and headers in ``server.requests`` so tests can inspect them.

    with FakeHub(token="hf_test") as hub:
        os.environ["HF_ENDPOINT"] = hub.endpoint
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

USER = "tester"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self, token: str = "hf_fake_token_for_tests"):
        self.token = token
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: dict[str, str] = {}
        self.requests: list[tuple[str, str, dict]] = []
        self.fail_with: int | None = None
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def commit(self, repo_id: str) -> str:
        return self.commits.get(repo_id, "0" * 40)


def _make_handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep test output clean
            pass

        # -- helpers -------------------------------------------------------------------------
        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, content_type="application/json"):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, status: int, payload, headers: dict | None = None):
            self._send(status, json.dumps(payload).encode(), headers)

        def _not_found(self, code="EntryNotFound"):
            self._json(404, {"error": code}, {"X-Error-Code": code, "X-Error-Message": code})

        def _body(self) -> bytes:
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def _authorized(self) -> bool:
            if self.headers.get("Authorization") == f"Bearer {hub.token}":
                return True
            self._json(401, {"error": "Invalid credentials in Authorization header"},
                       {"X-Error-Message": "Invalid credentials in Authorization header"})
            return False

        def _dispatch(self):
            path = unquote(urlparse(self.path).path)
            hub.requests.append((self.command, path, dict(self.headers)))
            if hub.fail_with is not None:
                self._body()
                return self._json(hub.fail_with, {"error": "server failure (fake hub)"})
            for pattern, method, handler in ROUTES:
                match = re.fullmatch(pattern, path)
                if match and method == self.command or (match and method == "GET" and self.command == "HEAD"):
                    return handler(self, *match.groups())
            self._body()
            return self._not_found("NotFound")

        do_GET = do_POST = do_HEAD = do_PUT = _dispatch

        # -- routes --------------------------------------------------------------------------
        def whoami(self):
            if self._authorized():
                self._json(200, {"type": "user", "name": USER, "fullname": "Test User", "orgs": [],
                                 "auth": {"accessToken": {"displayName": "test", "role": "write"}}})

        def create_repo(self):
            body = json.loads(self._body() or b"{}")
            if not self._authorized():
                return
            repo_id = f"{body.get('organization') or USER}/{body['name']}"
            url = f"{hub.endpoint}/{repo_id}"
            if repo_id in hub.repos:
                return self._json(409, {"error": "You already created this model repo", "url": url})
            hub.repos[repo_id] = {}
            self._json(200, {"url": url, "name": repo_id})

        def validate_yaml(self):
            self._body()
            self._json(200, {})

        def preupload(self, repo_id, revision):
            body = json.loads(self._body() or b"{}")
            if not self._authorized():
                return
            if repo_id not in hub.repos:
                return self._not_found("RepoNotFound")
            files = []
            for entry in body.get("files", []):
                existing = hub.repos[repo_id].get(entry["path"])
                files.append({"path": entry["path"], "uploadMode": "regular", "shouldIgnore": False,
                              "oid": git_blob_sha1(existing) if existing is not None else None})
            self._json(200, {"files": files, "commitOid": hub.commit(repo_id)})

        def commit(self, repo_id, revision):
            raw = self._body()
            if not self._authorized():
                return
            if repo_id not in hub.repos:
                return self._not_found("RepoNotFound")
            for line in raw.decode().splitlines():
                if not line.strip():
                    continue
                item = json.loads(line)
                value = item["value"]
                if item["key"] == "file":
                    hub.repos[repo_id][value["path"]] = base64.b64decode(value["content"])
                elif item["key"] == "deletedFile":
                    hub.repos[repo_id].pop(value["path"], None)
                elif item["key"] == "lfsFile":
                    return self._json(400, {"error": "the fake hub does not store LFS files"})
            oid = hashlib.sha1(json.dumps(sorted((p, git_blob_sha1(b)) for p, b in hub.repos[repo_id].items()))
                               .encode()).hexdigest()
            hub.commits[repo_id] = oid
            self._json(200, {"commitUrl": f"{hub.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid,
                             "success": True})

        def repo_info(self, repo_id, revision=None):
            if repo_id not in hub.repos:
                return self._not_found("RepoNotFound")
            files = hub.repos[repo_id]
            self._json(200, {"id": repo_id, "modelId": repo_id, "sha": hub.commit(repo_id), "private": False,
                             "siblings": [{"rfilename": p, "size": len(b)} for p, b in sorted(files.items())],
                             "tags": [], "downloads": 0, "likes": 0})

        def tree(self, repo_id, revision, prefix=None):
            if repo_id not in hub.repos:
                return self._not_found("RepoNotFound")
            prefix = (prefix or "").strip("/")
            entries = [{"type": "file", "path": p, "size": len(b), "oid": git_blob_sha1(b)}
                       for p, b in sorted(hub.repos[repo_id].items()) if not prefix or p.startswith(prefix + "/")]
            self._json(200, entries)

        def resolve(self, repo_id, revision, filename):
            files = hub.repos.get(repo_id)
            if files is None:
                return self._not_found("RepoNotFound")
            if filename not in files:
                return self._not_found("EntryNotFound")
            data = files[filename]
            self._send(200, data, {"X-Repo-Commit": hub.commit(repo_id), "ETag": f'"{git_blob_sha1(data)}"'},
                       content_type="application/octet-stream")

    repo = r"([\w.-]+/[\w.-]+)"
    ROUTES = [
        (r"/api/whoami-v2", "GET", Handler.whoami),
        (r"/api/repos/create", "POST", Handler.create_repo),
        (r"/api/validate-yaml", "POST", Handler.validate_yaml),
        (rf"/api/models/{repo}/preupload/([^/]+)", "POST", Handler.preupload),
        (rf"/api/models/{repo}/commit/([^/]+)", "POST", Handler.commit),
        (rf"/api/models/{repo}/revision/([^/]+)", "GET", Handler.repo_info),
        (rf"/api/models/{repo}", "GET", Handler.repo_info),
        (rf"/api/models/{repo}/tree/([^/]+)(/.*)?", "GET", Handler.tree),
        (rf"/{repo}/resolve/([^/]+)/(.+)", "GET", Handler.resolve),
    ]
    return Handler
