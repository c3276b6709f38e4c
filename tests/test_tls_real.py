"""TLS on :8000 (`[proxy] tls`) on the real appliance, reached from another machine: a network
namespace of its own behind a veth pair, whose address is not this machine's. The demo listens
on every address with a self-signed certificate made at install; the OpenAI SDK there speaks
https with that certificate as its only trust, and plain http there is refused with a hint,
while plain http on loopback (b70ctl, the monitor) goes on as before."""

from __future__ import annotations

import json
import os
import random
import ssl
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import (
    Appliance,
    demo_config_text,
    free_port,
    installed,
    llamacpp_counter,
    own_appliance,
    running_manager,
    short_chats,
)

pytestmark = pytest.mark.real


@dataclass(frozen=True)
class Afar:
    """Another machine: a network namespace reaching this one at `host` (its veth address)."""

    name: str
    host: str

    def python(self, code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.name, sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip


@pytest.fixture(scope="module")
def afar() -> Iterator[Afar]:
    if os.geteuid() != 0:
        pytest.skip("another machine is a network namespace here, which takes root")
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    name, here, there = f"b70t{tag}", f"b70h{tag}", f"b70a{tag}"
    net = f"10.{random.randrange(64, 250)}.{random.randrange(1, 250)}"
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", here, "type", "veth", "peer", "name", there],
        ["ip", "link", "set", there, "netns", name],
        ["ip", "addr", "add", f"{net}.1/30", "dev", here],
        ["ip", "link", "set", here, "up"],
        ["ip", "netns", "exec", name, "ip", "addr", "add", f"{net}.2/30", "dev", there],
        ["ip", "netns", "exec", name, "ip", "link", "set", there, "up"],
        ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True, timeout=30)
        yield Afar(name, f"{net}.1")
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def tls_app(afar: Afar, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    """The demo on every address with TLS on: made after `afar`, so its certificate names the
    address the other machine reaches it by."""
    root = tmp_path_factory.mktemp("tls")

    def edit(text: str) -> str:
        return text.replace('[proxy]\nhost = "127.0.0.1"', '[proxy]\nhost = "0.0.0.0"\ntls = true')

    with own_appliance(root, edit=edit) as app:
        assert 'host = "0.0.0.0"' in app.config.read_text()
        app.b70ctl("switch", "llamacpp", check=True)
        yield app


def _cert(app: Appliance) -> Path:
    return Path(app.manager.env["XDG_STATE_HOME"]) / "b70" / "tls.crt"


def _trust(app: Appliance) -> ssl.SSLContext:
    """A client's trust in the appliance's certificate alone."""
    return ssl.create_default_context(cafile=str(_cert(app)))


def _openssl_fingerprint(cert: Path) -> str:
    out = subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-fingerprint", "-sha256"],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    return out.stdout.strip().split("=", 1)[1]


def test_status_and_install_give_the_fingerprint_of_the_certificate_served(
    tls_app: Appliance,
) -> None:
    cert = _cert(tls_app)
    key = cert.with_name("tls.key")
    assert key.stat().st_mode & 0o777 == 0o600
    fingerprint = _openssl_fingerprint(cert)
    tls = tls_app.json("status")["result"]["proxy"]["tls"]
    assert tls == {"cert": str(cert), "self_signed": True, "fingerprint": fingerprint}
    assert fingerprint in tls_app.b70ctl("status").stdout
    again = tls_app.json("install")["result"]["tls"]  # kept, not made anew
    assert again["fingerprint"] == fingerprint and again["new"] is False, again
    # What the port serves is that certificate (the handshake's own, through Python's ssl)
    served = subprocess.run(
        ["openssl", "s_client", "-connect", f"127.0.0.1:{tls_app.proxy_port}", "-showcerts"],
        input="", capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    pem = served.stdout[served.stdout.index("-----BEGIN") :]
    probe = cert.with_name("served.pem")
    probe.write_text(pem[: pem.index("-----END CERTIFICATE-----") + 25] + "\n")
    assert _openssl_fingerprint(probe) == fingerprint


def test_the_sdk_on_another_machine_speaks_tls_and_plain_http_there_is_refused(
    tls_app: Appliance, afar: Afar
) -> None:
    cert, key, port = _cert(tls_app), tls_app.key, tls_app.proxy_port
    fingerprint = _openssl_fingerprint(cert)
    out = afar.python(
        f"""
        import json, ssl, httpx, openai
        base = "{afar.host}:{port}/v1"
        tls = openai.OpenAI(base_url="https://" + base, api_key="{key}", max_retries=0,
                            http_client=httpx.Client(verify=ssl.create_default_context(cafile="{cert}"),
                                                     timeout=120))
        said = tls.chat.completions.create(model="smollm2", max_tokens=8, temperature=0,
            messages=[{{"role": "user", "content": "Say hi."}}])
        chunks = [c for c in tls.chat.completions.create(model="smollm2", max_tokens=8,
            temperature=0, stream=True, messages=[{{"role": "user", "content": "Say hi."}}])]
        plain = openai.OpenAI(base_url="http://" + base, api_key="{key}", max_retries=0)
        try:
            plain.models.list()
            refused = None
        except openai.APIStatusError as e:
            refused = {{"status": e.status_code, "body": e.body}}
        print(json.dumps({{"said": said.choices[0].message.content, "chunks": len(chunks),
                          "refused": refused}}))
        """
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["said"] and got["chunks"] >= 2, got
    refused = got["refused"]
    assert refused is not None and refused["status"] == 403, got
    message = refused["body"]["message"]
    assert refused["body"]["code"] == "tls_required", refused
    assert f"https://{afar.host}:{port}" in message and fingerprint in message, message


def test_keep_alive_holds_one_tls_connection_and_loopback_stays_plain(
    tls_app: Appliance,
) -> None:
    headers = {"Authorization": f"Bearer {tls_app.key}"}
    with httpx.Client(verify=_trust(tls_app), timeout=60) as client:
        seen = set()
        for _ in range(3):
            r = client.get(f"https://localhost:{tls_app.proxy_port}/v1/models", headers=headers)
            assert r.status_code == 200, r.text
            stream = r.extensions["network_stream"]
            seen.add(stream.get_extra_info("client_addr"))
            assert stream.get_extra_info("ssl_object").version() in ("TLSv1.2", "TLSv1.3")
        assert len(seen) == 1, seen  # one connection, kept alive
    plain = httpx.get(f"http://127.0.0.1:{tls_app.proxy_port}/v1/models", headers=headers)
    assert plain.status_code == 200, plain.text
    assert tls_app.json("status")["result"]["proxy"]["healthy"]


def test_a_tls_request_sent_while_the_proxy_restarts_waits_on_the_socket(
    tls_app: Appliance,
) -> None:
    """The port is systemd's socket: a TLS client that connects while the proxy starts again
    waits in its backlog and is answered by the new proxy."""
    tls_app.manager.systemctl("restart", "--no-block", "b70-litellm.service")
    time.sleep(0.5)
    with httpx.Client(verify=_trust(tls_app), timeout=120) as client:
        r = client.post(
            f"https://localhost:{tls_app.proxy_port}/v1/chat/completions",
            headers={"Authorization": f"Bearer {tls_app.key}"},
            json={"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        )  # fmt: skip
    assert r.status_code == 200, r.text


def test_a_client_that_does_not_trust_the_certificate_fails_and_the_port_serves_on(
    tls_app: Appliance,
) -> None:
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://localhost:{tls_app.proxy_port}/v1/models", timeout=30)
    r = httpx.get(
        f"https://localhost:{tls_app.proxy_port}/v1/models", verify=_trust(tls_app),
        headers={"Authorization": f"Bearer {tls_app.key}"}, timeout=30,
    )  # fmt: skip
    assert r.status_code == 200, r.text


@pytest.fixture
def front_door(tls_app: Appliance, tmp_path: Path) -> Iterator[Appliance]:
    """Another appliance whose proxy is a front door to `tls_app` as an https:// peer, trusting
    its certificate alone ([peers] ca); the fleet shares one master key."""
    proxy, backend = free_port(), free_port()
    with running_manager(tmp_path / "front") as manager:
        key_dir = Path(manager.env["XDG_CONFIG_HOME"]) / "b70"
        key_dir.mkdir(parents=True, exist_ok=True)
        (key_dir / "proxy.env").write_text(f"LITELLM_MASTER_KEY={tls_app.key}\n")
        (key_dir / "proxy.env").chmod(0o600)
        extra = (
            f'\n[peers]\nurls = ["https://127.0.0.1:{tls_app.proxy_port}"]\n'
            f'ca = "{_cert(tls_app)}"\n'
        )
        config = tmp_path / "front.toml"
        config.write_text(demo_config_text(proxy, backend, extra))
        with installed(manager, config, proxy, backend) as app:
            yield app


def test_a_front_door_reaches_an_https_peer_trusting_its_certificate(
    tls_app: Appliance, front_door: Appliance
) -> None:
    front_door.b70ctl("switch", "llamacpp", check=True)
    ports = (front_door.backend_port, tls_app.backend_port)
    before = [llamacpp_counter(p, "tokens_predicted_total") for p in ports]
    short_chats(front_door, 16)
    after = [llamacpp_counter(p, "tokens_predicted_total") for p in ports]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
