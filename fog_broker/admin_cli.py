"""``fogline token | devices | operators``: a person's hand on a site's trust, on the fog host.

These commands work on the fog's data dir directly (``fog_broker.site``), so
only someone who can read it (the fog's operator) can use them; a running
``fogline broker`` notices their changes within a second (trust.db). Each
prints what it did in one line, or one ``error:`` line and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["register_admin", "parse_duration"]


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``1h``, ``7d`` -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip().lower()
    mult = units.get(t[-1:])
    try:
        value = float(t[:-1] if mult else t) * (mult or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30m, 1h, 7d)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("a duration must be positive")
    return value


def register_admin(sub: Any) -> None:
    t = _group(sub, "token", "bootstrap tokens for enrolling devices (on the fog host)")
    tc = _action(t, "create", "print a new bootstrap token", _token_create)
    tc.add_argument("--ttl", type=parse_duration, default=3600.0, help="how long it is valid (1h)")
    tc.add_argument("--uses", type=int, default=1, help="how many devices may enrol with it (1)")
    tc.add_argument("--auto-approve", action="store_true",
                    help="approve devices that enrol with it at once (no `devices approve` step)")
    tc.add_argument("--description", default="", help="a note shown by `token list`")
    _action(t, "list", "list tokens (never their secrets)", _token_list, listing=True)
    _action(t, "delete", "delete a token", _token_delete, "id")

    d = _group(sub, "devices", "enrolled devices: list, approve, revoke, add by key (on the fog host)")
    _action(d, "list", "devices that enrolled or asked to", _devices_list, listing=True)
    _action(d, "approve", "approve a pending device (it gets its certificate)", _devices_approve, "id")
    dr = _action(d, "revoke", "cut a device off: certificate revoked, partitions re-placed", _devices_revoke,
                 "id")
    dr.add_argument("--reason", default="")
    dd = _action(d, "add", "pre-register a device's Ed25519 key (from `fogline agent key`)", _devices_add, "id")
    dd.add_argument("--key", required=True, metavar="HEX", help="the device's public key (64 hex characters)")
    _action(d, "remove", "forget a revoked or pending device (its id may enrol afresh)", _devices_remove, "id")

    o = _group(sub, "operators", "identities for people and programs: operators, coordinators, apps")
    oa = _action(o, "add", "issue credentials (TLS identity, signing key, fog.json) for NAME", _operators_add,
                 "name")
    oa.add_argument("--role", default="operator", choices=("operator", "coordinator", "app", "monitor"),
                    help="operator (deploy, delete, status, infer), coordinator (releases, summaries, status), "
                         "app (infer only), monitor (status only: Prometheus, the site page)")
    oa.add_argument("--out", type=Path, default=None, help="where to write them (default FOGDIR/credentials/NAME)")
    _action(o, "list", "issued identities", _operators_list, listing=True)
    _action(o, "revoke", "revoke an identity's certificate and signing key", _operators_revoke, "name")


def _group(sub: Any, name: str, help: str) -> Any:
    """``fogline NAME ACTION``: the parser's ``NAME_cmd`` holds the action."""
    p = sub.add_parser(name, help=help)
    return p.add_subparsers(dest=f"{name}_cmd", metavar="ACTION", required=True)


def _action(group: Any, name: str, help: str, func: Callable[[argparse.Namespace], int], *positionals: str,
            listing: bool = False) -> argparse.ArgumentParser:
    """One action: every one works on a fog data dir; ``listing`` ones can print JSON instead."""
    p: argparse.ArgumentParser = group.add_parser(name, help=help)
    p.add_argument("--data-dir", type=Path, required=True, metavar="FOGDIR", help="the fog broker's data dir")
    for positional in positionals:
        p.add_argument(positional)
    if listing:
        p.add_argument("--json", action="store_true")
    p.set_defaults(func=func)
    return p


@contextmanager
def _site(args: argparse.Namespace) -> Iterator[Any]:
    """The fog's ``Site`` in ``--data-dir``, closed when the action is done with it."""
    from runtime.errors import LocalViolation

    from .site import SITE_JSON, Site
    d = Path(args.data_dir)
    if not (d / SITE_JSON).exists() and not (d / "fog.key").exists():
        raise LocalViolation(f"{d} is not a fog data dir (start `fogline broker --data-dir {d}` once first)")
    site = Site(d)
    try:
        yield site
    finally:
        site.close()


