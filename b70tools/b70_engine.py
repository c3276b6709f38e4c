"""A B70 stand-in engine: vLLM or llama-server as B70 owners' logs say they behave on the card,
for the suite to run the appliance at a B70's times without one.

    python -m b70tools.b70_engine vllm --model DIR --host H --port P [vllm serve's flags]
    python -m b70tools.b70_engine llamacpp -m FILE --host H --port P [llama-server's flags]

It takes each runtime's real flags (examples/b70.toml's), and:
- loads for as long as a B70 takes: vLLM's weights at 1.15 s a GiB (19.66 GiB in 22.6 s,
  MidasMining/llm-bench L10; 8.42 GiB in 7.0 s, hotschmoe L1), then its engine's profile,
  cache and warm-up, 228 s with torch.compile (L1: "init engine ... took 228.37 s (compilation:
  208.52 s)") or 49 s without (--enforce-eager; intel/llm-scaler#339: 49.46 s), but 17 s where
  an earlier start of its recipe left its compiled graph in vLLM's cache folder
  (VLLM_CACHE_ROOT: it writes the graph there after a compiled start, and reads it back, so that
  a cache folder that is not kept, or not mounted, shows as a cold start); llama-server's
  model at 1.15 s a GiB too (no B70 log states it: an estimate). B70_STANDIN_SCALE shortens
  every one of these (0.05: a vLLM start of about 14 s);
- holds the memory the plan says (appliance.measure.capacity: the weights, then
  --gpu-memory-utilization of the card once its cache is made), on a fixture B70: under
  B70_SYSROOT it adds its own /proc/PID with DRM fdinfo and raises the render node's used
  VRAM, as the xe driver would show it (b70tools.gpu_trees' formats); `Driver` frees it after
  the process has gone, as the kernel does;
- serves as many requests at once as vLLM would (--max-num-seqs; llama-server's --parallel),
  each token at the seed's time: 12 ms + 0.5 ms per running request, so 64 at once make
  1455 tok/s (the seed measured 1420-1510 tok/s at 64 users) and llama.cpp's one slot 13.8 ms
  (69.7-75.7 tok/s measured); B70_STANDIN_TOKEN_SCALE scales it;
- writes the engine's real start-up lines (appliance.measure.startlog) and metric names;
- with B70_STANDIN_TRACE=1 logs each request it is sent (its path, client and max_tokens);
- with B70_STANDIN_FAIL=NAME prints a real B70 failure's lines (appliance.host.failures) where
  the engine printed them, and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from b70tools import gpu_trees

GIB = 1024**3
LOAD_S_PER_GIB = 22.592 / 19.66
INIT_S = {"compiled": 228.37, "eager": 49.46}
COMPILE_S = 208.52  # of the compiled start's 228.37 s (hotschmoe/b70_ai_things, L1)
# Once the compile cache was kept: 6-17 s (hotschmoe/b70_ai_things); the stand-in takes the
# slowest of them. No log gives the compilation figure of such a start, so it prints none.
WARM_INIT_S = 17.0
START_S = 15.0  # the process, its imports and its workers, before the weights
WORDS = [
    "the",
    "card",
    "holds",
    "the",
    "model",
    "and",
    "its",
    "cache",
    "while",
    "requests",
    "come",
    "and",
    "go",
]


def scale() -> float:
    return float(os.environ.get("B70_STANDIN_SCALE", "1"))


def token_scale() -> float:
    return float(os.environ.get("B70_STANDIN_TOKEN_SCALE", "1"))


def log(line: str) -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"INFO {stamp} {line}", flush=True)


# --- memory on a fixture B70 --------------------------------------------------------------------


@dataclass
class Holding:
    """This process's VRAM on a fixture B70: its /proc entry with DRM fdinfo and the render
    node's used bytes. Written into the tree itself (B70_SYSROOT), or, where the process cannot
    write there (a runtime unit's sandbox), told to the `Driver` at B70_STANDIN_DRIVER."""

    root: Path | None
    slot: str = gpu_trees.B70
    render: str = "renderD128"
    held: int = 0
    driver: str | None = None  # host:port

    @classmethod
    def find(cls) -> Holding:
        driver = os.environ.get("B70_STANDIN_DRIVER")
        root = os.environ.get("B70_SYSROOT")
        if not root:
            return cls(None)
        base = Path(root)
        node = next(iter(sorted((base / "dev" / "dri").glob("renderD*"))), None)
        if node is None or not node.is_file():  # not a fixture tree: nothing to show
            return cls(None)
        slot = _slot_of(base, node.name) or gpu_trees.B70
        return cls(base, slot, node.name, driver=driver)

    def hold(self, nbytes: int, cmdline: list[str]) -> None:
        if self.root is None:
            return
        nbytes = nbytes // 1024 * 1024  # fdinfo counts KiB
        claim = {"pid": os.getpid(), "bytes": nbytes, "cmdline": cmdline, "cgroup": _own_cgroup(),
                 "slot": self.slot, "render": self.render}  # fmt: skip
        if self.driver:
            import urllib.request

            request = urllib.request.Request(
                f"http://{self.driver}/hold", json.dumps(claim).encode(), method="POST"
            )
            urllib.request.urlopen(request, timeout=10).close()
        else:
            record(self.root, claim)
        self.held = nbytes


def record(root: Path, claim: dict[str, Any]) -> None:
    """A process's VRAM, as the kernel would show it: its /proc entry, the render node's used."""
    pid, nbytes, render = int(claim["pid"]), int(claim["bytes"]), str(claim["render"])
    with _tree_lock(root):
        d = root / "proc" / str(pid)
        before = 0
        if (d / "fdinfo" / "9").exists():
            before = _held_in(d)
        else:
            proc = gpu_trees.Proc(pid, list(claim["cmdline"]), str(claim["cgroup"]), [])
            gpu_trees.add_proc(root, proc)
            os.symlink(f"/dev/dri/{render}", d / "fd" / "9")
        _add_used(root / "dev" / "dri" / render, nbytes - before)
        client = gpu_trees.Client(9, str(claim["slot"]), pid, f"{nbytes // 1024} KiB", render)
        _write(d / "fdinfo" / "9", gpu_trees.fdinfo_text(client))


def _held_in(d: Path) -> int:
    text = (d / "fdinfo" / "9").read_text()
    return int(text.split("drm-resident-vram0:\t")[1].split(" KiB")[0]) * 1024


def _slot_of(root: Path, render: str) -> str | None:
    link = root / "sys" / "class" / "drm" / render
    try:
        return Path(os.readlink(link)).parts[-3]
    except OSError:
        return None


def _own_cgroup() -> str:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return line[3:]
    except OSError:
        pass
    return "/"


@contextlib.contextmanager
def _tree_lock(root: Path) -> Any:
    import fcntl

    with open(root / ".b70-standin.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _write(path: Path, text: str | bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    if isinstance(text, bytes):
        tmp.write_bytes(text)
    else:
        tmp.write_text(text)
    os.replace(tmp, path)


def _add_used(node: Path, delta: int) -> None:
    from appliance.host.gpu import xe

    data = bytearray(node.read_bytes())
    header = xe.MEM_REGIONS_HEADER.size
    size = xe.MEM_REGION.size
    for i in range(xe.MEM_REGIONS_HEADER.unpack_from(data)[0]):
        fields = list(xe.MEM_REGION.unpack_from(data, header + i * size))
        if fields[0] == 1:  # the VRAM region: used and cpu-visible used
            fields[4] = max(0, fields[4] + delta)
            fields[6] = max(0, fields[6] + delta)
            xe.MEM_REGION.pack_into(data, header + i * size, *fields)
    _write(node, bytes(data))


class Driver(threading.Thread):
    """The kernel's part: the VRAM of a stand-in whose process has gone is freed `release_s`
    later (its /proc entry removed, the render node's used bytes lowered). With `listen`, it
    also takes stand-ins' claims over HTTP on loopback (`address`: B70_STANDIN_DRIVER), for
    stand-ins whose sandbox cannot write the tree."""

    def __init__(self, root: Path, release_s: float = 1.0, listen: bool = False) -> None:
        super().__init__(daemon=True)
        self.root, self.release_s = root, release_s
        self.stopping = threading.Event()
        self.gone: dict[int, float] = {}
        self.server: Any = None
        if listen:
            self.server = _claims_server(root)
            threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        return f"{host}:{port}"

    def run(self) -> None:
        while not self.stopping.wait(0.1):
            self.sweep()

    def sweep(self) -> None:
        for d in sorted((self.root / "proc").glob("[0-9]*")):
            if not (d / "fdinfo" / "9").exists():
                continue  # a fixture's own holder, not a stand-in
            pid = int(d.name)
            if _alive(pid):
                continue
            first = self.gone.setdefault(pid, time.monotonic())
            if time.monotonic() - first >= self.release_s:
                self.free(d)
                self.gone.pop(pid, None)

    def free(self, d: Path) -> None:
        import shutil

        held = _held_in(d)
        render = os.readlink(d / "fd" / "9").rsplit("/", 1)[1]
        with _tree_lock(self.root):
            _add_used(self.root / "dev" / "dri" / render, -held)
            shutil.rmtree(d)

    def stop(self) -> None:
        self.stopping.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        if self.is_alive():
            self.join()


def _claims_server(root: Path) -> Any:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Claims(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            record(root, json.loads(self.rfile.read(length)))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Claims)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has gone as far as the GPU is concerned
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


# --- the engine -----------------------------------------------------------------------------------


@dataclass
class Engine:
    kind: str  # "vllm" or "llamacpp"
    host: str
    port: int
    model: str
    served: str
    places: int  # requests at once
    load_s: float
    init_s: float
    weights: int
    held: int  # once loaded
    lines: list[str] = field(default_factory=list)  # the start-up lines after the weights
    cache_info: dict[str, str] = field(default_factory=dict)
    compiles: bool = False  # vLLM with torch.compile on (no --enforce-eager)
    running: int = 0
    waiting: int = 0
    generated: int = 0
    prompted: int = 0
    ready: bool = False

    def step_s(self) -> float:
        per = 0.0138 if self.kind == "llamacpp" else 0.012 + 0.0005 * max(self.running, 1)
        return per * token_scale()


def _flag(args: list[str], *names: str, default: str | None = None) -> str | None:
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return default


def vllm_engine(args: list[str]) -> Engine:
    from appliance.measure import capacity, serveflags, startlog

    model = _flag(args, "--model") or (args[0] if args and not args[0].startswith("-") else "")
    serve = serveflags.parse(args)
    config = os.environ.get("B70_STANDIN_CONFIG") or str(Path(model) / "config.json")
    cfg = json.loads(Path(config).read_text())
    p = capacity.plan(cfg, serve, env=dict(os.environ))
    eager = serve.enforce_eager
    weights = p.weight_bytes_per_card
    # vLLM takes its share of torch's total; the card cannot hold more than it has
    share = int(serve.gpu_memory_utilization * capacity.B70_TOTAL_BYTES)
    held = min(share, capacity.B70_VISIBLE_BYTES)
    if serve.kv_cache_memory_bytes:
        held = sum(t.bytes for t in p.budget.terms) + serve.kv_cache_memory_bytes
    lines = startlog.plan_log(p)
    places = serve.max_num_seqs or capacity.DEFAULT_MAX_SEQS
    info = {
        "block_size": str(p.block_size), "num_gpu_blocks": str(p.paging.blocks),
        "kv_cache_size_tokens": str(p.kv_cache_tokens),
        "kv_cache_max_concurrency": f"{p.max_concurrency:.2f}",
        "kv_cache_memory_bytes": str(p.available_kv_bytes), "cache_dtype": serve.kv_cache_dtype,
    }  # fmt: skip
    return Engine(
        "vllm", _flag(args, "--host", default="127.0.0.1") or "127.0.0.1",
        int(_flag(args, "--port", default="8000") or 8000), model,
        _flag(args, "--served-model-name", default=model) or model, places,
        LOAD_S_PER_GIB * weights / GIB, INIT_S["eager" if eager else "compiled"], weights, held,
        lines, info, compiles=not eager,
    )  # fmt: skip


def llamacpp_engine(args: list[str]) -> Engine:
    model = _flag(args, "-m", "--model", default="") or ""
    try:
        weights = Path(model).stat().st_size
    except OSError:
        weights = 0
    weights = int(float(os.environ.get("B70_STANDIN_LLAMA_GIB", "0")) * GIB) or weights
    ctx = int(_flag(args, "-c", "--ctx-size", default="4096") or 4096)
    held = weights + ctx * 10 * 1024  # q8_0 K and V of Qwen3.6-35B-A3B's 10 attention layers
    places = int(_flag(args, "--parallel", "-np", default="1") or 1)
    alias = _flag(args, "--alias", "-a", default=Path(model).name) or model
    return Engine(
        "llamacpp", _flag(args, "--host", default="127.0.0.1") or "127.0.0.1",
        int(_flag(args, "--port", default="8080") or 8080), model, alias, places,
        LOAD_S_PER_GIB * weights / GIB, 2.0, weights, held,
    )  # fmt: skip


def compile_artifact(args: list[str]) -> Path:
    """What this recipe's compiled start leaves in vLLM's cache, where vLLM keeps it: under
    VLLM_CACHE_ROOT (default $XDG_CACHE_HOME/vllm, else ~/.cache/vllm; vllm/envs.py), in
    torch_compile_cache/HASH/rank_0_0/backbone (vllm/compilation/backends.py). The stand-in's
    hash is of its flags but the address and served name, which compile nothing."""
    root = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm"
    )
    skip = {"--host", "--port", "--served-model-name"}
    kept = [a for i, a in enumerate(args) if a not in skip and (i == 0 or args[i - 1] not in skip)]
    key = hashlib.sha256(json.dumps(kept).encode()).hexdigest()[:10]
    folder = Path(root) / "torch_compile_cache" / key / "rank_0_0" / "backbone"
    return folder / "vllm_compile_cache.py"


def compile_or_load(e: Engine, args: list[str], k: float) -> None:
    """vLLM's engine start with torch.compile on: the compiled graphs loaded from the cache
    when an earlier start of this recipe left them there, else compiled and written there."""
    artifact = compile_artifact(args)
    log(f"Using cache directory: {artifact.parents[2]} for vLLM's torch.compile")
    if artifact.is_file():
        graphs = "the compiled graph(s) for compile range (1, 8192)"
        log(f"Directly load {graphs} from the cache, took {0.8 * k:.3f} s")
        time.sleep(WARM_INIT_S * k)
        log(f"init engine (profile, create kv cache, warmup model) took {WARM_INIT_S:.2f} s")
        return
    time.sleep(e.init_s * k)
    log(f"Compiling a graph for compile range (1, 8192) takes {COMPILE_S:.2f} s")
    log(f"torch.compile took {COMPILE_S:.2f} s in total")
    try:
        artifact.parent.mkdir(parents=True, exist_ok=True)
        artifact.write_text("# the B70 stand-in's compiled graph\n")
    except OSError as err:
        log(f"WARNING could not save the compiled graph to {artifact}: {err}")
    log(
        f"init engine (profile, create kv cache, warmup model) took {e.init_s:.2f} s "
        f"(compilation: {COMPILE_S:.2f} s)"
    )


def fail(name: str) -> None:
    """A real B70 failure: its lines where the engine printed them, and exit 1."""
    from appliance.host import failures

    known = failures.by_name(name)
    for line in known.sample:
        print(line, flush=True)
    sys.exit(1)


def app(e: Engine) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    turn = asyncio.Condition()

    async def health(request: Request) -> Response:
        if not e.ready:
            return JSONResponse({"error": {"code": 503, "message": "Loading model"}}, 503)
        return JSONResponse({"status": "ok"}) if e.kind == "llamacpp" else Response(status_code=200)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": e.served, "object": "model", "owned_by": "b70", "max_model_len": 16384}
        ]})  # fmt: skip

    async def metrics(request: Request) -> Response:
        if e.kind == "vllm":
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(e.cache_info.items()))
            text = (
                f'vllm:num_requests_running{{engine="0"}} {e.running}\n'
                f'vllm:num_requests_waiting{{engine="0"}} {e.waiting}\n'
                f'vllm:generation_tokens_total{{engine="0"}} {e.generated}\n'
                f'vllm:prompt_tokens_total{{engine="0"}} {e.prompted}\n'
                f'vllm:kv_cache_usage_perc{{engine="0"}} {e.running / max(e.places, 1):.4f}\n'
                f"vllm:cache_config_info{{{labels}}} 1.0\n"
            )
        else:
            text = (
                f"llamacpp:requests_processing {e.running}\n"
                f"llamacpp:requests_deferred {e.waiting}\n"
                f"llamacpp:tokens_predicted_total {e.generated}\n"
                f"llamacpp:prompt_tokens_total {e.prompted}\n"
            )
        return PlainTextResponse(text)

    async def generate(request: Request) -> Response:
        body = await request.json()
        if os.environ.get("B70_STANDIN_TRACE"):
            log(
                f"request {request.url.path} from {request.headers.get('user-agent')} "
                f"max_tokens={body.get('max_tokens')}"
            )
        chat = request.url.path.endswith("/chat/completions")
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        prompt = json.dumps(body.get("messages") or body.get("prompt") or "")
        prompt_tokens = max(1, len(prompt) // 4)
        stream = bool(body.get("stream"))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"

        async def tokens() -> Any:
            async with turn:
                e.waiting += 1
                await turn.wait_for(lambda: e.running < e.places)
                e.waiting -= 1
                e.running += 1
                e.prompted += prompt_tokens
            try:
                await asyncio.sleep(prompt_tokens / 4000 * token_scale())
                for i in range(n):
                    await asyncio.sleep(e.step_s())
                    e.generated += 1
                    yield WORDS[i % len(WORDS)] + " "
            finally:
                async with turn:
                    e.running -= 1
                    turn.notify_all()

        def chunk(text: str | None, finish: str | None) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"content": text} if text is not None else {}
            else:
                choice["text"] = text or ""
            doc = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                   "created": int(time.time()), "model": e.served, "choices": [choice]}  # fmt: skip
            return f"data: {json.dumps(doc)}\n\n"

        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                 "total_tokens": prompt_tokens + n}  # fmt: skip
        if stream:

            async def sse() -> Any:
                async for text in tokens():
                    yield chunk(text, None)
                yield chunk(None, "length")
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")
        text = "".join([t async for t in tokens()])
        choice = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": e.served,
                             "choices": [choice], "usage": usage})  # fmt: skip

    async def slots(request: Request) -> Response:
        return JSONResponse([{"id": i, "is_processing": i < e.running} for i in range(e.places)])

    routes = [
        Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/v1/completions", generate, methods=["POST"]), Route("/slots", slots),
    ]  # fmt: skip
    return Starlette(routes=routes)


