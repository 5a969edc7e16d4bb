"""``fogline broker | status | deploy | infer | undeploy``: the live fog broker and its clients.

Registered from ``fog_broker.cli.register`` by one call to ``register_service``.
Heavy imports happen inside the handlers.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["register_service"]

log = logging.getLogger("fog_broker")

DEFAULT_SITE = "default"


def _coordinator_key(text: str) -> str:
    """``NAME=HEX``: a coordinator's Ed25519 public key (64 hex characters) given out of band."""
    name, sep, hexkey = text.partition("=")
    try:
        ok = bool(sep and name) and len(bytes.fromhex(hexkey)) == 32
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"expected NAME=HEX (64 hex characters), got {text!r}")
    return text


_coordinator_key.kind = "name"  # type: ignore[attr-defined]  # for tests/runtime/test_cli_bad_input.py


def register_service(sub: Any) -> None:
    from runtime import cliargs as ca

    p = sub.add_parser("broker", help="run a fog broker (owns the site's MQTT broker)",
                       description="Run the live fog broker: fleet registry, deployment controller, inference "
                                   "router. Secure by default: on first start it makes the site CA, the broker "
                                   "and fog certificates and the first operator's credentials "
                                   "(DATA_DIR/credentials/admin), and runs mosquitto with TLS, client "
                                   "certificates and a per-identity ACL (docs/security.md).")
    p.add_argument("--port", type=ca.port, default=None,
                   help="MQTT port of the site broker (8883; 1883 with --insecure)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address mosquitto and the enrolment service listen on (127.0.0.1; 0.0.0.0 for a LAN)")
    p.add_argument("--data-dir", type=ca.writable_dir, required=True,
                   help="keys, PKI, trust.db, SQLite desired state, models")
    p.add_argument("--site", default=None, help=f"site name (first start: {DEFAULT_SITE}; then the stored one)")
    p.add_argument("--fog-id", default="", help="fog broker id (default fog-SITE)")
    p.add_argument("--mqtt", metavar="HOST:PORT", type=ca.hostport,
                   help="use this already running MQTT broker instead of starting mosquitto (configure it with "
                        "DATA_DIR/pki/broker/* and DATA_DIR/mqtt/acl; reload it when they change)")
    p.add_argument("--enroll-port", type=ca.port, default=None, metavar="P",
                   help="HTTPS enrolment service port (default: MQTT port + 1)")
    p.add_argument("--san", action="append", default=[], metavar="NAME|IP",
                   help="another name or address agents dial the broker by (repeatable; the host name, its "
                        "addresses, localhost and the fog id are always in the certificate)")
    p.add_argument("--coordinator-key", action="append", type=_coordinator_key, default=[], metavar="NAME=HEX",
                   help="pin a coordinator's release-signing key given out of band (repeatable)")
    p.add_argument("--insecure", action="store_true",
                   help="plain MQTT, no TLS and no ACL, loopback only, with a loud warning (tests and demos); "
                        "devices must still be added by key (fogline devices add)")
    p.add_argument("--max-message-mb", type=ca.float_range(0, 256, lo_open=True), default=24.0, metavar="MB",
                   help="the broker's message size limit (24 MiB: a deploy carrying an uploaded model)")
    p.add_argument("--state-interval", type=ca.float_range(0, 3600, lo_open=True), default=10.0, metavar="S",
                   help="devices' state interval assumed until their birth says (10 s)")
    p.add_argument("--startup-wait", type=ca.nonneg_float, default=None, metavar="S",
                   help="after a restart, wait at most this long for devices before re-placing "
                        "(default: one state interval)")
    p.add_argument("--summary-interval", type=ca.float_range(0, 3600, lo_open=True), default=3.0, metavar="S")
    p.add_argument("--verify-workers", type=ca.int_range(1, 64), default=2, metavar="N",
                   help="advert verification shards (2); each a worker process unless --verify-threads")
    p.add_argument("--verify-threads", action="store_true",
                   help="verify in threads of this process instead of worker processes")
    p.add_argument("--no-zeroconf", action="store_true", help="do not advertise with mDNS")
    p.add_argument("--primary-only", action="store_true",
                   help="route every request to the primary replica chain and admit it whatever its deadline "
                        "(the router before every replica served: fogline bench serving's baseline)")
    p.add_argument("--http", type=ca.port_or_zero, default=None, metavar="PORT",
                   help="also serve the Open Inference Protocol (KServe v2 REST; docs/http.md) on PORT of --host "
                        "(0: any free port): HTTPS with the site CA, callers authenticated by a client "
                        "certificate or an API token (fogline api-token); plain HTTP with --insecure, loopback "
                        "only. Needs aiohttp: pip install 'fogline[fog]'")
    p.set_defaults(func=_cmd_broker)

    s = sub.add_parser("status", help="describe a fog broker: devices, workloads, placements, reasons")
    _client_args(s)
    s.add_argument("--json", action="store_true")
    s.add_argument("--offset", type=ca.nonneg_int, default=0, help="first device to list (devices are paged)")
    s.add_argument("--limit", type=ca.nonneg_int, default=None, help="devices per page (1000)")
    s.add_argument("--coordinator", type=ca.existing_dir, default=None, metavar="CKPT",
                   help="every site of the coordinator whose checkpoint dir is CKPT (= fogline sites status)")
    s.set_defaults(func=_cmd_status)

    d = sub.add_parser("deploy", help="submit workloads (JSON, docs/formats.md) to a fog broker",
                       description="Submit one workload or {\"workloads\": [...]} (docs/formats.md; examples in "
                                   "examples/workloads/) to a fog broker. 'model' is zoo:NAME, release:NAME or an "
                                   "ONNX file (relative to the JSON file; uploaded). The file is checked here first.")
    d.add_argument("workload", metavar="WORKLOAD.json", type=ca.json_file)
    _client_args(d)
    d.add_argument("--wait", type=ca.nonneg_float, default=0.0, metavar="S", help="wait until running (seconds)")
    d.set_defaults(func=_cmd_deploy)

    u = sub.add_parser("undeploy", help="delete a workload from a fog broker")
    u.add_argument("name")
    _client_args(u)
    u.set_defaults(func=_cmd_undeploy)

    i = sub.add_parser("infer", help="run one inference through a deployed workload")
    i.add_argument("workload")
    i.add_argument("input", metavar="INPUT", type=ca.existing_file,
                   help="input tensors: .npy, .npz with named tensors, JSON as the Open Inference Protocol's "
                        "{\"inputs\": [{\"name\", \"shape\", \"datatype\", \"data\"}]}, or an image (PNG, "
                        "JPEG, ...; resized to the model's input and scaled to [0, 1]; needs Pillow)")
    _client_args(i)
    i.add_argument("--input-name", default=None, help="input tensor name (default: the model's first input, 'x')")
    i.add_argument("--timeout", type=ca.positive_float, default=None,
                   help="deadline in seconds (default: the workload's slo_s, else 5)")
    i.add_argument("--out", metavar="OUT.npz", type=ca.writable_file, help="write the outputs here")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_cmd_infer)

    t = sub.add_parser("api-token", help="mint a bearer token for the fog's HTTP inference API",
                       description="Print an API token signed with the signing key of a credentials directory "
                                   "(fogline operators add NAME --role app): send it as 'Authorization: Bearer "
                                   "TOKEN' to the fog's Open Inference Protocol endpoint (fogline broker --http). "
                                   "The fog keeps no record of it: revoking the identity revokes its tokens.")
    t.add_argument("--credentials", default=None, metavar="DIR", type=ca.existing_dir,
                   help="credentials directory (default $FOGLINE_CREDENTIALS, else ~/.fogline/credentials)")
    from .admin_cli import parse_duration
    t.add_argument("--ttl", type=parse_duration, default=3600.0, metavar="DURATION",
                   help="how long it is valid: 90s, 15m, 1h, 7d (1h; at most 30d)")
    t.add_argument("--json", action="store_true", help="print {token, name, expires_at, http}")
    t.set_defaults(func=_cmd_api_token)

    from .admin_cli import register_admin
    register_admin(sub)


