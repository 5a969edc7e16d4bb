"""``fogline sites status|release|resume``: the coordinator's sites and staged rollouts from its checkpoint dir.

``status`` reads what the coordinator wrote (it never connects: the broker
binds each identity to one connection, and the running coordinator holds
it). ``release`` puts a model in the outbox and runs its staged rollout
without Flower; ``resume`` finishes the rollouts a stopped coordinator left.
Exit codes: 0 done, 1 a rollout stopped (rolled back or failed), 2 bad
input, 3 still rolling out when ``--wait`` ran out (the state is saved:
``resume`` goes on from there).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["register", "add_site_options", "site_table", "rollout_line", "status_doc"]


def add_site_options(p: argparse.ArgumentParser, *, with_insecure: bool = True) -> None:
    from runtime import cliargs as ca

    g = p.add_argument_group("sites and staged rollouts (docs/sites.md)")
    g.add_argument("--site", dest="site_args", action="append", default=[], metavar="NAME=DIR[@HOST:PORT]",
                   help="a site: the coordinator credentials its fog issued (repeatable); the address defaults "
                        "to the one in DIR/fog.json")
    g.add_argument("--sites", dest="sites_file", type=ca.existing_file, default=None, metavar="SITES.toml",
                   help="sites ([sites.NAME] credentials, mqtt, canary, order) and [rollout] settings")
    g.add_argument("--canary", default=None, metavar="NAME", help="the canary site (default: canary = true, "
                                                                   "else the first site)")
    g.add_argument("--rollout-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a rollout setting, e.g. serve_timeout_s=60, latency_factor=5 (repeatable)")
    g.add_argument("--holdout", default=None, metavar="FILE.npz", type=ca.existing_file,
                   help="held-out inputs for the canary check (one array per model input; default: random)")
    if with_insecure:
        g.add_argument("--insecure", action="store_true", help="plain MQTT (loopback sites only)")


def site_table(args: argparse.Namespace, work: Path, *, legacy: Any = None, use_saved: bool = False,
               insecure: bool = False) -> Any:
    """The checked ``SiteTable`` from the flags (or ``legacy`` credentials + --mqtt, or the saved table); saved."""
    from runtime.net import require_loopback

    from .rollout import RolloutPolicy
    from .sites import SiteSpec, load_sites_toml, load_table, parse_site_arg, resolve, save_table

    specs = [parse_site_arg(a) for a in args.site_args]
    settings: dict[str, Any] = {}
    if args.sites_file is not None:
        more, settings = load_sites_toml(args.sites_file)
        specs = more + specs
    canary = args.canary
    if legacy is not None:
        specs = [SiteSpec(legacy.fog.site, str(legacy.dir), args.mqtt)]
    elif not specs and use_saved:
        specs, saved_canary, settings, saved_insecure, _ = load_table(work)
        canary = canary or saved_canary
        insecure = insecure or saved_insecure
    policy = RolloutPolicy.from_mapping(settings)
    policy = RolloutPolicy.from_pairs(args.rollout_set, policy)
    if args.holdout:
        policy = RolloutPolicy.from_mapping({"holdout": str(Path(args.holdout).expanduser().resolve())}, policy)
    table = resolve(specs, canary, policy)
    if insecure:
        for s in table.sites:
            require_loopback(s.host)
    work.mkdir(parents=True, exist_ok=True)  # only once the sites check out: a refusal leaves nothing
    save_table(work, table, insecure=insecure)
    return table


def register(subparsers: Any) -> None:
    from runtime import cliargs as ca


    p = subparsers.add_parser("sites", help="the coordinator's sites and staged release rollouts",
                              description="Every site the coordinator serves, and staged rollouts: the canary "
                                          "first, checked, then the others in order (docs/sites.md).")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    st = sub.add_parser("status", help="every site: reachable, summary age, devices, releases, rollouts")
    st.add_argument("names", nargs="*", metavar="SITE", help="only these sites")
    st.add_argument("--checkpoint-dir", required=True, type=ca.existing_dir)
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=status_cmd)
    rel = sub.add_parser("release", help="sign MODEL.onnx into the outbox and roll it out (no Flower)")
    rel.add_argument("model", type=ca.existing_file)
    rel.add_argument("--name", required=True)
    rel.add_argument("--version", type=ca.positive_int, default=None,
                     help="default: one above the newest in the outbox")
    rel.add_argument("--checkpoint-dir", required=True, type=ca.writable_dir)
    rel.add_argument("--wait", type=ca.nonneg_float, default=600.0,
                     help="give up waiting after this many seconds (exit 3)")
    add_site_options(rel)
    rel.set_defaults(func=release_cmd)
    res = sub.add_parser("resume", help="finish the rollouts a stopped coordinator left")
    res.add_argument("--checkpoint-dir", required=True, type=ca.existing_dir)
    res.add_argument("--wait", type=ca.nonneg_float, default=600.0)
    add_site_options(res)
    res.set_defaults(func=resume_cmd)


def _error(text: str) -> int:
    print(f"error: {text}", file=sys.stderr)
    return 2


# ------------------------------------------------------------------ release / resume


def _run_service(args: argparse.Namespace, work: Path, table: Any, insecure: bool, *,
                 add: tuple[Path, str, int | None] | None = None) -> int:
    from runtime.errors import LocalViolation
    from runtime.security import Identity

    from .release import build_release, onnx_file, release_path, version_for, write_release
    from .settings import RELEASES_DIR, key_path
    from .siteservice import SiteService

    signer = Identity.load_or_create("coordinator", key_path(work, "coordinator.key"))
    service = SiteService(work, table, signer, insecure=insecure)
    if add is not None:
        model, name, version = add
        blob = onnx_file(model)
        out = work / RELEASES_DIR
        version = version if version is not None else version_for(out, name, 1)
        if release_path(out, name, version).exists():
            raise LocalViolation(f"{name} v{version} is already in {out} (fogline sites resume goes on with it); "
                                 "give another --version")
        path = write_release(out, build_release(blob, signer, name, version, {"source": model.name}))
        print(f"{path.name}: {name} v{version}, {len(blob)} bytes", file=sys.stderr)
    service.start()
    try:
        done = service.drain(args.wait)
    except KeyboardInterrupt:
        done = False
    finally:
        service.stop()
    outcomes = service.outcomes()
    for r in outcomes:
        print(rollout_line(r))
    if not done:
        active = service.snapshot()
        print(f"still rolling out after {args.wait:g} s ({_active_text(active)}); the state is saved: "
              f"fogline sites resume --checkpoint-dir {work}", file=sys.stderr)
        return 3
    stopped = [r for r in outcomes if r["step"] in ("rolled back", "failed")]
    for r in stopped:
        print(f"error: rollout of {r['name']} v{r['version']} stopped ({r['step']}): {r['reason']}", file=sys.stderr)
    return 1 if stopped else 0


def release_cmd(args: argparse.Namespace) -> int:
    from runtime.errors import FoglineError

    from .release import ReleaseError, valid_release_name

    work = args.checkpoint_dir.resolve()
    try:
        if not valid_release_name(args.name):
            return _error(f"invalid release name {args.name!r} (letters, digits, . _ -; at most 64)")
        if args.version is not None and args.version < 1:
            return _error("--version must be >= 1")
        from .release import onnx_file

        onnx_file(args.model)  # a bad model is refused before anything is written in the checkpoint dir
        table = site_table(args, work, use_saved=True, insecure=args.insecure)
        return _run_service(args, work, table, args.insecure, add=(args.model, args.name, args.version))
    except (FoglineError, ReleaseError, ValueError) as exc:
        return _error(str(exc))


def resume_cmd(args: argparse.Namespace) -> int:
    from runtime.errors import FoglineError

    work = args.checkpoint_dir.resolve()
    try:
        table = site_table(args, work, use_saved=True, insecure=args.insecure)
        return _run_service(args, work, table, args.insecure)
    except (FoglineError, ValueError) as exc:
        return _error(str(exc))


# ------------------------------------------------------------------ status


def _active_text(book: dict[str, Any]) -> str:
    for r in book.get("rollouts", []):
        if r["step"] not in ("queued", "done", "rolled back", "failed", "superseded", "unchanged"):
            return f"{r['name']} v{r['version']} at {r['step']}" + (f", waiting for {r['waiting_for']}"
                                                                     if r.get("waiting_for") else "")
    return "nothing active"


def rollout_line(r: dict[str, Any]) -> str:
    name = f"{r['name']} v{r['version']}"
    if r["step"] == "done":
        sites = [s for s, st in r["sites"].items() if st["state"] == "accepted"]
        extra = f"; {r['reason']}" if r.get("reason") else ""
        where = ", ".join(sites) if sites else "(before staged rollouts)"
        return f"rollout {name}: done on {where}{extra}"
    if r["step"] in ("rolled back", "failed", "superseded"):
        return f"rollout {name}: {r['step']}: {r['reason']}"
    if r["step"] == "unchanged":
        return f"rollout {name}: {r['reason']}"
    wait = f" (waiting for {r['waiting_for']})" if r.get("waiting_for") else ""
    return f"rollout {name}: {r['step']}{wait}"


def _age(at: float | None, now: float) -> str:
    if at is None:
        return "never"
    s = max(0.0, now - at)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.0f} h ago"


def status_doc(work: Path, names: list[str] | None = None) -> dict[str, Any]:
    """What ``fogline sites status`` shows, from the checkpoint dir only."""
    from runtime.errors import LocalViolation

    from .sites import ROLLOUTS_FILE, STATUS_FILE, load_table, summaries_dir_of
    from .summaries import SiteKey, latest_summary

    _, canary, _, _, rows = load_table(work)
    known = [r["name"] for r in rows]
    for n in names or ():
        if n not in known:
            raise LocalViolation(f"unknown site {n!r} (sites: {', '.join(known)})")
    try:
        live = json.loads((work / STATUS_FILE).read_text())
    except (OSError, ValueError):
        live = {"at": None, "sites": {}}
    try:
        book = json.loads((work / ROLLOUTS_FILE).read_text())
    except (OSError, ValueError):
        book = {"rollouts": []}
    now = time.time()
    at = live.get("at")
    fresh = at is not None and now - at < 10 and not live.get("stopped")
    sites = []
    for i, row in enumerate(rows):
        name = row["name"]
        if names and name not in names:
            continue
        info = dict(live.get("sites", {}).get(name) or {})
        key = SiteKey(str(summaries_dir_of(work, name)), row["fog_id"], row["fog_key"], row["fog_site"])
        summ = latest_summary(key)
        devs = summ.devices if summ is not None else ()
        rollouts = {}
        for r in book.get("rollouts", []):
            st = r.get("sites", {}).get(name)
            if st is not None and r["step"] != "queued":
                rollouts[f"{r['name']} v{r['version']}"] = st["state"] + (f" ({st['detail']})" if st.get("detail")
                                                                            else "")
        sites.append({
            "name": name, "role": "canary" if name == canary else f"#{i}", "address": row.get("address"),
            "identity": row.get("identity"), "fog_id": row["fog_id"],
            "reachable": bool(info.get("reachable")) if fresh else None,
            "error": info.get("error") if fresh else None,
            "last_contact_at": info.get("last_contact_at"),
            "summary_at": summ.timestamp if summ is not None else None,
            "devices_live": sum(d.alive for d in devs) if summ is not None else None,
            "devices_fit": sum(d.alive and d.fit_for_training for d in devs) if summ is not None else None,
            "devices_total": len(devs) if summ is not None else None,
            "releases": info.get("releases") or {},
            "rollouts": rollouts})
    return {"checkpoint_dir": str(work), "coordinator_running": fresh, "updated_at": at, "canary": canary,
            "sites": sites, "active": _active_text(book), "selection": last_selection(work),
            "rounds": round_status(work),
            "rollouts": [{**r, "line": rollout_line(r)} for r in book.get("rollouts", [])[-20:]]}


def round_status(work: Path) -> dict[str, Any] | None:
    """The training rounds at a glance: the attempt in progress (progress.json: quorum, retries, current
    deadline, what it waits for) and the last finished round's usable replies against its quorum (report.json)."""
    from .settings import PROGRESS_FILE, REPORT_FILE

    out: dict[str, Any] = {}
    try:
        p = json.loads((work / PROGRESS_FILE).read_text())
        out.update({k: p[k] for k in ("round", "attempt", "quorum", "retries", "retried", "deadline_s", "waiting",
                                      "at") if k in p})
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    try:
        history = json.loads((work / REPORT_FILE).read_text()).get("history") or []
        last = history[-1] if history and isinstance(history[-1], dict) else {}
        out["last"] = {k: last[k] for k in ("round", "replies", "quorum", "retried") if k in last} or None
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return out or None


