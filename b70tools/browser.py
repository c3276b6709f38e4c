"""Headless Chromium (Debian's package), driven from Python over the DevTools protocol.

Chromium writes the port it chose to DevToolsActivePort in its profile; the page target's
websocket takes commands ({"id", "method", "params"}) and sends their results and events.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import websocket  # websocket-client


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, width: int = 1280, height: int = 900, flags: tuple[str, ...] = ()) -> None:
        """`flags`: more of Chromium's command line, such as --host-resolver-rules."""
        exe = chromium()
        if exe is None:
            raise RuntimeError("chromium is not installed (Debian: apt-get install chromium)")
        self.profile = Path(tempfile.mkdtemp(prefix="b70-chromium."))
        self.process = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
             f"--window-size={width},{height}", *flags, "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.events: list[dict[str, Any]] = []
        self._next = 0
        try:
            port = self._port()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                target = next(t for t in json.load(r) if t["type"] == "page")
            self.ws = websocket.create_connection(target["webSocketDebuggerUrl"], timeout=30)
            self.send("Page.enable")
            self.send("Network.enable")
        except BaseException:
            self.close()
            raise

    def _port(self) -> int:
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if marker.exists() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited {self.process.returncode}")
            time.sleep(0.05)
        raise RuntimeError("chromium did not open its DevTools port within 30 s")

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        self._next += 1
        self.ws.send(json.dumps({"id": self._next, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self._next:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))
            self.events.append(message)

    def evaluate(self, expression: str, await_promise: bool = False) -> Any:
        """The expression's value; with `await_promise`, the value its promise settles to."""
        params = {"expression": expression, "returnByValue": True, "awaitPromise": await_promise}
        result = self.send("Runtime.evaluate", **params)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def goto(self, url: str) -> None:
        self.events.clear()
        self.send("Page.navigate", url=url)

    def wait_for(self, expression: str, timeout_s: float, what: str) -> Any:
        """The expression's first truthy value; one that throws (the page not there yet) is
        asked again."""

        def probe() -> Any:
            try:
                return self.evaluate(expression)
            except RuntimeError:
                return None

        return wait(probe, timeout_s, what)

    def screenshot(self, path: Path) -> None:
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data["data"]))

    def status_of(self, url: str) -> int | None:
        """The HTTP status of the last response for `url` seen since the last goto(), if any."""
        for e in reversed(self.events):
            response = e.get("params", {}).get("response", {})
            if e.get("method") == "Network.responseReceived" and response.get("url") == url:
                return int(response["status"])
        return None

    def bytes_received(self) -> int:
        """Bytes on the wire for every request finished since the last goto()."""
        return int(
            sum(
                e["params"]["encodedDataLength"]
                for e in self.events
                if e.get("method") == "Network.loadingFinished"
            )
        )

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()
        # Chromium's helpers (renderer, GPU, crash handler) are in its session, and one left
        # running may write into the profile after it is removed: the whole group goes.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait(probe: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.1) -> Any:
    """The first truthy answer of `probe`, or AssertionError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s (last: {value!r})")
        time.sleep(every_s)
