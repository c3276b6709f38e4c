"""Putting the door (appliance.proxy.door) in front of the LiteLLM proxy's app, once, from
inside the proxy's worker, with its settings from the proxy unit's environment; and the process
the proxy runs in, `b70-proxy` (`main`, below).

Imported by the proxy: nothing from the rest of the controller but appliance.proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import logging
import math
import os
import ssl
import sys
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from gunicorn.app.base import BaseApplication
from uvicorn_worker import UvicornWorker

from appliance.hold import PEER_HEADER
from appliance.keys import server_context
from appliance.people import KEYS_FILE, KeyRing
from appliance.proxy import ASGIApp, direct, log
from appliance.proxy.backend import Backend
from appliance.proxy.chain import DEFAULT_MAX_BODY_BYTES, Direct, Hold, HoldNow
from appliance.proxy.door import Door, Readiness
from appliance.proxy.relay import WaitReady
from appliance.proxy.share import fleet, tls
from appliance.proxy.share.fair import DEFAULT_BATCH_WAIT_S, Fair, parse_slots
from appliance.proxy.share.limits import Limits
from appliance.usage import Ledger

M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def router() -> Any:
    """LiteLLM's router in this proxy, once it has one."""
    return getattr(sys.modules.get("litellm.proxy.proxy_server"), "llm_router", None)


def router_models() -> Collection[str] | None:
    """The model names LiteLLM's router serves (the model and its aliases), once it has them."""
    router_ = router()
    names = getattr(router_, "model_names", None)
    if not names:
        return None
    return {*names, *(getattr(router_, "model_group_alias", None) or {})}


def _deployments_of(name: str) -> tuple[list[Any], str] | None:
    """The router's deployments and the model group a name asks for (an alias: its model)."""
    router_ = router()
    if router_ is None:
        return None
    group = (getattr(router_, "model_group_alias", None) or {}).get(name, name)
    if isinstance(group, dict):  # {"model": NAME, "hidden": BOOL}
        group = group.get("model")
    if not isinstance(group, str):
        return None
    return list(getattr(router_, "model_list", None) or ()), group


def direct_to(backend_urls: Collection[str]) -> Direct:
    """Where the router would send a model name, when it has one deployment of it and that is one
    of the appliance's runtimes (appliance.proxy.direct); None when the router must choose."""

    def target(name: str) -> direct.Target | None:
        found = _deployments_of(name)
        return None if found is None else direct.target_of(found[0], found[1], backend_urls)

    return target


def runtimes_of(name: str) -> Mapping[str, Mapping[str, Any]] | None:
    """The appliance's runtimes that may serve a name, each with its engine and APIs, as the
    rendered litellm.yaml gives them (model_info.b70_runtimes); None for a name they do not."""
    found = _deployments_of(name)
    if found is None:
        return None
    out: dict[str, Mapping[str, Any]] = {}
    for deployment in found[0]:
        if deployment.get("model_name") == found[1]:
            given = (deployment.get("model_info") or {}).get("b70_runtimes")
            if isinstance(given, dict):
                out.update({k: v for k, v in given.items() if isinstance(v, dict)})
    return out or None


PEER_PROVIDER = "openai/"  # a peer's proxy, as rendered (templates/litellm.yaml.j2)


class Runtimes:
    """The appliance's runtimes as the proxy sees them: one address per runtime port
    (B70_BACKEND_URL, space-separated), what each says about itself, and which one serves a
    model name; and the peers' proxies (B70_PEER_URL), which serve the same names."""

    def __init__(self, urls: list[str], peers: list[str] | None = None) -> None:
        self.urls = urls
        self.peers = [url.rstrip("/") for url in peers or ()]
        self.backends = {url: Backend(url) for url in urls}

    @property
    def first(self) -> Backend:
        return self.backends[self.urls[0]]

    def url_of(self, model: str | None) -> str:
        """The runtime address of the first of the name's deployments that is the appliance's;
        the first runtime's for a name the router does not know (yet)."""
        found = _deployments_of(model) if model else None
        for deployment in found[0] if found else ():
            if deployment.get("model_name") == found[1]:  # type: ignore[index]
                url = direct.origin_of(deployment, self.urls)
                if url is not None:
                    return url
        return self.urls[0]

    def backend_of(self, model: str) -> Backend:
        return self.backends[self.url_of(model)]

    def replicas_of(self, model: str) -> str | None:
        """The model group, when the name has several deployments and every one of them is one
        of the appliance's runtimes (replicas) or a peer's proxy; None otherwise."""
        found = _deployments_of(model)
        if found is None:
            return None
        deployments = [d for d in found[0] if d.get("model_name") == found[1]]
        if len(deployments) < 2:
            return None
        if any(self.where(d) is None for d in deployments):
            return None
        return found[1]

    def where(self, deployment: Any) -> tuple[str, bool] | None:
        """A deployment's address, and whether it is a peer's; None if it is neither."""
        url = direct.origin_of(deployment, self.urls)
        if url is not None:
            return url, False
        url = direct.origin_of(deployment, self.peers, PEER_PROVIDER)
        return (url, True) if url is not None else None

    def target(self, deployment: Any, group: str) -> direct.Target | None:
        """Where the door sends a request for `group` that the router gave this deployment."""
        found = self.where(deployment)
        if found is None:
            return None
        url, peer = found
        if not peer:
            return direct.target_of([deployment], group, [url])
        key = os.environ.get("LITELLM_MASTER_KEY", "")  # the fleet's one key
        headers = (("Authorization", f"Bearer {key}"), (PEER_HEADER, "1"))
        return direct.target_of([deployment], group, [url], PEER_PROVIDER, headers)


