"""A folder served over HTTP in the Hugging Face hub's URL layout, for the tests and the system
box, where no hub can be reached: the tree listing of a repository at main (recursive, in pages
with a Link header to the next, each file with its size and git blob id, and a large one with its
LFS SHA-256), /resolve/main/PATH answered by a redirect to the file, Range requests for a
resumed download. A gated repository, a cut download and a corrupted file are the server's doing
when a test asks.

    python3 -m b70tools.hubdir ROOT [--port P]     ROOT/OWNER/REPO/FILES; prints its URL
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import json
import sys
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GGUF_LFS = (".gguf", ".safetensors")


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Hub:
    root: Path  # OWNER/REPO/FILES
    port: int = 0
    cut_after: int | None = None  # the next download ends after this many bytes
    corrupt: set[str] = field(default_factory=set)  # files served with a byte changed
    gated: set[str] = field(default_factory=set)  # repositories that need the token
    token: str = "hf_test"
    page: int = 2  # entries per page of the listing
    ranges: list[str] = field(default_factory=list)  # the Range headers seen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def listing(self, repo: str) -> list[dict[str, Any]]:
        base = self.root / repo
        out: list[dict[str, Any]] = []
        for path in sorted(base.rglob("*")):
            rel = path.relative_to(base).as_posix()
            if path.is_dir():
                out.append({"type": "directory", "path": rel, "oid": "0" * 40, "size": 0})
                continue
            data = path.read_bytes()
            entry: dict[str, Any] = {"type": "file", "path": rel, "size": len(data),
                                     "oid": git_oid(data)}  # fmt: skip
            if rel.endswith(GGUF_LFS):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                "pointerSize": 134}  # fmt: skip
            out.append(entry)
        return out


def _handler(hub: Hub) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _json(self, code: int, doc: Any, headers: dict[str, str] | None = None) -> None:
            body = json.dumps(doc).encode()
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            parts = url.path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and parts[4:6] == ["tree", "main"]:
                repo = "/".join(parts[2:4])
                if repo in hub.gated and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._json(401, {"error": "gated"})
                if not (hub.root / repo).is_dir():
                    return self._json(404, {"error": "Repository not found"})
                entries = hub.listing(repo)
                start = int(urllib.parse.parse_qs(url.query).get("cursor", ["0"])[0])
                page = entries[start : start + hub.page]
                headers = {}
                if start + hub.page < len(entries):
                    nxt = f"{hub.url}{url.path}?recursive=true&cursor={start + hub.page}"
                    headers["Link"] = f'<{nxt}>; rel="next"'
                return self._json(200, page, headers)
            if len(parts) > 4 and parts[2:4] == ["resolve", "main"]:  # to the "CDN"
                self.send_response(302)
                self.send_header("Location", "/cdn/" + "/".join(parts[:2] + parts[4:]))
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            if parts[0] == "cdn":
                return self._file(hub.root.joinpath(*[urllib.parse.unquote(p) for p in parts[1:]]))
            return self._json(404, {"error": "no such route"})

        def _file(self, path: Path) -> None:
            data = bytearray(path.read_bytes())
            if path.name in hub.corrupt:
                data[-1] ^= 0xFF
            start = 0
            if (given := self.headers.get("Range")) is not None:
                hub.ranges.append(given)
                start = int(given.split("=")[1].split("-")[0])
            body = bytes(data[start:])
            self.send_response(206 if start else 200)
            self.send_header("Content-Length", str(len(body)))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if hub.cut_after is not None:
                self.wfile.write(body[: hub.cut_after])
                hub.cut_after = None
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler


def serve(hub: Hub, host: str = "127.0.0.1") -> http.server.ThreadingHTTPServer:
    """The server, bound (hub.port set to its port), not yet serving."""
    server = http.server.ThreadingHTTPServer((host, hub.port), _handler(hub))
    hub.port = server.server_address[1]
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--port", type=int, default=0)
    given = parser.parse_args()
    hub = Hub(given.root, port=given.port)
    server = serve(hub)
    print(hub.url, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
