"""Flower's SuperLink with only its Fleet API on the address devices dial (``python -m cloud_coordinator.superlink``).

``flower-superlink`` 1.41 serves the Fleet, Control and Runtime (ServerAppIo)
APIs on one HTTP listener (``--host``/``--port``), and its Control API has no
authentication unless (enterprise) account auth is on: whoever holds the
SuperLink's public CA certificate, as every device does, could ``flwr ls``,
``flwr supernode register`` a key of their own and ``flwr run`` an app whose
ServerApp runs on the coordinator host. Flower has no flag to split them.

So this runs Flower's own SuperLink application (its ``create_app``,
lifespan, SuperExec, middleware and SuperNode authentication, unchanged) on
two listeners of one event loop:

* ``--host``/``--port`` (a loopback address): every API, for the
  supervisor's ``flwr`` commands and the SuperExec that launches ServerApps;
* ``--fleet-address HOST:PORT`` (what devices dial): the same application
  behind a filter that passes only the Fleet API's exact routes (``POST
  /v1/fleet/...``, taken from Flower's Fleet router); anything else is a 404
  before Flower sees it.

The loopback listener is no boundary between the accounts of one host: any
local user (``nobody`` too) could reach it and ``flwr run`` code as the
coordinator's user, who holds every site's credentials. Flower's CLI and
SuperExec dial only TCP (no unix socket), so the listener asks the kernel who
owns each connection's other end (sock_diag, else ``/proc/net/tcp``: the peer
socket's uid, as identd did) and answers 403 unless it is this process's own user
(``own_user_only``). Everything the SuperLink creates (``superlink.db``) is
its user's alone (umask 077).

Why not a TLS proxy in front of a stock ``flower-superlink``: it would parse
and re-send every Fleet request (SuperNode signatures, large objects) through
a second HTTP stack of ours; here a device's request reaches Flower's code
exactly as it would have, on the same TLS certificate, with no extra hop.
The cost is that this depends on the SuperLink's Python entry points (pinned
Flower); the security test fails loudly if they change.
"""
from __future__ import annotations

import asyncio
import os
import socket
import struct
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from runtime.guard import take_descendants_when_parent_dies

__all__ = ["FLEET_ADDRESS_FLAG", "fleet_only", "fleet_paths", "main", "split_argv", "own_user_only",
           "socket_owner", "peer_uid"]

FLEET_ADDRESS_FLAG = "--fleet-address"
Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def fleet_paths() -> frozenset[str]:
    """The Fleet API's routes as Flower declares them (``/v1/fleet/pull-messages``, ...)."""
    from flwr.superlink.routers.fleet.router import router

    return frozenset(str(getattr(r, "path", "")) for r in router.routes if getattr(r, "path", ""))


def fleet_only(app: ASGIApp, allowed: frozenset[str]) -> ASGIApp:
    """``app`` for ``POST`` to exactly ``allowed`` paths; every other request gets a 404 without reaching it."""
    async def filtered(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST" and not scope.get("root_path") \
                and scope.get("path") in allowed:
            await app(scope, receive, send)
            return
        if scope["type"] == "http":
            body = b"not found\n"
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        # lifespan: the loopback listener runs Flower's lifespan, once

    return filtered


def _hex_address(host: str, port: int) -> tuple[str, str]:
    """(``/proc/net/tcp`` form, ``/proc/net/tcp6`` form) of ``host:port`` (kernel words in host order)."""
    if ":" in host:
        raw6 = socket.inet_pton(socket.AF_INET6, host)
        v4 = ""
        if raw6[:12] == b"\0" * 10 + b"\xff\xff":  # ::ffff:a.b.c.d is also a v4 socket's peer
            v4 = f"{struct.unpack('=I', raw6[12:])[0]:08X}:{port:04X}"
    else:
        raw6 = b"\0" * 10 + b"\xff\xff" + socket.inet_aton(host)
        v4 = f"{struct.unpack('=I', socket.inet_aton(host))[0]:08X}:{port:04X}"
    v6 = "".join(f"{w:08X}" for w in struct.unpack("=4I", raw6)) + f":{port:04X}"
    return v4, v6


def socket_owner(table: str, local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The uid owning the socket ``local`` -> ``remote`` in a ``/proc/net/tcp``/``tcp6`` text; None when absent."""
    want = {(a, b) for a, b in zip(_hex_address(*local), _hex_address(*remote)) if a and b}
    for line in table.splitlines()[1:]:
        f = line.split()
        if len(f) > 7 and (f[1], f[2]) in want:
            return int(f[7])
    return None


_SOCK_DIAG_BY_FAMILY = 20
_NETLINK_SOCK_DIAG = 4


def _diag_uid(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The kernel's sock_diag answer for one TCP socket (an exact lookup: ~20 us, where reading
    /proc/net/tcp walks every socket of the host, ~35 ms on a loaded one); None when absent."""
    fam = socket.AF_INET6 if ":" in local[0] else socket.AF_INET

    def addr(host: str) -> bytes:
        raw = socket.inet_pton(fam, host)
        return raw + b"\0" * (16 - len(raw))

    # inet_diag_req_v2: family, protocol, ext, pad, states; inet_diag_sockid: ports (network order),
    # addresses, interface, cookie (INET_DIAG_NOCOOKIE: match on the addresses alone)
    sockid = struct.pack("!HH", local[1], remote[1]) + addr(local[0]) + addr(remote[0]) + \
        struct.pack("=III", 0, 0xFFFFFFFF, 0xFFFFFFFF)
    req = struct.pack("=BBBxI", fam, socket.IPPROTO_TCP, 0, 0xFFFFFFFF) + sockid
    msg = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, 1, 1, 0) + req  # NLM_F_REQUEST
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as s:
        s.settimeout(1.0)
        s.sendto(msg, (0, 0))
        data = s.recv(65536)
    if len(data) < 16 + 4 + 48 + 16 or struct.unpack_from("=H", data, 4)[0] != _SOCK_DIAG_BY_FAMILY:
        return None  # NLMSG_ERROR (no such socket)
    uid: int = struct.unpack_from("=I", data, 16 + 4 + 48 + 12)[0]  # inet_diag_msg.idiag_uid
    return uid


def peer_uid(client: tuple[str, int], server: tuple[str, int]) -> int | None:
    """The uid of the process end of a loopback TCP connection (the client's socket), None when unknown."""
    try:
        return _diag_uid(client, server)
    except (OSError, ValueError, struct.error):
        pass  # no sock_diag here: the /proc tables say the same, slowly
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name, encoding="ascii") as f:
                uid = socket_owner(f.read(), client, server)
        except (OSError, ValueError):
            continue
        if uid is not None:
            return uid
    return None