def _client_args(p: argparse.ArgumentParser) -> None:
    from runtime import cliargs as ca

    p.add_argument("--broker", default=None, metavar="HOST:PORT", type=ca.host_or_hostport,
                   help="the site's MQTT broker (default: the address in the credentials' fog.json; "
                        "port 8883, 1883 with --insecure)")
    p.add_argument("--credentials", default=None, metavar="DIR", type=ca.existing_dir,
                   help="credentials issued by `fogline operators add` (default $FOGLINE_CREDENTIALS, else "
                        "~/.fogline/credentials; the first operator's are FOGDIR/credentials/admin)")
    p.add_argument("--insecure", action="store_true", help="plain MQTT to a loopback broker run with --insecure")


def _client(args: argparse.Namespace) -> Any:
    from runtime.mqtt import parse_hostport

    from .client import FogClient
    host, port = parse_hostport(args.broker, 1883 if args.insecure else 8883) if args.broker else (None, None)
    return FogClient(host, port, credentials=args.credentials, insecure=args.insecure)


# ------------------------------------------------------------------ broker


def _local_names(fog_id: str, host: str, extra: list[str]) -> tuple[list[str], list[str]]:
    """DNS names and IPs for the broker certificate: what agents on the LAN may dial."""
    import ipaddress
    import socket
    names = {"localhost", fog_id, socket.gethostname()}
    ips = {"127.0.0.1"}
    try:
        ips.update(str(i[4][0]) for i in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET))
    except OSError:
        pass
    for item in [host, *extra]:
        if item in ("", "0.0.0.0", "::"):
            continue
        try:
            ips.add(str(ipaddress.ip_address(item)))
        except ValueError:
            names.add(item)
    return sorted(names), sorted(ips)