# LiteLLM's middleware that only shapes an answer's headers: CORS (for browsers) and the
# anti-framing and no-sniffing headers. The door's direct way (appliance.proxy.direct) passes
# through them as configured in the proxy, so its answers carry what the other routes' carry.
ANSWER_LAYERS = ("CORSMiddleware", "SecurityHeadersMiddleware")


def answer_layers(server_app: Any) -> Callable[[ASGIApp], ASGIApp]:
    """Wraps an ASGI app in the proxy's ANSWER_LAYERS, in the proxy's order and settings."""
    chosen = [
        m for m in getattr(server_app, "user_middleware", ())
        if getattr(m.cls, "__name__", "") in ANSWER_LAYERS
    ]  # fmt: skip

    def wrap(app: ASGIApp) -> ASGIApp:
        for m in reversed(chosen):  # the first in the list is the outermost
            app = m.cls(app, *m.args, **m.kwargs)
        return app

    return wrap


def max_body_bytes(env: Mapping[str, str]) -> int:
    value = env.get("B70_MAX_BODY_BYTES", "")
    return int(value) if value.isdigit() and int(value) > 0 else DEFAULT_MAX_BODY_BYTES


def hold_seconds(env: Mapping[str, str]) -> float:
    try:
        value = float(env.get("B70_HOLD_S", "300"))
    except ValueError:
        return 300.0
    return value if math.isfinite(value) and value >= 0 else 300.0


def batch_wait_s(env: Mapping[str, str]) -> float:
    try:
        value = float(env.get("B70_BATCH_WAIT_S", str(DEFAULT_BATCH_WAIT_S)))
    except ValueError:
        return DEFAULT_BATCH_WAIT_S
    return value if math.isfinite(value) and value >= 0 else DEFAULT_BATCH_WAIT_S


def batch_share(env: Mapping[str, str]) -> float:
    """[proxy] batch_share, as the unit gives it (B70_BATCH_SHARE); 1 when unset or not one."""
    try:
        value = float(env.get("B70_BATCH_SHARE", "1"))
    except ValueError:
        return 1.0
    return value if 0 < value <= 1 else 1.0


def install(server_app: Any, make: Callable[[ASGIApp], Door]) -> bool:
    """Put the door in front of a Starlette app's middleware stack, built or not; once."""
    if getattr(server_app, "_b70_door", False):
        return False
    server_app._b70_door = True
    stack = server_app.middleware_stack
    if stack is not None:
        server_app.middleware_stack = make(stack)
        return True
    build = server_app.build_middleware_stack
    server_app.build_middleware_stack = lambda: make(build())
    return True


_KEYS: KeyRing | None = None


def key_ring(env: Mapping[str, str] = os.environ) -> KeyRing:
    """The keys this proxy process takes: the master key of its environment and the people of
    the state directory's keys file; one ring for the door and LiteLLM's own key check."""
    global _KEYS
    if _KEYS is None:
        state = env.get("B70_STATE_DIR")
        path = Path(state) / KEYS_FILE if state else None
        _KEYS = KeyRing(path, lambda: os.environ.get("LITELLM_MASTER_KEY", ""), log=log)
    return _KEYS


def _later(delay_s: float, call: Callable[[], None]) -> None:
    """`call` on this worker's event loop after `delay_s` (the usage ledger's next line)."""
    asyncio.get_running_loop().call_later(delay_s, call)


class DoorNotMounted(Exception):
    """Inside the proxy, the door could not be put in front of LiteLLM's app."""