def main(argv: list[str]) -> None:
    if argv[:1] == ["driver"]:
        driver = Driver(Path(argv[1]), float(argv[2]) if len(argv) > 2 else 1.0)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        driver.run()
        return
    kind, args = argv[0], argv[1:]
    e = vllm_engine(args) if kind == "vllm" else llamacpp_engine(args)
    failing = os.environ.get("B70_STANDIN_FAIL")
    holding = Holding.find()
    k = scale()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if kind == "vllm":
        log(f"vLLM API server version 0.31.0 (B70 stand-in) for model {e.model}")
        time.sleep(START_S * k)
        holding.hold(e.weights, [sys.argv[0], *argv])
        time.sleep(e.load_s * k)
        log(f"{e.lines[0]} and {e.load_s:.6f} seconds")
        if failing:
            fail(failing)
        for line in e.lines[1:]:
            log(line)
        if not e.compiles:
            time.sleep(e.init_s * k)
            log(f"init engine (profile, create kv cache, warmup model) took {e.init_s:.2f} s")
        else:
            compile_or_load(e, args, k)
        holding.hold(e.held, [sys.argv[0], *argv])
        log(f"Starting vLLM API server 0 on http://{e.host}:{e.port}")
        e.ready = True
    else:
        log(f"main: loading model {e.model} (B70 stand-in)")
        if failing:
            fail(failing)
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app(e), host=e.host, port=e.port, log_level="warning"))
    if kind == "llamacpp":

        async def load() -> None:
            holding.hold(e.weights, [sys.argv[0], *argv])
            await asyncio.sleep(e.load_s * k)
            holding.hold(e.held, [sys.argv[0], *argv])
            log("main: model loaded")
            log(f"main: server is listening on http://{e.host}:{e.port} - starting the main loop")
            e.ready = True

        async def both() -> None:
            task = asyncio.ensure_future(load())
            await server.serve()
            task.cancel()

        asyncio.run(both())
    else:
        server.run()


if __name__ == "__main__":
    main(sys.argv[1:])
