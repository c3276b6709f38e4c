"""The appliance's secrets: its master key (LiteLLM's, in the proxy's environment file), the one
way a key or token is compared, and the TLS certificate and key the proxy serves on its port
(`[proxy] tls`) with the certificate's fingerprint, the one thing a person compares to trust a
self-signed certificate.

The certificate is the owner's (`tls_cert`, `tls_key`) or one `b70ctl install` makes, self-signed,
in the state directory (appliance.deploy.certificate). Standard library only: the proxy and
`b70ctl status` read the fingerprint without loading a crypto library.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import ssl
from dataclasses import dataclass
from pathlib import Path

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


# --- TLS ----------------------------------------------------------------------------------------

TLS_CERT_FILE = "tls.crt"  # what install makes, in the state directory
TLS_KEY_FILE = "tls.key"
_PEM = re.compile(r"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.DOTALL)


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    made: bool  # made by install (self-signed), not the owner's


def tls_files(tls: bool, cert: str | None, key: str | None, state_dir: Path) -> TlsFiles | None:
    """The certificate and key the proxy serves (`[proxy] tls`, `tls_cert`, `tls_key`), or None
    when TLS is off."""
    if not tls:
        return None
    if cert and key:
        return TlsFiles(Path(cert), Path(key), made=False)
    return TlsFiles(state_dir / TLS_CERT_FILE, state_dir / TLS_KEY_FILE, made=True)


def fingerprint(pem: str) -> str | None:
    """The SHA-256 fingerprint of the first certificate in PEM text ("AB:CD:...", as
    `openssl x509 -noout -fingerprint -sha256` and browsers print it); None when the text holds
    no certificate."""
    found = _PEM.search(pem)
    if found is None:
        return None
    body = "".join(found.group(1).split())
    try:
        der = base64.b64decode(body, validate=True)
    except ValueError:
        return None
    if not der.startswith(b"\x30"):  # a DER certificate is a SEQUENCE
        return None
    return ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())


def file_fingerprint(path: Path) -> str | None:
    """The fingerprint of the certificate file at `path` (None: missing, unreadable, or no
    certificate in it)."""
    try:
        return fingerprint(path.read_text(encoding="ascii", errors="replace"))
    except OSError:
        return None


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The proxy's side of TLS: TLS 1.2 or later, HTTP/1.1. ssl.SSLError or OSError when the
    files cannot be read or do not belong together."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_RENEGOTIATION  # a client's renegotiation is refused (TLS 1.2)
    context.set_alpn_protocols(["http/1.1"])
    context.load_cert_chain(str(cert), str(key))
    return context
