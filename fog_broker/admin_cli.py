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
from pathlib import Path
from typing import Any

__all__ = ["register_admin", "parse_duration"]


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``1h``, ``7d`` -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip().lower()
    mult = units.get(t[-1:], None)
    try:
        value = float(t[:-1] if mult else t) * (mult or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30m, 1h, 7d)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("a duration must be positive")
    return value


def register_admin(sub: Any) -> None:
    t = sub.add_parser("token", help="bootstrap tokens for enrolling devices (on the fog host)")
    tsub = t.add_subparsers(dest="token_cmd", metavar="ACTION", required=True)
    tc = tsub.add_parser("create", help="print a new bootstrap token")
    _dir_arg(tc)
    tc.add_argument("--ttl", type=parse_duration, default=3600.0, help="how long it is valid (1h)")
    tc.add_argument("--uses", type=int, default=1, help="how many devices may enrol with it (1)")
    tc.add_argument("--auto-approve", action="store_true",
                    help="approve devices that enrol with it at once (no `devices approve` step)")
    tc.add_argument("--description", default="", help="a note shown by `token list`")
    tc.set_defaults(func=_token_create)
    tl = tsub.add_parser("list", help="list tokens (never their secrets)")
    _dir_arg(tl)
    tl.add_argument("--json", action="store_true")
    tl.set_defaults(func=_token_list)
    td = tsub.add_parser("delete", help="delete a token")
    _dir_arg(td)
    td.add_argument("id")
    td.set_defaults(func=_token_delete)

    d = sub.add_parser("devices", help="enrolled devices: list, approve, revoke, add by key (on the fog host)")
    dsub = d.add_subparsers(dest="devices_cmd", metavar="ACTION", required=True)
    dl = dsub.add_parser("list", help="devices that enrolled or asked to")
    _dir_arg(dl)
    dl.add_argument("--json", action="store_true")
    dl.set_defaults(func=_devices_list)
    da = dsub.add_parser("approve", help="approve a pending device (it gets its certificate)")
    _dir_arg(da)
    da.add_argument("id")
    da.set_defaults(func=_devices_approve)
    dr = dsub.add_parser("revoke", help="cut a device off: certificate revoked, partitions re-placed")
    _dir_arg(dr)
    dr.add_argument("id")
    dr.add_argument("--reason", default="")
    dr.set_defaults(func=_devices_revoke)
    dd = dsub.add_parser("add", help="pre-register a device's Ed25519 key (from `fogline agent key`)")
    _dir_arg(dd)
    dd.add_argument("id")
    dd.add_argument("--key", required=True, metavar="HEX", help="the device's public key (64 hex characters)")
    dd.set_defaults(func=_devices_add)
    dx = dsub.add_parser("remove", help="forget a revoked or pending device (its id may enrol afresh)")
    _dir_arg(dx)
    dx.add_argument("id")
    dx.set_defaults(func=_devices_remove)

    o = sub.add_parser("operators", help="identities for people and programs: operators, coordinators, apps")
    osub = o.add_subparsers(dest="operators_cmd", metavar="ACTION", required=True)
    oa = osub.add_parser("add", help="issue credentials (TLS identity, signing key, fog.json) for NAME")
    _dir_arg(oa)
    oa.add_argument("name")
    oa.add_argument("--role", default="operator", choices=("operator", "coordinator", "app", "monitor"),
                    help="operator (deploy, delete, status, infer), coordinator (releases, summaries, status), "
                         "app (infer only), monitor (status only: Prometheus, the site page)")
    oa.add_argument("--out", type=Path, default=None, help="where to write them (default FOGDIR/credentials/NAME)")
    oa.set_defaults(func=_operators_add)
    ol = osub.add_parser("list", help="issued identities")
    _dir_arg(ol)
    ol.add_argument("--json", action="store_true")
    ol.set_defaults(func=_operators_list)
    orv = osub.add_parser("revoke", help="revoke an identity's certificate and signing key")
    _dir_arg(orv)
    orv.add_argument("name")
    orv.set_defaults(func=_operators_revoke)


def _dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, required=True, metavar="FOGDIR", help="the fog broker's data dir")