def install_in_proxy(
    wait_ready: WaitReady | None = None,
    hold: Hold | None = None,
    replicas: direct.Replicas | None = None,
    env: Mapping[str, str] = os.environ,
    readiness: Readiness | None = None,
    hold_now: HoldNow | None = None,
) -> Runtimes | None:
    """Put the door in front of the LiteLLM proxy's app, if this process runs one; its runtimes.
    `wait_ready`: the request hold, for requests sent again after the runtime died; `hold`: the
    request hold of the fast way (appliance.proxy.relay), and `hold_now` its first look, which
    does not leave the request's task."""
    server = sys.modules.get("litellm.proxy.proxy_server")
    if server is None:
        return None  # imported outside the proxy (a test, a tool): nothing to stand in front of
    app = getattr(server, "app", None)
    if app is None or not hasattr(app, "middleware_stack"):
        raise DoorNotMounted(
            f"LiteLLM's proxy has no app with a middleware stack to stand in front of "
            f"({type(app).__name__}): a LiteLLM release other than the pinned one?"
        )
    urls = env.get("B70_BACKEND_URL", "").split()
    runtimes = Runtimes(urls, env.get("B70_PEER_URL", "").split()) if urls else None
    limit = max_body_bytes(env)
    hold_s = hold_seconds(env)
    pass_through = env.get("B70_PASS_THROUGH", "1") != "0"
    state = env.get("B70_STATE_DIR")
    keys = key_ring(env)
    limits = Limits(Path(state)) if state else None
    shared = fleet.start(keys, env, Path(state)) if state else None
    if shared is not None:  # front doors that share a Redis: their keys, limits and usage there
        limits = shared[1]
    ledger = Ledger(Path(state), later=_later, log=log) if state else None
    fair = None
    if state and env.get("B70_FAIR", "1") != "0":
        keep = env.get("B70_KEEP_FREE", "0")
        keep_free = int(keep) if keep.isdigit() else 0
        slots = parse_slots(env.get("B70_SLOTS", ""))
        fair = Fair(Path(state), slots, batch_wait_s(env), keep_free, batch_share(env))
    in_clear = serve_tls(env)
    install(
        app,
        lambda inner: Door(
            inner, runtimes.first if runtimes else None, router_models, max_body_bytes=limit,
            wait_ready=wait_ready, hold_s=hold_s, hold=hold,
            direct_to=direct_to(urls) if urls else None, answer_layers=answer_layers(app),
            backend_of=runtimes.backend_of if runtimes else None,
            replicas=replicas if runtimes else None,
            readiness=readiness if runtimes else None, pass_through=pass_through,
            runtimes_of=runtimes_of, keys=keys, limits=limits, ledger=ledger, fair=fair,
            hold_now=hold_now, in_clear=in_clear,
            fleet_usage=shared[2].add if shared is not None else None,
        ),
    )  # fmt: skip
    give_large_blocks_back()
    quiet_access_log()
    freeze_the_loaded_heap()
    return runtimes


def serve_tls(env: Mapping[str, str]) -> tls.InClear | None:
    """With `[proxy] tls` (B70_TLS_CERT, B70_TLS_KEY): the door refuses plain HTTP from afar.
    The worker takes TLS beside plain HTTP already (appliance.proxy.mount); a certificate that
    does not load stops the proxy rather than serve keys in clear."""
    cert, key = env.get("B70_TLS_CERT"), env.get("B70_TLS_KEY")
    if not cert or not key:
        return None
    try:
        certificate = tls.Certificate(Path(cert), Path(key))
    except (OSError, ssl.SSLError) as e:
        raise DoorNotMounted(f"TLS is on, and its certificate {cert} does not load: {e}") from None
    log(f"b70: TLS on the proxy's port, certificate {cert}, SHA-256 {certificate.fingerprint}")
    return tls.InClear(certificate)


def freeze_the_loaded_heap() -> None:
    """Keep the garbage collector's full collections off the requests' path.

    A proxy worker holds LiteLLM whole: millions of objects, loaded once and kept. Python's
    oldest generation is collected whenever it has grown by a quarter, and each of those
    collections walks every one of those objects while the worker's loop serves nobody (every
    stream it relays stops, every request it was given waits). Called once, when the worker has
    loaded its config and router and before it serves: what is loaded by then is collected once
    and the rest set aside for good (gc.freeze), so later collections walk only what came after
    (docs/proxy.md: `scripts/bench-proxy --parts phases` prints the longest). That leaves out of
    the collections only objects that live as long as the worker; cycles made later are
    collected as usual."""
    gc.collect()
    gc.freeze()


def quiet_access_log() -> None:
    """No journal line per request. b70-proxy gives gunicorn no access log, and run another way
    (LiteLLM's CLI gives gunicorn one on stdout) the `uvicorn.access` logger would write one line
    per request; that costs every request CPU in the worker and in journald, which is why
    LITELLM_LOG=ERROR keeps LiteLLM's own per-request lines out too."""
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)


