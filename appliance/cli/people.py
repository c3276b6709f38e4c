"""The commands about the people who use the appliance: keys (add, list, revoke, rotate) and usage.

A person's key reaches the model routes on :8000, within its limits, and nothing else: no hold
token, no peer's header. The master key (LITELLM_MASTER_KEY in proxy.env) is the appliance's own
(its switches' checks, the monitor, its peers) and an admin's; it has no limits. Who may run
what: docs/security.md.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from appliance.cli import output
from appliance.cli.base import Context, cli, with_json
from appliance.errors import ApplianceError
from appliance.layout import Scope, layout

USAGE_MOST_S = 31 * 86400.0  # how far back the usage files reach (appliance.usage.RETAIN_S)


@cli.group()
def keys() -> None:
    """Keys for people: each person's own key, its limits, and who used what (`b70ctl usage`).

    \b
    Example:
      sudo b70ctl keys add alice --max-parallel 4 --rpm 60
    """


def _limits(function: Any) -> Any:
    for flag, what in (
        ("--max-parallel", "requests at once, waiting or running"),
        ("--rpm", "requests a minute"),
        ("--tpm", "tokens a minute, in and out"),
    ):
        option = click.option(
            flag, type=click.IntRange(1, 10**9), help=f"At most this many {what}."
        )
        function = option(function)
    return function


@keys.command("add")
@click.argument("name")
@_limits
@click.option(
    "--priority", type=click.Choice(["interactive", "batch"]), default="interactive",
    show_default=True,
    help="batch waits behind interactive when the card is full, and leaves one place free "
    "while an interactive key came within 30 s.",
)  # fmt: skip
@with_json
def add(
    ctx: Context, name: str, max_parallel: int | None, rpm: int | None, tpm: int | None,
    priority: str,
) -> None:  # fmt: skip
    """Make a key for NAME and show its secret, this once: only its hash is kept.

    \b
    Example:
      sudo b70ctl keys add alice --max-parallel 4
      sudo b70ctl keys add nightly-evals --priority batch --tpm 200000
    """
    from appliance import keyorder, people

    ctx.require_root("keys add")
    config = ctx.config()  # the appliance it is: a broken config is said, not passed over
    if priority == people.BATCH and not config.proxy.fair:
        raise ApplianceError(
            "--priority batch does nothing here: [proxy] fair = false, so no request waits "
            "behind another's", hint="set fair = true in [proxy] and run `b70ctl install`, or "
            "leave --priority out", code="usage_error", exit_code=2,
        )  # fmt: skip
    problem = people.name_problem(name)
    if problem is not None:
        raise ApplianceError(problem, hint="e.g. `b70ctl keys add alice`", code="usage_error",
                             exit_code=2)  # fmt: skip
    secret = people.new_secret()
    with _editing(ctx) as everyone:
        if name in everyone or name in keyorder.keys_in_force(_state_dir(ctx))[1]:
            raise ApplianceError(
                f"there is a key for {name!r} already",
                hint=f"`b70ctl keys rotate {name}` gives it a new secret; `b70ctl keys revoke "
                f"{name}` ends it",
                code="key_exists",
            )
        person = people.added(everyone, name, secret, max_parallel=max_parallel, rpm=rpm, tpm=tpm,
                              priority=priority)  # fmt: skip
    data = {**person.public(), "key": secret}
    output.show(ctx.json, data, lambda: _shown(name, secret, "made"))


@keys.command("rotate")
@click.argument("name")
@with_json
def rotate(ctx: Context, name: str) -> None:
    """Give NAME's key a new secret and show it, this once; the old one stops working within a
    second. Its limits and usage stay.

    \b
    Example:
      sudo b70ctl keys rotate alice
    """
    from appliance import people

    ctx.require_root("keys rotate")
    ctx.config()  # the appliance it is: a broken config is said, not passed over
    secret = people.new_secret()
    with _editing(ctx) as everyone:
        _known(everyone, name, ctx)
        person = people.rotated(everyone, name, secret)
    output.show(
        ctx.json, {**person.public(), "key": secret}, lambda: _shown(name, secret, "rotated")
    )


@keys.command("revoke")
@click.argument("name")
@with_json
def revoke(ctx: Context, name: str) -> None:
    """End NAME's key: within a second the door answers it 401. Its usage stays.

    \b
    Example:
      sudo b70ctl keys revoke alice
    """
    ctx.require_root("keys revoke")
    ctx.config()  # the appliance it is: a broken config is said, not passed over
    with _editing(ctx) as everyone:
        _known(everyone, name, ctx)
        del everyone[name]
    output.show(ctx.json, {"revoked": name}, lambda: f"the key of {name} is revoked")


@keys.command("list")
@with_json
def list_keys(ctx: Context) -> None:
    """The keys, their limits and priority, and when each was made; never a secret.

    \b
    Example:
      sudo b70ctl keys list
    """
    from appliance import keyorder, people

    ctx.require_root("keys list")  # the file is the proxy's and root's alone
    ctx.config()  # the appliance it is: a broken config is said, not passed over
    try:
        # With front doors that share a Redis ([peers] redis_host): the last of each name on
        # any of them; "from" says whether it was made, or last changed, on this one.
        here, in_force = keyorder.keys_in_force(_state_dir(ctx))
    except people.KeysUnreadable as e:
        raise _unreadable(e) from None
    rows = [
        {**p.public(), "from": "here" if here.get(n) == p else "fleet"}
        for n, p in sorted(in_force.items())
    ]
    output.show(ctx.json, {"keys": rows}, lambda: _render_keys(rows))


@cli.command()
@click.option(
    "--since", metavar="DURATION",
    help="Only this last while: 90s, 30m, 2h, 7d (default: all that is kept, 31 days).",
)  # fmt: skip
@click.option(
    "--fleet", is_flag=True,
    help="Every front door that shares this one's Redis ([peers] redis_host), by the hour.",
)  # fmt: skip
@with_json
def usage(ctx: Context, since: str | None, fleet: bool) -> None:
    """Who used what: requests, tokens in and out, time queued at the door and refusals (429)
    per key, as the runtimes counted the tokens. The master key is "master".

    \b
    Example:
      b70ctl usage --since 1h
      sudo b70ctl usage --fleet --since 7d
    """
    from appliance import usage as usage_mod
    from appliance.switch.demand.pins import parse_duration

    config = ctx.config()  # the appliance it is: a broken config is said, not passed over
    start = None
    back_s = None if since is None else parse_duration(since, "--since", USAGE_MOST_S)
    if back_s is not None:
        start = time.time() - back_s
    if fleet:
        start, found = _fleet_usage(ctx, config, back_s)
    else:
        found = usage_mod.read_usage(_state_dir(ctx), start)
    rows = [
        {"key": name, **use.as_line()} for name, use in sorted(found.items(), key=lambda kv: kv[0])
    ]
    data = {"since": start, "fleet": fleet, "keys": rows}
    output.show(ctx.json, data, lambda: _render_usage(rows, since, fleet))


def _fleet_usage(
    ctx: Context, config: Any, back_s: float | None
) -> tuple[float | None, dict[str, Any]]:
    """Each key's use on every front door, from the fleet's Redis: the hours from `back_s`
    seconds ago by Redis's clock, as the doors write them (not this box's), and that hour."""
    from appliance import usage as usage_mod

    host, port = config.peers.redis_host, config.peers.redis_port
    if host is None:
        raise ApplianceError(
            "this appliance shares no Redis with other front doors, so there is no fleet's "
            "usage to read", hint="`b70ctl usage` gives this door's; [peers] redis_host shares "
            "one (docs/fleet.md)", code="usage_error",
        )  # fmt: skip
    import redis
    from redis.exceptions import RedisError

    client = redis.Redis(
        host=host, port=port, password=_redis_password(ctx), socket_timeout=5,
        socket_connect_timeout=5, decode_responses=True, ssl=config.peers.redis_tls,
        ssl_ca_certs=config.peers.redis_ca,
    )  # fmt: skip
    try:
        start = None
        if back_s is not None:
            seconds, _ = client.time()
            start = int(seconds - back_s) // usage_mod.HOUR_S * usage_mod.HOUR_S
        hours: dict[int, dict[str, str]] = {}
        for name in client.scan_iter(match=usage_mod.FLEET_USAGE + "*", count=1000):
            hour = str(name).removeprefix(usage_mod.FLEET_USAGE)
            if hour.isdigit() and (start is None or int(hour) >= start):
                hours[int(hour)] = {str(k): str(v) for k, v in client.hgetall(name).items()}
    except (RedisError, OSError) as e:
        raise ApplianceError(
            f"cannot read the fleet's usage from Redis at {host}:{port}: {e}",
            hint="is Redis up, and reachable from here? `b70ctl usage` gives this door's",
            code="unreachable",
        ) from None
    finally:
        client.close()
    return start, usage_mod.fleet_usage(hours)


def _redis_password(ctx: Context) -> str | None:
    """REDIS_PASSWORD, from the environment or the proxy's key file (as the proxy reads it)."""
    if os.environ.get("REDIS_PASSWORD"):
        return os.environ["REDIS_PASSWORD"]
    with contextlib.suppress(OSError):
        for line in layout(ctx.scope).key_file.read_text().splitlines():
            if line.startswith("REDIS_PASSWORD="):
                return line.split("=", 1)[1].strip() or None
    return None