def _site(args: argparse.Namespace) -> Any:
    from runtime.errors import LocalViolation

    from .site import SITE_JSON, Site
    d = Path(args.data_dir)
    if not (d / SITE_JSON).exists() and not (d / "fog.key").exists():
        raise LocalViolation(f"{d} is not a fog data dir (start `fogline broker --data-dir {d}` once first)")
    return Site(d)


def _token_create(args: argparse.Namespace) -> int:
    site = _site(args)
    try:
        token = site.create_token(time.time(), ttl_s=args.ttl, uses=args.uses, auto_approve=args.auto_approve,
                                  description=args.description)
    finally:
        site.close()
    print(token)
    print(f"valid {args.ttl:g} s for {args.uses} device(s){', auto-approved' if args.auto_approve else ''}; "
          f"on a device: fogline agent --broker HOST:PORT --id ID --data-dir DIR --token TOKEN", file=sys.stderr)
    return 0


def _token_list(args: argparse.Namespace) -> int:
    site = _site(args)
    try:
        now = time.time()
        rows = [{"id": t.id, "uses_left": t.uses_left, "expires_in_s": round(t.expires_at - now),
                 "auto_approve": t.auto_approve, "description": t.description} for t in site.db.tokens()]
    finally:
        site.close()
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            state = "expired" if r["expires_in_s"] <= 0 else f"{r['expires_in_s']} s left"
            print(f"{r['id']}  uses left {r['uses_left']}  {state}{'  auto-approve' if r['auto_approve'] else ''}"
                  f"  {r['description']}")
    return 0


def _token_delete(args: argparse.Namespace) -> int:
    site = _site(args)
    try:
        if not site.db.delete_token(args.id):
            print(f"error: no token {args.id!r}", file=sys.stderr)
            return 2
    finally:
        site.close()
    print(f"token {args.id} deleted")
    return 0


def _devices_list(args: argparse.Namespace) -> int:
    from runtime.security import fingerprint
    site = _site(args)
    try:
        rows = [{"id": d.device_id, "state": d.state, "key": fingerprint(d.signing_key),
                 "certificate": bool(d.cert_pem), "token": d.token_id, "reason": d.reason} for d in site.db.devices()]
    finally:
        site.close()
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
    site = _site(args)
    try:
        rec = site.approve_device(args.id, time.time())
    finally:
        site.close()
    print(f"device {rec.device_id} approved{' (certificate issued)' if rec.cert_pem else ''}")
    return 0


def _devices_revoke(args: argparse.Namespace) -> int:
    site = _site(args)
    try:
        site.revoke_device(args.id, time.time(), args.reason)
    finally:
        site.close()
    print(f"device {args.id} revoked: the running fog broker cuts it off and re-places its partitions")
    return 0


def _devices_add(args: argparse.Namespace) -> int:
    site = _site(args)
    try:
        try:
            key = bytes.fromhex(args.key)
        except ValueError:
            key = b""
        rec = site.add_device(args.id, key, time.time())
    finally:
        site.close()
    print(f"device {rec.device_id} added with key {args.key[:16]}... (approved)")
    return 0


def _devices_remove(args: argparse.Namespace) -> int:
    site = _site(args)
    try:
        gone = site.remove_device(args.id)
    finally:
        site.close()
    if not gone:
        print(f"error: no device {args.id!r}", file=sys.stderr)
        return 2
    print(f"device {args.id} removed")
    return 0


def _operators_add(args: argparse.Namespace) -> int:
    site = _site(args)
    try:
        out = site.issue_credentials(args.name, args.role, args.out, time.time())
    finally:
        site.close()
    print(f"{args.role} {args.name}: credentials in {out} (give that directory to them; "
          f"use it with --credentials {out})")
    return 0


def _operators_list(args: argparse.Namespace) -> int:
    from runtime.security import fingerprint
    site = _site(args)
    try:
        rows = [{"name": r.name, "role": r.role, "key": fingerprint(r.signing_key), "revoked": r.revoked}
                for r in site.db.identities()]
    finally:
        site.close()
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"{r['name']:<24} {r['role']:<12} {r['key']}{'  REVOKED' if r['revoked'] else ''}")
    return 0


def _operators_revoke(args: argparse.Namespace) -> int:
    site = _site(args)
    try:
        site.revoke_identity(args.name, time.time())
    finally:
        site.close()
    print(f"{args.name} revoked")
    return 0
