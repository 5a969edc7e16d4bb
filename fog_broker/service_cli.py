"""``fogline broker | status | deploy | infer | undeploy``: the live fog broker and its clients.

Registered from ``fog_broker.cli.register`` by one call to ``register_service``.
Heavy imports happen inside the handlers.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["register_service"]

log = logging.getLogger("fog_broker")

DEFAULT_SITE = "default"


def register_service(sub: Any) -> None:
    p = sub.add_parser("broker", help="run a fog broker (owns the site's MQTT broker)",
                       description="Run the live fog broker: fleet registry, deployment controller, "
                                   "inference router; starts mosquitto unless --mqtt is given.")
    p.add_argument("--port", type=int, default=1883, help="MQTT port of the site broker it starts (1883)")
    p.add_argument("--host", default="127.0.0.1", help="address mosquitto listens on (127.0.0.1)")
    p.add_argument("--data-dir", type=Path, required=True, help="keys, SQLite desired state, models")
    p.add_argument("--site", default=DEFAULT_SITE, help=f"site name ({DEFAULT_SITE})")
    p.add_argument("--fog-id", default="", help="fog broker id (default fog-SITE)")
    p.add_argument("--mqtt", metavar="HOST:PORT", help="use this MQTT broker instead of starting mosquitto")
    p.add_argument("--state-interval", type=float, default=10.0, metavar="S",
                   help="devices' state interval assumed until their birth says (10 s)")
    p.add_argument("--startup-wait", type=float, default=None, metavar="S",
                   help="after a restart, wait at most this long for devices before re-placing "
                        "(default: one state interval)")
    p.add_argument("--summary-interval", type=float, default=3.0, metavar="S")
    p.add_argument("--strict-enrollment", action="store_true", help="refuse devices not in devices.json")
    p.add_argument("--strict-operators", action="store_true", help="refuse operators not in operators.json")
    p.add_argument("--verify-workers", type=int, default=2, metavar="N",
                   help="advert verification shards (2); each a worker process unless --verify-threads")
    p.add_argument("--verify-threads", action="store_true",
                   help="verify in threads of this process instead of worker processes")
    p.add_argument("--no-zeroconf", action="store_true", help="do not advertise with mDNS")
    p.set_defaults(func=_cmd_broker)

    s = sub.add_parser("status", help="describe a fog broker: devices, workloads, placements, reasons")
    _client_args(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_cmd_status)

    d = sub.add_parser("deploy", help="submit workloads (JSON as in COST_MODEL.md) to a fog broker")
    d.add_argument("workload", metavar="WORKLOAD.json")
    _client_args(d)
    d.add_argument("--wait", type=float, default=0.0, metavar="S", help="wait until running (seconds)")
    d.set_defaults(func=_cmd_deploy)

    u = sub.add_parser("undeploy", help="delete a workload from a fog broker")
    u.add_argument("name")
    _client_args(u)
    u.set_defaults(func=_cmd_undeploy)

    i = sub.add_parser("infer", help="run one inference through a deployed workload")
    i.add_argument("workload")
    i.add_argument("input", metavar="INPUT.npy", help="input tensor (.npy) or .npz with named tensors")
    _client_args(i)
    i.add_argument("--input-name", default=None, help="input tensor name (default: the model's first input, 'x')")
    i.add_argument("--timeout", type=float, default=5.0)
    i.add_argument("--out", metavar="OUT.npz", help="write the outputs here")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_cmd_infer)


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", required=True, metavar="HOST:PORT", help="the site's MQTT broker")
    p.add_argument("--site", default=None, help="site (default: the online fog broker's)")
    p.add_argument("--key", default=None, help="operator key file (default $FOGLINE_OPERATOR_KEY or "
                                               "~/.fogline/operator.key)")


def _client(args: argparse.Namespace) -> Any:
    from runtime.mqtt import parse_hostport

    from .client import FogClient
    host, port = parse_hostport(args.broker)
    return FogClient(host, port, site=args.site, key=args.key)


# ------------------------------------------------------------------ broker


def _adopt_or_start_mosquitto(args: argparse.Namespace, data_dir: Path) -> tuple[Any, str, int]:
    """Start mosquitto (or, where it is not installed, the embedded fallback, with a loud warning);
    after a crash of this process, re-attach to the broker it left running."""
    from runtime.broker import start_broker, wait_port
    mdir = data_dir / "mqtt"
    owner = mdir / "owner.json"
    if owner.exists():
        try:
            info = json.loads(owner.read_text())
            pid, port = int(info["pid"]), int(info["port"])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            ours = b"mosquitto" in cmdline or b"runtime.fallback_broker" in cmdline
            if ours and port == args.port and wait_port(args.host, port, 0.5):
                log.warning("re-attached to mosquitto pid %d left running on port %d", pid, port)
                return _Adopted(pid), args.host, port
        except (OSError, ValueError, KeyError):
            pass
    b = start_broker(mdir, args.port, host=args.host)
    assert b.proc is not None
    owner.write_text(json.dumps({"pid": b.proc.pid, "port": b.port}))
    return b, b.host, b.port


class _Adopted:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGTERM)
        except OSError:
            pass


def _cmd_broker(args: argparse.Namespace) -> int:
    from runtime.mqtt import parse_hostport

    from .service import FogService, ServiceConfig
    data_dir = Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    mosq = None
    if args.mqtt:
        host, port = parse_hostport(args.mqtt)
    else:
        mosq, host, port = _adopt_or_start_mosquitto(args, data_dir)
    cfg = ServiceConfig(data_dir=data_dir, site=args.site, fog_id=args.fog_id, mqtt_host=host, mqtt_port=port,
                        state_interval_s=args.state_interval, startup_wait_s=args.startup_wait,
                        summary_interval_s=args.summary_interval, strict_enrollment=args.strict_enrollment,
                        strict_operators=args.strict_operators, verify_workers=max(1, args.verify_workers),
                        verify_processes=not args.verify_threads)
    svc = FogService(cfg)
    stop = threading.Event()
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 PID: thread dump to stderr

    def _sig(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _sig)
    signal.signal(signal.SIGINT, _sig)
    ad = None
    try:
        svc.start()
        if not args.no_zeroconf:
            try:
                from runtime.discovery import advertise
                ad = advertise(cfg.site, cfg.fog_id, host, port)
            except Exception as exc:  # noqa: BLE001 - discovery is a convenience, never fatal
                log.warning("zeroconf advertisement failed: %s", exc)
        print(json.dumps({"event": "ready", "fog_id": cfg.fog_id, "site": cfg.site, "mqtt": f"{host}:{port}",
                          "epoch": svc.epoch, "public_key": svc.identity.public_key_bytes.hex(),
                          "pid": os.getpid()}), flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        if ad is not None:
            try:
                ad.close()
            except Exception:  # noqa: BLE001
                pass
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
    lines.append("")
    lines.append(f"Devices ({len(st['devices'])}):")
    lines.append(f"  {'ID':<20} {'STATUS':<8} {'FREE':>10} {'MEMORY':>10} {'BATTERY':>8}  PARTITIONS")
    for d in st["devices"]:
        batt = "-" if d["battery_level"] is None else f"{d['battery_level']:.0%}" + ("+" if d["charging"] else "")
        lines.append(f"  {d['id']:<20} {d['status']:<8} {_fmt_bytes(d['free_memory_bytes']):>10} "
                     f"{_fmt_bytes(d['memory_bytes']):>10} {batt:>8}  {', '.join(d['partitions']) or '-'}")
    lines.append("")
    lines.append(f"Workloads ({len(st['workloads'])}):")
    for w in st["workloads"]:
        lines.append(f"  {w['name']}  v{w['version']}  {w['status'].upper()}  tenant={w['tenant']} "
                     f"priority={w['priority']} replicas={w['healthy_replicas']}/{w['replicas']} "
                     f"model={w['model']}")
        for rep in w["placement"]:
            cost = "" if rep["latency_s"] is None else \
                f"  (predicted {rep['latency_s'] * 1000:.2f} ms, {rep['energy_j']:.4f} J)"
            lines.append(f"    replica {rep['replica']}:{cost}")
            for p in rep["partitions"]:
                extra = f"  [{p['reason']}]" if p["reason"] else ""
                lines.append(f"      p{p['index']} segments {p['segments'][0]}-{p['segments'][1]} on "
                             f"{p['device']:<16} {p['phase']}{extra}")
        if w["reasons"]:
            lines.append("    Pending because:")
            for k, v in w["reasons"].items():
                lines.append(f"      {k}: {v}")
        if w.get("evicted"):
            lines.append("    Evicted by preemption at least once")
    return "\n".join(lines)


def _cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as c:
        st = c.status()
    if args.json:
        print(json.dumps(st, indent=1))
    else:
        print(render_status(st))
    return 0


def _cmd_deploy(args: argparse.Namespace) -> int:
    from .client import ControlError, load_workloads_file
    body = load_workloads_file(args.workload)
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
    data = np.load(args.input)
    if isinstance(data, np.ndarray):
        tensors = {args.input_name or "x": data}
    else:
        tensors = {k: data[k] for k in data.files}
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