# --- helpers ----------------------------------------------------------------------------------


def _state_dir(ctx: Context) -> Path:
    return layout(ctx.scope).state_dir


@contextmanager
def _editing(ctx: Context) -> Iterator[dict[str, Any]]:
    """The keys, to change in the block (appliance.people.editing), or a clear error."""
    from appliance import keyorder, people

    owner = _proxy_uid() if ctx.scope is Scope.SYSTEM else None
    state_dir = _state_dir(ctx)
    try:
        with people.editing(state_dir, owner, keyorder.fleet_bases(state_dir)) as everyone:
            yield everyone
    except people.KeysUnreadable as e:
        raise _unreadable(e) from None


def _proxy_uid() -> int:
    """The proxy's user, who must read the keys file (mode 0600) on a system install."""
    import pwd

    from appliance.units.sandbox import PROXY_USER

    try:
        return pwd.getpwnam(PROXY_USER).pw_uid
    except KeyError:
        raise ApplianceError(
            f"there is no user {PROXY_USER}, whom the proxy runs as and who reads the keys",
            hint="run `sudo b70ctl install` first (systemd-sysusers makes the user)",
            code="not_installed",
        ) from None


def _known(everyone: dict[str, Any], name: str, ctx: Context) -> None:
    """NAME is a key here, or one made on another front door of the fleet, which is then taken
    into this door's file to change (the fleet takes the last change of a name, in its order)."""
    from appliance import keyorder

    _, in_force = keyorder.keys_in_force(_state_dir(ctx))
    if name not in in_force:
        everyone.pop(name, None)  # revoked on another front door: no key to change here
    elif everyone.get(name) != in_force[name]:
        everyone[name] = in_force[name]  # made, or changed last, on another front door
    if name not in everyone:
        known = ", ".join(sorted(everyone)) or "none yet"
        raise ApplianceError(
            f"there is no key for {name!r} (keys: {known})",
            hint="`b70ctl keys list` shows them; `b70ctl keys add NAME` makes one",
            code="no_such_key",
        )