def round_line(r: dict[str, Any]) -> str:
    """``fogline status --coordinator``'s rounds line: replies against the quorum, retries, the deadline."""
    parts = []
    if "round" in r:
        parts.append(f"round {r['round']} attempt {r.get('attempt', '?')}")
    if "quorum" in r:
        parts.append(f"quorum {r['quorum']}")
    if "deadline_s" in r:
        parts.append(f"deadline {float(r['deadline_s']):.3g} s")
    parts.append(f"retries {r.get('retries', 0)}" + (f" (last: {r['retried']})" if r.get("retried") else ""))
    last = r.get("last") or {}
    if "replies" in last:
        parts.append(f"last done: round {last.get('round')} {last['replies']}/{last.get('quorum', '?')} replies")
    return "rounds: " + ", ".join(parts) + (f"; {r['waiting']}" if r.get("waiting") else "")


def last_selection(work: Path) -> dict[str, Any] | None:
    """The newest round's per-device selection reasons: the running ServerApp's progress, else the report."""
    from .settings import PROGRESS_FILE, REPORT_FILE

    try:
        sel = json.loads((work / PROGRESS_FILE).read_text()).get("selection")
        if isinstance(sel, dict):
            return sel
    except (OSError, ValueError, AttributeError):
        pass
    try:
        history = json.loads((work / REPORT_FILE).read_text()).get("history") or []
    except (OSError, ValueError, AttributeError):
        return None
    for h in reversed(history):
        if isinstance(h, dict) and isinstance(h.get("selection"), dict):
            return {"round": h.get("round"), **h["selection"]}
    return None