def _start_mosquitto(args: argparse.Namespace, data_dir: Path, config: Any) -> Any:
    """Start this fog's mosquitto; it dies with the fog broker (kill -9 included).

    A mosquitto that an older run left behind on our port (``mqtt/owner.json``) is stopped first:
    it would hold the port, and it still has the old run's ACL and CRL loaded.
    """
    from runtime.broker import MosquittoBroker
    from runtime.files import atomic_write
    owner = data_dir / "mqtt" / "owner.json"
    if owner.exists():
        try:
            info = json.loads(owner.read_text())
            pid, port = int(info["pid"]), int(info["port"])
            if port == config.port and b"mosquitto" in Path(f"/proc/{pid}/cmdline").read_bytes():
                log.warning("stopping mosquitto pid %d that a previous run left on port %d", pid, port)
                os.kill(pid, signal.SIGTERM)
                for _ in range(100):
                    if not Path(f"/proc/{pid}").exists():
                        break
                    time.sleep(0.05)
        except (OSError, ValueError, KeyError):
            pass
    b = MosquittoBroker(config).start()
    assert b.proc is not None
    atomic_write(owner, json.dumps({"pid": b.proc.pid, "port": b.port}))
    return b


def _cmd_broker(args: argparse.Namespace) -> int:
    import socket
    import time as _time

    from runtime.broker import BrokerConfig, find_mosquitto, free_port
    from runtime.errors import LocalViolation
    from runtime.mqtt import parse_hostport
    from runtime.net import require_loopback

    from .enrolment import EnrolmentServer
    from .router import RouterConfig
    from .service import FogService, ServiceConfig
    from .site import Site

    os.umask(0o077)  # keys, trust.db(-wal), fog.db, uploaded models, logs: the fog's alone, whatever the caller's
    if args.http is not None:
        from runtime.net import is_loopback

        from .http_api import require_aiohttp
        try:
            require_aiohttp()
        except LocalViolation as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if not 0 <= args.http <= 65535:
            print(f"error: --http {args.http} is not a TCP port (0-65535)", file=sys.stderr)
            return 2
        if args.insecure and not is_loopback(args.host):
            print(f"error: --insecure --http is refused on {args.host}: plain HTTP only on a loopback address; "
                  "without --insecure the API is served over TLS with the site CA", file=sys.stderr)
            return 2
    if args.insecure:  # refused before anything is made in the data dir
        require_loopback(args.host if not args.mqtt else parse_hostport(args.mqtt)[0], "--insecure")
    data_dir = Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    stored = json.loads((data_dir / "site.json").read_text()) if (data_dir / "site.json").exists() else {}
    site_name = args.site or stored.get("site") or DEFAULT_SITE
    if stored and args.site and args.site != stored.get("site"):
        print(f"error: {data_dir} belongs to site {stored.get('site')!r}, not {args.site!r}", file=sys.stderr)
        return 2
    site = Site(data_dir, site=site_name, fog_id=args.fog_id or stored.get("fog_id") or None)
    now = _time.time()
    for pin in args.coordinator_key:
        name, _, hexkey = pin.partition("=")
        try:
            site.pin_coordinator(name, bytes.fromhex(hexkey), now)
        except ValueError:
            print("error: --coordinator-key needs NAME=HEX (64 hex characters)", file=sys.stderr)
            return 2
    port = args.port or (1883 if args.insecure else 8883)
    mosq = None
    tls = None
    adv = args.host if args.host not in ("0.0.0.0", "::") else socket.gethostname()
    names, ips = _local_names(site.fog_id, args.host, args.san)
    tls_dir = site.broker_tls_dir(names, ips)
    creds_dir = data_dir / "credentials" / "admin"
    if site.db.identity("admin") is None:
        site.issue_credentials("admin", "operator", creds_dir, now)
    if not args.insecure:
        tls = site.fog_credentials().tls(site.fog_id)
    if args.mqtt:
        host, port = parse_hostport(args.mqtt)
    else:
        host = args.host
        config = BrokerConfig(data_dir=data_dir / "mqtt", port=port, host=host,
                              tls_dir=None if args.insecure else tls_dir,
                              acl=None if args.insecure else site.acl(),
                              max_message_bytes=0 if args.insecure else int(args.max_message_mb * 1024 * 1024))
        if find_mosquitto() is None or os.environ.get("FOGLINE_BROKER") == "fallback":
            if not args.insecure:
                print("error: mosquitto is not installed and the embedded fallback broker cannot enforce TLS "
                      "and ACLs; install the Debian package 'mosquitto', or run with --insecure on loopback",
                      file=sys.stderr)
                return 2
            from runtime.broker import start_broker
            mosq = start_broker(data_dir / "mqtt", port, host=host)
        else:
            mosq = _start_mosquitto(args, data_dir, config)
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    enroll_port = args.enroll_port or (port + 1 if not args.insecure else free_port())
    site.write_info(mqtt=f"{adv}:{port}", enroll=f"{adv}:{enroll_port}")
    for d in [creds_dir]:
        (d / "fog.json").write_text(json.dumps(site.fog_json(), indent=1))
    from runtime.broker import MosquittoBroker
    if not args.insecure and isinstance(mosq, MosquittoBroker):
        mosq.session_closer = site.session_closer  # revoking an identity closes its live session
    on_acl = getattr(mosq, "update_acl", None) if not args.insecure else None
    on_crl = getattr(mosq, "update_crl", None) if not args.insecure else None
    if not args.insecure and mosq is None:
        def on_acl(text: str) -> None:
            from runtime.broker import check_acl
            from runtime.files import atomic_write
            check_acl(text)  # never hand a broker a line it may misread (acl_for never writes one)
            (data_dir / "mqtt").mkdir(exist_ok=True)
            atomic_write(data_dir / "mqtt" / "acl", text, mode=0o644, sync_dir=True)  # an external broker reads it
            log.warning("ACL changed: reload the external MQTT broker (%s)", data_dir / "mqtt" / "acl")
    cfg = ServiceConfig(data_dir=data_dir, site=site.site, fog_id=site.fog_id, mqtt_host=host, mqtt_port=port,
                        tls=tls, state_interval_s=args.state_interval, startup_wait_s=args.startup_wait,
                        summary_interval_s=args.summary_interval, verify_workers=max(1, args.verify_workers),
                        verify_processes=not args.verify_threads,
                        router=RouterConfig(spread=False, admit=False) if args.primary_only else RouterConfig())
    svc = FogService(cfg, site=site, on_acl=on_acl, on_crl=on_crl)
    stop = threading.Event()
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 PID: thread dump to stderr

    def _sig(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _sig)
    signal.signal(signal.SIGINT, _sig)
    ad = None
    enrol = None
    http = None
    try:
        try:
            svc.start()
            if args.http is not None:
                from . import metrics, site_page
                from .http_api import HttpApi
                http = HttpApi(svc, args.host, args.http, tls_dir=None if args.insecure else tls_dir)
                http.extend(metrics.register_http)    # GET /metrics (Prometheus)
                http.extend(site_page.register_http)  # GET /site, /site.json (the live site page)
                http = http.start()
                site.write_info(mqtt=f"{adv}:{port}", enroll=f"{adv}:{enroll_port}", http=f"{adv}:{http.port}")
                (creds_dir / "fog.json").write_text(json.dumps(site.fog_json(), indent=1))
        except LocalViolation as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        # A device approved at enrolment connects at once: give it its ACL entry before answering.
        def enrolled() -> None:
            svc.push_acl()
            svc.trust_changed()
        enrol = EnrolmentServer(site, args.host, enroll_port, tls_dir, on_change=enrolled).start()
        if not args.no_zeroconf:
            try:
                from runtime.discovery import advertise
                ad = advertise(cfg.site, cfg.fog_id, adv, port)
            except Exception as exc:  # noqa: BLE001 - discovery is a convenience, never fatal
                log.warning("zeroconf advertisement failed: %s", exc)
        print(json.dumps({"event": "ready", "fog_id": cfg.fog_id, "site": cfg.site, "mqtt": f"{host}:{port}",
                          "enroll": f"{adv}:{enrol.port}", "secure": not args.insecure, "epoch": svc.epoch,
                          "public_key": svc.identity.public_key_bytes.hex(), "ca_sha256": site.ca.fingerprint,
                          "credentials": str(creds_dir), "pid": os.getpid(),
                          "http": f"{adv}:{http.port}" if http is not None else None}), flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        if ad is not None:
            try:
                ad.close()
            except Exception:  # noqa: BLE001
                pass
        if enrol is not None:
            enrol.stop()
        if http is not None:
            http.stop()
        svc.stop()
        if mosq is not None:
            mosq.stop()
            (data_dir / "mqtt" / "owner.json").unlink(missing_ok=True)
    return 0


# ------------------------------------------------------------------ clients


def _fmt_bytes(n: Any) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _stage_lines(rep: dict[str, Any]) -> list[str]:
    """A chain's pipeline stages: predicted / measured time, bytes per frame on each link."""
    if not rep.get("stages"):
        return []
    out = [f"      stages (predicted / measured; bottleneck {rep.get('bottleneck')}"
           + (f", measured {rep['measured_bottleneck']}" if rep.get("measured_bottleneck") else "")
           + "):"]
    for s in rep["stages"]:
        meas = "-" if s["measured_s"] is None else f"{s['measured_s'] * 1000:.1f} ms"
        nbytes = f"  {_fmt_bytes(s['bytes_per_frame'])}/frame" if "bytes_per_frame" in s else ""
        out.append(f"        {s['stage']:<28} {s['predicted_s'] * 1000:9.1f} ms / {meas:>10}{nbytes}")
    return out


def render_status(st: dict[str, Any]) -> str:
    """``kubectl describe``-style text of a status document."""
    lines = [f"Fog broker:   {st['fog_id']} (site {st['site']}, epoch {st['epoch']}, "
             f"{'ready' if st['ready'] else 'waiting for devices'}, up {st['uptime_s']:.0f} s)"]
    m = st["metrics"]
    lines.append(f"Site metrics: utilization {m.get('utilization', 0):.1%}, fragmentation "
                 f"{m.get('fragmentation', 0):.1%}, devices live {m['devices_live']}, suspect "
                 f"{m['devices_suspect']}, dead {m['devices_dead']}")
    if st.get("quotas"):
        lines.append("Quotas:       " + ", ".join(f"{t}: {_fmt_bytes(b)}" for t, b in st["quotas"].items()))
    secure = st.get("secure", True)
    lines.append(f"Security:     {'TLS, client certificates, ACL' if secure else 'INSECURE (plain MQTT)'}")
    enrol = st.get("enrolment") or {}
    if enrol.get("pending"):
        lines.append(f"Enrolment:    pending approval: {', '.join(enrol['pending'])} "
                     "(fogline devices approve ID --data-dir FOGDIR)")
    for source, lim in sorted((st.get("limits") or {}).items()):  # senders over their budget (fair share)
        for who, q in (lim.get("quarantined") or {}).items():
            lines.append(f"Quarantined:  {who} ({source}): {q['reason']}; {q['dropped']} dropped, "
                         f"{q['remaining_s']:.0f} s left")
    lines.append("")
    total = st.get("devices_total", len(st["devices"]))
    shown = f"{len(st['devices'])} of {total}, from {st.get('devices_offset', 0)}" if total != len(st["devices"]) \
        else str(total)
    lines.append(f"Devices ({shown}):")
    lines.append(f"  {'ID':<20} {'STATUS':<8} {'FREE':>10} {'MEMORY':>10} {'BATTERY':>8}  PARTITIONS")
    for d in st["devices"]:
        batt = "-" if d["battery_level"] is None else f"{d['battery_level']:.0%}" + ("+" if d["charging"] else "")
        notes = [f"clock {d['clock_skew_s']:+.0f} s"] if d.get("clock_skew_s") and abs(d["clock_skew_s"]) > 10 else []
        notes += d.get("flags") or []
        if d.get("rejected"):  # its last advert failed validation: it holds nothing until a clean birth
            notes.append(f"rejected: {d['rejected']}")
        if d.get("set_aside"):
            notes.append(f"set aside: {d['set_aside']}")
        if d.get("slow"):
            notes.append(f"slow: {d['slow']}")
        lines.append(f"  {d['id']:<20} {d['status']:<8} {_fmt_bytes(d['free_memory_bytes']):>10} "
                     f"{_fmt_bytes(d['memory_bytes']):>10} {batt:>8}  {', '.join(d['partitions']) or '-'}"
                     + (f"  [{'; '.join(notes)}]" if notes else ""))
    lines.append("")
    lines.append(f"Workloads ({len(st['workloads'])}):")
    for w in st["workloads"]:
        lines.append(f"  {w['name']}  v{w['version']}  {w['status'].upper()}  tenant={w['tenant']} "
                     f"priority={w['priority']} replicas={w['healthy_replicas']}/{w['replicas']} "
                     f"model={w['model']}")
        sc, sv = w.get("scaling") or {}, w.get("serving") or {}
        if w.get("autoscale") or sc.get("rate_fps"):
            lines.append(f"    scaling: {sc['replicas_running']} running / {sc['replicas_wanted']} wanted, "
                         f"offered {sv.get('offered_rps', 0.0):.1f}/s, goodput {sv.get('goodput_rps', 0.0):.1f}/s, "
                         f"shed {sv.get('shed_rps', 0.0):.1f}/s"
                         + (f"  [{sc['rate_reason']}]" if sc.get("rate_reason") else "")
                         + (f"  [{sc['pending_reason']}]" if sc.get("pending_reason") else ""))
            for ev in sc.get("events", [])[-2:]:
                lines.append(f"      scaled {ev['from']} -> {ev['to']} {ev['age_s']:.0f} s ago: {ev['reason']}")
        for rep in w["placement"]:
            cost = "" if rep["latency_s"] is None else \
                f"  (predicted {rep['latency_s'] * 1000:.2f} ms, {rep['energy_j']:.4f} J)"
            lines.append(f"    replica {rep['replica']}:{cost}")
            for p in rep["partitions"]:
                extra = f"  [{p['reason']}]" if p["reason"] else ""
                lines.append(f"      p{p['index']} segments {p['segments'][0]}-{p['segments'][1]} on "
                             f"{p['device']:<16} {p['phase']}{extra}")
            lines.extend(_stage_lines(rep))
        sw = w.get("switch")
        if sw:
            counts: dict[str, int] = {}
            for p in sw["old_partitions"]:
                counts[p["state"]] = counts.get(p["state"], 0) + 1
            lines.append(f"    switching v{sw['from_version']} -> v{sw['to_version']} "
                         f"({sw['mode']}, make-before-break): "
                         f"serving v{', v'.join(str(v) for v in sw['serving_versions']) or ' none'}; old partitions "
                         + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
                         + (f"; {sw['reason']}" if sw.get("reason") else ""))
        lat = w.get("latency") or {}
        if lat.get("predicted_s") is not None and lat.get("measured_p50_s"):
            lines.append(f"    latency: predicted {lat['predicted_s'] * 1000:.2f} ms, measured p50 "
                         f"{lat['measured_p50_s'] * 1000:.2f} ms (error {lat['error']:+.0%})")
        thr = w.get("throughput") or {}
        if thr.get("predicted_fps") is not None and any(r.get("stages") for r in w["placement"]):
            meas = thr.get("measured_fps")
            lines.append(f"    frames/s: predicted {thr['predicted_fps']:.2f}, measured "
                         + ("-" if meas is None else f"{meas:.2f}"))
        if w["reasons"]:
            lines.append("    Pending because:")
            for k, v in w["reasons"].items():
                lines.append(f"      {k}: {v}")
        if w.get("evicted"):
            lines.append("    Evicted by preemption at least once")
    releases = st.get("releases") or {}
    lines.append("")
    lines.append(f"Releases ({len(releases)}):")
    for name, r in sorted(releases.items()):
        lines.append(f"  {name}  v{r.get('version')}  model={r.get('model')}  signer={r.get('signer')}")
    return "\n".join(lines)


#: Entry points that add views to ``fogline status``: ``coordinator`` answers ``--coordinator CKPT``.
STATUS_GROUP = "fogline.status"


def _cmd_status(args: argparse.Namespace) -> int:
    if args.coordinator is not None:  # the coordinator's view of every site, not one fog's
        # ``fogline status --coordinator CKPT``: the coordinator's handler, by entry point (``fogline.status``
        # in pyproject.toml) when the coordinator is installed: the fog does not import it
        eps = importlib.metadata.entry_points(group=STATUS_GROUP, name="coordinator")
        coordinator_status: Callable[[argparse.Namespace], int] | None = next(iter(eps)).load() if eps else None
        if coordinator_status is None:
            print("error: --coordinator needs the cloud coordinator's commands (not installed)",
                  file=sys.stderr)
            return 2
        return coordinator_status(argparse.Namespace(checkpoint_dir=args.coordinator, names=[],
                                                     json=args.json))
    with _client(args) as c:
        st = c.status(offset=args.offset, limit=args.limit)
    if args.json:
        print(json.dumps(st, indent=1))
    else:
        print(render_status(st))
    return 0


def read_deploy(src: Any) -> dict[str, Any]:
    """The deploy body of a workload file (a ``cliargs.JsonFile``), checked before any connection.

    One workload or ``{"workloads": [...], "quotas": {...}}``: read by the placement parser the
    fog broker runs (``parse_workloads``), each with a ``model`` the fog can build (``zoo:NAME``,
    ``release:NAME`` or an ONNX file, uploaded); bad input raises ``SpecError`` naming the file.
    """
    from .client import prepare_deploy
    from .placement import SpecError, parse_workloads

    doc = src.doc if "workloads" in src.doc else {"workloads": [src.doc]}
    try:
        workloads, _ = parse_workloads(doc)
        if not workloads:
            raise SpecError("no workloads")
        for w in workloads:
            if w.model is None:
                raise SpecError(f"workload {w.name}: the fog broker needs 'model' (zoo:NAME, release:NAME or an "
                                "ONNX file); an inline 'profile' is for fogline place only")
            if w.model.startswith("zoo:"):
                from models import zoo

                if w.model[4:] not in zoo.NAMES:
                    raise SpecError(f"workload {w.name}: unknown zoo model {w.model[4:]!r}; choose from "
                                    f"{', '.join(zoo.NAMES)}")
    except SpecError as exc:
        raise SpecError(f"{src.path}: {exc}") from None
    return prepare_deploy(doc, src.path.parent)


def _cmd_deploy(args: argparse.Namespace) -> int:
    from .client import ControlError
    body = read_deploy(args.workload)
    with _client(args) as c:
        try:
            res = c.control("deploy", body, timeout=120.0)
        except ControlError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        for d in res["deployed"]:
            print(f"workload {d['name']} version {d['version']} accepted ({d['segments']} segments)")
        if args.wait > 0:
            for d in res["deployed"]:
                try:
                    c.wait_running(d["name"], timeout=args.wait)
                    print(f"workload {d['name']} running")
                except TimeoutError as exc:
                    print(f"error: {exc}", file=sys.stderr)
                    return 1
    return 0


def _cmd_undeploy(args: argparse.Namespace) -> int:
    from .client import ControlError
    with _client(args) as c:
        try:
            c.delete(args.name)
        except ControlError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(f"workload {args.name} deleted")
    return 0


def _cmd_infer(args: argparse.Namespace) -> int:
    import numpy as np

    from .client import InferenceError
    from .infer_inputs import InputError, is_image, load_inputs
    try:
        spec = _model_inputs(args) if is_image(args.input, _magic(args.input)) else None
        tensors = load_inputs(args.input, input_name=args.input_name, inputs=spec)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    with _client(args) as c:
        try:
            out = c.infer(args.workload, tensors, timeout=args.timeout)
        except (InferenceError, TimeoutError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    dt = time.monotonic() - t0
    if args.out:
        np.savez(args.out, **out)
    if args.json:
        print(json.dumps({"latency_s": dt, "outputs": {k: v.tolist() for k, v in out.items()}}))
    else:
        for k, v in out.items():
            flat = v.ravel()
            head = ", ".join(f"{x:.4g}" for x in flat[:8])
            print(f"{k}: shape {list(v.shape)} dtype {v.dtype} [{head}{', ...' if flat.size > 8 else ''}]")
            if v.ndim >= 1 and v.size > 1 and v.dtype.kind == "f":
                print(f"  argmax: {int(np.argmax(v.reshape(v.shape[0], -1)[0]))}")
        print(f"latency: {dt * 1000:.1f} ms")
    return 0


def _magic(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(16)
    except OSError:
        return b""  # load_inputs says why, in one line


def _model_inputs(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """The workload's input description, for an image: from the fog's HTTP API (``GET
    /v2/models/NAME``) when fog.json names one, else from a zoo model's graph (via status)."""
    from runtime.credentials import load_credentials

    from .infer_inputs import InputError, zoo_inputs
    creds = load_credentials(args.credentials)
    if creds.fog.http:
        import ssl
        import urllib.error
        import urllib.request
        ctx = None
        headers = {}
        if args.insecure:
            headers["Authorization"] = f"Bearer {_mint(creds, 300.0)}"
            url = f"http://{creds.fog.http}/v2/models/{args.workload}"
        else:
            ctx = ssl.create_default_context(cafile=str(creds.dir / "ca.pem"))
            ctx.load_cert_chain(str(creds.dir / "cert.pem"), str(creds.dir / "key.pem"))
            url = f"https://{creds.fog.http}/v2/models/{args.workload}"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10,
                                        context=ctx) as r:
                return list(json.loads(r.read())["inputs"])
        except urllib.error.HTTPError as exc:
            try:
                why = json.loads(exc.read()).get("error", exc.reason)
            except ValueError:
                why = exc.reason
            raise InputError(f"model metadata of {args.workload!r} from {url}: {exc.code} {why}") from None
        except (OSError, ValueError, KeyError) as exc:
            log.info("model metadata from %s failed (%s); trying the status", url, exc)
    try:
        with _client(args) as c:
            st = c.status(limit=0)
    except Exception as exc:  # noqa: BLE001 - e.g. an app identity may not read the status
        raise InputError(f"cannot learn the input shape of {args.workload!r} for an image ({exc}); run the fog "
                         "broker with --http, or give a .npy/.npz/JSON tensor") from None
    w = next((w for w in st["workloads"] if w["name"] == args.workload), None)
    if w is None:
        raise InputError(f"no workload named {args.workload!r} on fog {st['fog_id']}")
    rows = zoo_inputs(str(w.get("model") or ""))
    if rows is None:
        raise InputError(f"cannot learn the input shape of {args.workload!r} (model {w.get('model')}) for an "
                         "image; run the fog broker with --http, or give a .npy/.npz/JSON tensor")
    return rows


def _mint(creds: Any, ttl_s: float) -> str:
    import secrets

    from .api_auth import mint_token
    return mint_token(creds.signing, creds.fog.site, creds.fog.fog_id, time.time(), ttl_s, secrets.token_bytes(8))


def _cmd_api_token(args: argparse.Namespace) -> int:
    from runtime.credentials import load_credentials

    from .api_auth import MAX_TTL_S
    if args.ttl > MAX_TTL_S:
        print(f"error: --ttl is at most {MAX_TTL_S // 86400}d (a leaked token must expire)", file=sys.stderr)
        return 2
    creds = load_credentials(args.credentials)
    token = _mint(creds, args.ttl)
    if args.json:
        print(json.dumps({"token": token, "name": creds.name, "role": creds.role, "fog_id": creds.fog.fog_id,
                          "expires_at": int(time.time()) + int(args.ttl), "http": creds.fog.http or None}))
    else:
        print(token)
    return 0
