"""LiteLLM's side of the hold and the key check (appliance.proxy.hook), with LiteLLM's own types:
the 503 of a hold that ran out, the 401s of the key check, and errors that name the runtime."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import litellm
import pytest
from litellm.proxy._types import ProxyException

from appliance.proxy import backend as proxy_backend
from appliance.proxy import hook as proxy_hook
from tests.test_proxy_hold import Backend, Clock, turnstile


def test_the_hook_answers_503_with_retry_after(tmp_path: Path) -> None:
    clock = Clock()
    hook = proxy_hook.HoldHook(turnstile(tmp_path, Backend(healthy=False), clock, hold_s=20))
    data = {"model": "m", "proxy_server_request": {"headers": {}}}
    with pytest.raises(ProxyException) as e:
        asyncio.run(hook.async_pre_call_hook(None, None, data, "acompletion"))
    assert e.value.code == "503"
    assert e.value.headers == {"Retry-After": "5"}
    assert "the backend is not healthy" in e.value.message
    ok = proxy_hook.HoldHook(turnstile(tmp_path, Backend(healthy=True), clock))
    assert asyncio.run(ok.async_pre_call_hook(None, None, data, "acompletion")) is data


@pytest.mark.parametrize(
    ("given", "status", "message"),
    [
        ("", 401, "no API key"),
        ("Bearer ", 401, "no API key"),
        ("Bearer sk-wrong", 401, "not the appliance's key"),
        ("sk-b70-right-but-longer", 401, "not the appliance's key"),
    ],
)
def test_a_missing_or_wrong_key_is_401(
    monkeypatch: pytest.MonkeyPatch, given: str, status: int, message: str
) -> None:
    monkeypatch.setenv("LITELLM_MASTER_KEY", "sk-b70-right")
    with pytest.raises(ProxyException) as e:
        asyncio.run(proxy_hook.authenticate(None, given))  # type: ignore[arg-type]
    assert e.value.code == str(status)
    assert e.value.headers == {"WWW-Authenticate": "Bearer"}
    assert message in e.value.message


def test_the_right_key_is_the_proxy_admin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_MASTER_KEY", "sk-b70-right")
    auth = asyncio.run(proxy_hook.authenticate(None, "Bearer sk-b70-right"))  # type: ignore[arg-type]
    assert auth.user_role == "proxy_admin"
    assert auth.api_key  # LiteLLM keeps a hash of it


def test_no_configured_key_accepts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LITELLM_MASTER_KEY", raising=False)
    with pytest.raises(ProxyException):
        asyncio.run(proxy_hook.authenticate(None, "Bearer "))  # type: ignore[arg-type]
    with pytest.raises(ProxyException):
        asyncio.run(proxy_hook.authenticate(None, "Bearer anything"))  # type: ignore[arg-type]


def llama_server(request: httpx.Request) -> httpx.Response:
    """What llama-server answers the door about itself (the shapes of tests/test_door_real.py)."""
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"data": [{"id": "smollm2", "owned_by": "llamacpp"}]})
    return httpx.Response(200, json={"default_generation_settings": {"n_ctx": 1024}})


def test_errors_name_the_runtime_that_serves_not_litellms_provider_class() -> None:
    said = '{"error": {"message": "the request exceeds the available context size"}}'

    def failure(hook: proxy_hook.HoldHook) -> str:
        error = litellm.BadRequestError(
            message=f"Hosted_vllmException - {said}", model="smollm2", llm_provider="hosted_vllm"
        )
        assert asyncio.run(hook.async_post_call_failure_hook({}, error, None)) is None
        return error.message

    assert failure(proxy_hook.HoldHook()) == f"litellm.BadRequestError: the runtime - {said}"
    backend = proxy_backend.Backend("http://runtime", transport=httpx.MockTransport(llama_server))
    assert asyncio.run(backend.facts()) == proxy_backend.Facts("llama.cpp", 1024, "smollm2")
    hook = proxy_hook.HoldHook(backend=backend)
    assert failure(hook) == f"litellm.BadRequestError: the runtime (llama.cpp) - {said}"