def give_large_blocks_back() -> None:
    """Make glibc return every block of 128 KiB or more to the system when it is freed.

    Refused bodies are read (up to the limit) and parsed here, in blocks of up to megabytes. By
    default glibc raises its mmap threshold each time such a block is freed, so the next ones come
    from the heap and stay in the proxy's RSS, which grows with every large refused body. A fixed
    threshold (M_MMAP_THRESHOLD, as MALLOC_MMAP_THRESHOLD_=131072 in the environment would set)
    gives them back (tests/test_door_real.py holds the RSS after rounds of refused bodies
    within 10 % of what it was). Elsewhere than glibc this does nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 * 1024)


# --- b70-proxy: the proxy's process ---------------------------------------------------------------
# The proxy's process, `b70-proxy`: LiteLLM's app under gunicorn, on systemd's listening socket.
#
#     b70-proxy --config litellm.yaml --host HOST --port PORT --workers N
#
# It runs LiteLLM's proxy as `litellm --config F --num_workers N --run_gunicorn` would: the master
# loads LiteLLM's app once, forks N uvicorn workers and starts a dead one again, and each worker
# loads the config named by CONFIG_FILE_PATH (LiteLLM's documented variable for it) when it starts,
# and with it the door (appliance.proxy.hook). Gunicorn takes its socket from systemd (LISTEN_FDS,
# LISTEN_PID); run by hand, it binds HOST:PORT itself.
#
# Run here rather than through LiteLLM's CLI for one reason: the worker class. LiteLLM's CLI fixes
# it, and the appliance's worker (`Worker`) is uvicorn's gunicorn worker with settings of its own,
# given the way the uvicorn-worker package documents (a subclass with CONFIG_KWARGS). With
# `[proxy] tls` on, those settings give uvicorn's Config an HTTP protocol class (its `http=`, which
# takes one) that reads each connection's first byte: TLS and plain HTTP on the one port
# (appliance.proxy.share.tls). Nothing else about LiteLLM's start changes.

TIMEOUT_S = 600  # a worker silent this long is killed and started again (LiteLLM's own figure)


def worker_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """What the workers' uvicorn Config takes beside uvicorn-worker's own settings."""
    cert, key = env.get("B70_TLS_CERT"), env.get("B70_TLS_KEY")
    if not cert or not key:
        return {}
    return {"http": tls.beside_plain(tls.Certificate(Path(cert), Path(key)))}


class Worker(UvicornWorker):  # type: ignore[misc]
    """uvicorn-worker's worker, with the appliance's settings (worker_settings)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.CONFIG_KWARGS = {**UvicornWorker.CONFIG_KWARGS, **worker_settings(os.environ)}
        super().__init__(*args, **kwargs)


class Proxy(BaseApplication):  # type: ignore[misc]
    """Gunicorn, told its settings here rather than by a command line or a file of its own."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        super().__init__()

    def load_config(self) -> None:
        for name, value in self.options.items():
            self.cfg.set(name, value)

    def load(self) -> Any:
        from litellm.proxy.proxy_server import app

        return app


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def options(host: str, port: int, workers: int) -> dict[str, Any]:
    return {
        "bind": [bind_address(host, port)],
        "workers": workers,
        "worker_class": f"{__name__}.Worker",
        "preload_app": True,  # LiteLLM is loaded once, in the master, and shared by the forks
        "timeout": TIMEOUT_S,
        "accesslog": None,  # no line per request: each costs the worker and journald CPU
    }


def problem(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    """What stops the proxy before gunicorn starts, said in one line."""
    if not args.config.is_file():
        return f"the proxy's config {args.config} is not a file: run `b70ctl install`"
    if not 0 < args.port < 65536:
        return f"--port {args.port} is not a TCP port (1-65535)"
    if args.workers < 1:
        return f"--workers {args.workers}: at least one worker serves"
    cert, key = env.get("B70_TLS_CERT"), env.get("B70_TLS_KEY")
    if bool(cert) != bool(key):
        return "TLS needs both B70_TLS_CERT and B70_TLS_KEY: run `b70ctl install` again"
    if cert and key:
        try:
            server_context(Path(cert), Path(key))
        except (OSError, ssl.SSLError) as e:
            return f"TLS is on, and its certificate {cert} with key {key} does not load: {e}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="b70-proxy", description="The appliance's proxy: LiteLLM's app under gunicorn."
    )
    parser.add_argument("--config", type=Path, required=True, help="LiteLLM's config (YAML)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    said = problem(args, os.environ)
    if said:
        print(f"b70-proxy: {said}", file=sys.stderr, flush=True)
        return 2
    os.environ["CONFIG_FILE_PATH"] = str(args.config.resolve())
    os.environ["NUM_WORKERS"] = str(args.workers)
    Proxy(options(args.host, args.port, args.workers)).run()
    return 0