def _unreadable(e: Any) -> ApplianceError:
    return ApplianceError(
        f"cannot read the keys file {e.path}: {e.why}",
        hint="nothing was changed; restore it from a backup, or remove it (every person's key "
        "then stops working) and make the keys again",
        code="keys_unreadable",
    )


def _shown(name: str, secret: str, done: str) -> str:
    return (
        f"{secret}\n\nthe key of {name}, {done}: it is shown this once (the appliance keeps only "
        "its hash). Clients send it as 'Authorization: Bearer KEY' to :8000."
    )


def _when(epoch: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(epoch)) if epoch else "-"


def _render_keys(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no keys yet: `b70ctl keys add NAME` makes one"
    head = ["KEY", "PRIORITY", "MAX PARALLEL", "RPM", "TPM", "MADE", "ROTATED"]
    body = [
        [
            r["name"] + (" (from another front door)" if r["from"] == "fleet" else ""),
            r["priority"],
            *(str(r[k] or "-") for k in ("max_parallel", "rpm", "tpm")),
            _when(r["created"]),
            _when(r["rotated"]),
        ]
        for r in rows
    ]
    return output.table([head, *body])


def _render_usage(rows: list[dict[str, Any]], since: str | None, fleet: bool = False) -> str:
    where = " on the fleet's front doors" if fleet else ""
    if not rows:
        return "no requests counted" + where + (f" in the last {since}" if since else " yet")
    head = ["KEY", "REQUESTS", "TOKENS IN", "TOKENS OUT", "QUEUED S", "429s"]
    body = [
        [
            r["key"],
            str(r["requests"]),
            str(r["in"]),
            str(r["out"]),
            f"{r['queued_s']:.1f}",
            str(r["limited"]),
        ]
        for r in rows
    ]
    table = output.table([head, *body])
    return f"the fleet's front doors, by the whole hour\n{table}" if fleet else table
