"""The proxy's TLS certificate at install (`[proxy] tls`): the owner's, checked before anything is
written, or a self-signed one made in the state directory, kept while it is good and made anew
a month before it runs out.

The self-signed certificate names this machine as clients reach it: its host name and fully
qualified name, `localhost`, loopback, every address of its network interfaces, and the proxy's
own host when it is an address. Its key is ECDSA P-256. It is valid for 825 days, the longest
that Apple's platforms accept for a TLS server certificate (Apple, "Requirements for trusted
certificates in iOS 13 and macOS 10.15"). Clients trust it by its file (`curl --cacert`,
SSL_CERT_FILE, httpx's `verify=`) after comparing its fingerprint with `b70ctl status`.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import pwd
import socket
import ssl
from dataclasses import dataclass
from typing import Any

from appliance.config import Config
from appliance.errors import ApplianceError
from appliance.files import write_atomic
from appliance.host.access import Who, judge_open
from appliance.keys import TlsFiles, file_fingerprint, server_context, tls_files
from appliance.layout import Layout, Scope
from appliance.units.sandbox import PROXY_USER

VALID_DAYS = 825
RENEW_DAYS = 30  # a certificate running out sooner than this is made anew at install


@dataclass(frozen=True)
class Certificate:
    """The certificate the proxy serves, as install leaves it."""

    cert: str
    key: str
    fingerprint: str  # SHA-256
    self_signed: bool  # made by install (else the owner's)
    new: bool  # made by this install: a running proxy must start again to serve it


def files_of(config: Config, lay: Layout) -> TlsFiles | None:
    p = config.proxy
    return tls_files(p.tls, p.tls_cert, p.tls_key, lay.state_dir)


def check_given(config: Config, lay: Layout) -> None:
    """The owner's certificate and key, before install writes anything: PEM, belonging together,
    and readable by the proxy's user (a system install: b70-proxy)."""
    files = files_of(config, lay)
    if files is None or files.made:
        return
    try:
        server_context(files.cert, files.key)
    except (OSError, ssl.SSLError) as e:
        raise ApplianceError(
            f"the proxy cannot serve TLS with tls_cert {files.cert} and tls_key {files.key}: "
            f"{getattr(e, 'strerror', None) or e}",
            hint="give a PEM certificate (its chain after it) and the PEM private key that "
            "belongs to it, without a passphrase; or remove tls_cert and tls_key for a "
            "self-signed certificate",
            code="bad_certificate",
        ) from None
    if lay.scope is Scope.SYSTEM:
        who = _proxy_user()
        for path in (files.cert, files.key):
            problem = judge_open(path, who)
            if problem is not None:
                raise ApplianceError(
                    f"the proxy's user cannot read {path}: {problem}",
                    hint=f"let group {PROXY_USER} read it (chgrp {PROXY_USER} FILE; chmod 0640 "
                    "FILE), or copy it where it may",
                    code="bad_certificate",
                )


def ensure(config: Config, lay: Layout) -> Certificate | None:
    """The certificate the proxy serves, made if it is to be self-signed and is missing, not
    this machine's, does not load, or runs out within RENEW_DAYS. None: TLS is off."""
    files = files_of(config, lay)
    if files is None:
        return None
    new = False
    if files.made and not _still_good(files):
        cert, key = make_self_signed(machine_names(config.proxy.host))
        owner = _proxy_uid() if lay.scope is Scope.SYSTEM else None
        write_atomic(files.key, key, mode=0o600, owner=owner)  # the key first: no new cert
        write_atomic(files.cert, cert, mode=0o644, owner=owner)  # with an old key
        new = True
    fingerprint = file_fingerprint(files.cert)
    if fingerprint is None:
        raise ApplianceError(
            f"{files.cert} holds no certificate", hint="check the file, then run install again"
        )
    return Certificate(str(files.cert), str(files.key), fingerprint, files.made, new)


def _still_good(files: TlsFiles) -> bool:
    try:
        server_context(files.cert, files.key)
        pem = files.cert.read_text(encoding="ascii", errors="replace")
    except (OSError, ssl.SSLError):
        return False
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(pem.encode())
    except ValueError:
        return False
    now = datetime.datetime.now(datetime.UTC)
    return cert.not_valid_after_utc - now > datetime.timedelta(days=RENEW_DAYS)


def machine_names(host: str) -> tuple[list[str], list[str]]:
    """The DNS names and the IP addresses clients may reach this machine by."""
    import psutil

    names = ["localhost"]
    for name in (socket.gethostname(), socket.getfqdn()):
        if name and name not in names and _dns_name(name):
            names.append(name)
    addresses = ["127.0.0.1", "::1"]
    candidates = [host] + [
        a.address.split("%", 1)[0]
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family in (socket.AF_INET, socket.AF_INET6)
    ]
    for text in candidates:
        try:
            address = ipaddress.ip_address(text)
        except ValueError:
            continue
        if address.is_unspecified or address.is_link_local or str(address) in addresses:
            continue
        addresses.append(str(address))
    return names, addresses


def _dns_name(name: str) -> bool:
    labels = name.rstrip(".").split(".")
    return all(0 < len(x) < 64 and x.replace("-", "").isalnum() and x.isascii() for x in labels)


def make_self_signed(names: tuple[list[str], list[str]], days: int = VALID_DAYS) -> tuple[str, str]:
    """A self-signed server certificate for these DNS names and addresses, and its key (PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    dns, addresses = names
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, dns[-1][:64]),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "b70 appliance"),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    alt = [x509.DNSName(n) for n in dns] + [
        x509.IPAddress(ipaddress.ip_address(a)) for a in addresses
    ]
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        # valid from a day back: a peer whose clock is slow (minutes, or a time zone set wrong)
        # takes a certificate made just now
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=days - 1))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_signing_only(), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem.decode()


def _signing_only() -> Any:
    """Key usage: the key signs the handshake, and nothing else."""
    from cryptography import x509

    usage = dict.fromkeys(
        ("content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
         "key_cert_sign", "crl_sign", "encipher_only", "decipher_only"),
        False,
    )  # fmt: skip
    return x509.KeyUsage(digital_signature=True, **usage)


def _proxy_uid() -> int | None:
    try:
        return pwd.getpwnam(PROXY_USER).pw_uid
    except KeyError:
        return None


def _proxy_user() -> Who:
    try:
        entry = pwd.getpwnam(PROXY_USER)
    except KeyError:  # not made yet (install makes it): it owns nothing and is in no group
        return Who(PROXY_USER, None, frozenset())
    groups = {g for g in os.getgrouplist(PROXY_USER, entry.pw_gid)}
    return Who(PROXY_USER, entry.pw_uid, frozenset(groups))