def status_cmd(args: argparse.Namespace) -> int:
    from runtime.errors import FoglineError

    work = args.checkpoint_dir.resolve()
    try:
        doc = status_doc(work, args.names)
    except FoglineError as exc:
        rounds = round_status(work)
        if rounds is None or args.names:
            return _error(str(exc))
        # a coordinator without sites still trains: its rounds are worth showing
        if args.json:
            print(json.dumps({"checkpoint_dir": str(work), "sites": None, "rounds": rounds}, indent=1, default=str))
        else:
            print(f"{work}: {exc}")
            print(round_line(rounds))
        return 0
    if args.json:
        print(json.dumps(doc, indent=1, default=str))
        return 0
    now = time.time()
    head = ("coordinator running" if doc["coordinator_running"] else
            f"coordinator not running (last seen {_age(doc['updated_at'], now)}): reachability unknown")
    print(f"{work}: {head}; canary {doc['canary']}")
    rows = [("SITE", "ROLE", "ADDRESS", "REACHABLE", "SUMMARY", "LIVE/FIT/ALL", "RELEASES")]
    for s in doc["sites"]:
        reach = ("?" if s["reachable"] is None else "yes" if s["reachable"] else "NO")
        if s["reachable"] is None and s["last_contact_at"]:
            reach = f"? (answered {_age(s['last_contact_at'], now)})"
        devs = "-" if s["devices_total"] is None else f"{s['devices_live']}/{s['devices_fit']}/{s['devices_total']}"
        rels = " ".join(f"{n} v{v}" for n, v in sorted(s["releases"].items())) or "-"
        rows.append((s["name"], s["role"], s["address"] or "-", reach, _age(s["summary_at"], now), devs, rels))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    for s in doc["sites"]:
        if s["reachable"] is False and s["error"]:
            print(f"  {s['name']}: {s['error']}")
    if doc.get("rounds"):
        print(round_line(doc["rounds"]))
    if doc.get("selection"):
        from .selection import selection_line

        print(f"round {doc['selection'].get('round')} {selection_line(doc['selection'])}")
    print(f"rollouts ({doc['active']}):")
    for r in reversed(doc["rollouts"][-10:]):
        print(f"  {r['line']}")
        if r["step"] not in ("queued", "superseded", "unchanged"):
            print("    " + ", ".join(f"{site}: {st['state']}" for site, st in r["sites"].items()))
    return 0