def _missing(kind: str, name: str) -> int:
    print(f"error: no {kind} {name!r}", file=sys.stderr)
    return 2


def _token_create(args: argparse.Namespace) -> int:
    with _site(args) as site:
        token = site.create_token(time.time(), ttl_s=args.ttl, uses=args.uses, auto_approve=args.auto_approve,
                                  description=args.description)
    print(token)
    print(f"valid {args.ttl:g} s for {args.uses} device(s){', auto-approved' if args.auto_approve else ''}; "
          f"on a device: save it to a file only you can read, then fogline agent --broker HOST:PORT --id ID "
          f"--data-dir DIR --token-file FILE", file=sys.stderr)
    return 0


def _token_list(args: argparse.Namespace) -> int:
    with _site(args) as site:
        now = time.time()
        rows = [{"id": t.id, "uses_left": t.uses_left, "expires_in_s": round(t.expires_at - now),
                 "auto_approve": t.auto_approve, "description": t.description} for t in site.db.tokens()]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            state = "expired" if r["expires_in_s"] <= 0 else f"{r['expires_in_s']} s left"
            print(f"{r['id']}  uses left {r['uses_left']}  {state}{'  auto-approve' if r['auto_approve'] else ''}"
                  f"  {r['description']}")
    return 0


def _token_delete(args: argparse.Namespace) -> int:
    with _site(args) as site:
        if not site.db.delete_token(args.id):
            return _missing("token", args.id)
    print(f"token {args.id} deleted")
    return 0


def _devices_list(args: argparse.Namespace) -> int:
    from runtime.security import fingerprint
    with _site(args) as site:
        rows = [{"id": d.device_id, "state": d.state, "key": fingerprint(d.signing_key),
                 "certificate": bool(d.cert_pem), "token": d.token_id, "reason": d.reason} for d in site.db.devices()]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        from runtime.ids import is_id
        print(f"{'ID':<24} {'STATE':<9} {'KEY':<20} CERT  VIA")
        for r in rows:  # a name stored before ids were checked whole is shown escaped: one line a device
            shown = r["id"] if is_id(r["id"]) else repr(r["id"])
            print(f"{shown:<24} {r['state']:<9} {r['key']:<20} {'yes' if r['certificate'] else 'no':<5} "
                  f"{r['token']}  {r['reason']}")
    return 0


def _devices_approve(args: argparse.Namespace) -> int:
    with _site(args) as site:
        rec = site.approve_device(args.id, time.time())
    print(f"device {rec.device_id} approved{' (certificate issued)' if rec.cert_pem else ''}")
    return 0


def _devices_revoke(args: argparse.Namespace) -> int:
    with _site(args) as site:
        site.revoke_device(args.id, time.time(), args.reason)
    print(f"device {args.id} revoked: the running fog broker cuts it off and re-places its partitions")
    return 0


def _devices_add(args: argparse.Namespace) -> int:
    with _site(args) as site:
        try:
            key = bytes.fromhex(args.key)
        except ValueError:
            key = b""
        rec = site.add_device(args.id, key, time.time())
    print(f"device {rec.device_id} added with key {args.key[:16]}... (approved)")
    return 0


def _devices_remove(args: argparse.Namespace) -> int:
    with _site(args) as site:
        gone = site.remove_device(args.id)
    if not gone:
        return _missing("device", args.id)
    print(f"device {args.id} removed")
    return 0


def _operators_add(args: argparse.Namespace) -> int:
    with _site(args) as site:
        out = site.issue_credentials(args.name, args.role, args.out, time.time())
    print(f"{args.role} {args.name}: credentials in {out} (give that directory to them; "
          f"use it with --credentials {out})")
    return 0


def _operators_list(args: argparse.Namespace) -> int:
    from runtime.security import fingerprint
    with _site(args) as site:
        rows = [{"name": r.name, "role": r.role, "key": fingerprint(r.signing_key), "revoked": r.revoked}
                for r in site.db.identities()]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"{r['name']:<24} {r['role']:<12} {r['key']}{'  REVOKED' if r['revoked'] else ''}")
    return 0


def _operators_revoke(args: argparse.Namespace) -> int:
    with _site(args) as site:
        site.revoke_identity(args.name, time.time())
    print(f"{args.name} revoked")
    return 0
