"""The appliance's master key (LiteLLM's, in the proxy's environment file) and the one way a key
or token is compared."""

from __future__ import annotations

import hmac

from appliance.errors import ApplianceError
from appliance.files import write_atomic
from appliance.layout import Layout


def read_key(lay: Layout) -> str:
    try:
        text = lay.key_file.read_text()
    except FileNotFoundError:
        raise ApplianceError(
            f"the proxy key file {lay.key_file} does not exist",
            hint="run `b70ctl install`",
            code="not_installed",
        ) from None
    except PermissionError:
        raise ApplianceError(
            f"cannot read the proxy key file {lay.key_file}: the appliance's master key is "
            "root's alone",
            hint="pass a key you were given (`b70ctl bench --api-key KEY`, or B70_API_KEY), or "
            "run as root",
            code="permission_denied",
        ) from None
    for line in text.splitlines():
        if line.startswith("LITELLM_MASTER_KEY="):
            return line.split("=", 1)[1].strip()
    raise ApplianceError(
        f"{lay.key_file} holds no LITELLM_MASTER_KEY=",
        hint="delete it and run `b70ctl install`",
        code="not_installed",
    )


def ensure_key(lay: Layout) -> bool:
    if lay.key_file.exists():
        return False
    import secrets  # only install makes a key: a switch need not import it

    key = "sk-b70-" + secrets.token_urlsafe(32)
    write_atomic(lay.key_file, f"LITELLM_MASTER_KEY={key}\n", mode=0o600)
    return True


def same_secret(given: str, secret: str) -> bool:
    """Whether `given` is `secret`, in constant time, for any text (compared as UTF-8 bytes; a
    lone surrogate too): a value that is not ASCII is a mismatch, not a TypeError."""
    return hmac.compare_digest(
        given.encode("utf-8", "surrogatepass"), secret.encode("utf-8", "surrogatepass")
    )