def own_user_only(app: ASGIApp, uid: int, owner: Callable[[tuple[str, int], tuple[str, int]], int | None] = peer_uid
                  ) -> ASGIApp:
    """``app`` for connections whose client socket belongs to ``uid``; 403 for any other local account
    (and when the owner cannot be told: fail closed)."""
    async def guarded(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            client, server = scope.get("client"), scope.get("server")
            who = owner(tuple(client), tuple(server)) if client and server else None
            if who != uid:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                body = b"forbidden: this SuperLink's local API serves only its own user\n"
                await send({"type": "http.response.start", "status": 403,
                            "headers": [(b"content-type", b"text/plain"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await app(scope, receive, send)

    return guarded


def split_argv(argv: list[str]) -> tuple[tuple[str, int], list[str]]:
    """((fleet host, port), the remaining ``flower-superlink`` arguments); ValueError when missing or malformed."""
    rest: list[str] = []
    fleet = ""
    it = iter(argv)
    for a in it:
        if a == FLEET_ADDRESS_FLAG:
            fleet = next(it, "")
        elif a.startswith(FLEET_ADDRESS_FLAG + "="):
            fleet = a.split("=", 1)[1]
        else:
            rest.append(a)
    host, _, port = fleet.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{FLEET_ADDRESS_FLAG} HOST:PORT is required (got {fleet!r})")
    return (host.strip("[]"), int(port)), rest


async def _serve(inner: Any, outer: Any) -> None:
    """The loopback server first (its lifespan starts the SuperLink's state and SuperExec), then the devices'."""
    t_inner = asyncio.ensure_future(inner.serve())
    while not inner.started:
        if t_inner.done():
            await t_inner
            return
        await asyncio.sleep(0.05)
    t_outer = asyncio.ensure_future(outer.serve())
    await asyncio.wait({t_inner, t_outer}, return_when=asyncio.FIRST_COMPLETED)
    inner.should_exit = outer.should_exit = True  # one listener gone (signal or failure): stop both
    await asyncio.gather(t_inner, t_outer, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    take_descendants_when_parent_dies()  # the SuperExec and ServerApps are Flower's children
    import uvicorn
    from flwr.supercore.http_logging import get_uvicorn_log_config
    from flwr.supercore.logger import console_handler
    from flwr.superlink.cli.flower_superlink import (
        SuperLinkLifespan,
        _parse_superlink_lifespan_config,
    )
    from flwr.superlink.main import create_app

    from runtime.net import is_loopback

    try:
        (fhost, fport), rest = split_argv(list(sys.argv[1:] if argv is None else argv))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.argv = ["flower-superlink", *rest]
    config = _parse_superlink_lifespan_config()
    if not is_loopback(config.host):
        print(f"error: --host {config.host} serves the Control and Runtime APIs: a loopback address only "
              f"(devices dial {FLEET_ADDRESS_FLAG})", file=sys.stderr)
        return 2
    os.umask(0o077)  # superlink.db and whatever else Flower writes: this user's alone
    app = create_app(config, SuperLinkLifespan)
    common: dict[str, Any] = {"ssl_keyfile": config.ssl_keyfile, "ssl_certfile": config.ssl_certfile,
                              "log_config": get_uvicorn_log_config(console_handler.level), "workers": 1}
    inner = uvicorn.Server(uvicorn.Config(own_user_only(app, os.getuid()), host=config.host, port=config.port,
                                          lifespan="on", **common))
    outer = uvicorn.Server(uvicorn.Config(fleet_only(app, fleet_paths()), host=fhost, port=fport, lifespan="off",
                                          **common))
    asyncio.run(_serve(inner, outer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
