"""``fogline agent``: run one edge agent, a fleet of simulated ones, or print the device key.

Heavy imports (paho, cryptography, numpy) happen inside the handlers so that
``fogline --help`` stays fast; ``python -m edge_agent`` skips the other
packages' commands and starts an agent fastest (the fog broker and the demo
spawn agents that way).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["register", "main", "handler"]

log = logging.getLogger("edge_agent")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "agent", help="run an edge agent (or: fogline agent key --data-dir DIR)",
        description="Run the Fogline edge agent on this device, simulate devices, or print the device key.")
    p.add_argument("action", nargs="?", choices=("run", "key"), default="run",
                   help="run (default) or key: print the public key and fingerprint for enrolment")
    p.add_argument("--broker", metavar="HOST:PORT", help="fog MQTT broker; default: find it with zeroconf")
    p.add_argument("--id", dest="device_id", help="device id (default: the host name)")
    p.add_argument("--data-dir", type=Path, help="key, epoch, pinned fog key, artifact cache "
                   "(default: ~/.local/share/fogline/agent-ID)")
    p.add_argument("--site", help="site name (default: the discovered fog's, else 'default')")
    p.add_argument("--labels", default="", help="k=v,... (override probed labels such as arch)")
    p.add_argument("--taints", default="", help="k=v:NoSchedule,...")
    p.add_argument("--state-interval", type=float, default=10.0, metavar="S", help="state advert period (10 s)")
    p.add_argument("--probe-interval", type=float, default=1.0, metavar="S",
                   help="how often probes run to catch significant changes (1 s)")
    p.add_argument("--keepalive", type=int, default=5, metavar="S", help="MQTT keepalive (5 s)")
    p.add_argument("--fog-key", metavar="HEX", help="pin the fog broker's Ed25519 public key "
                   "(default: trust on first use from its STATE, then pinned)")
    p.add_argument("--simulate", metavar="PROFILE", help="simulate a device: " + ", ".join(_profile_names()))
    p.add_argument("--count", type=int, default=1, help="simulated agents in this process (needs --simulate)")
    p.add_argument("--id-prefix", default="sim-", help="id prefix with --count (ids PREFIX0, PREFIX1, ...)")
    p.add_argument("--sim-speedup", type=float, default=1.0, help="simulated battery drain speed-up")
    p.add_argument("--sim-slowdown", type=float, default=1.0,
                   help="simulated compute: stretch measured partition run times by this factor")
    p.add_argument("--sim-compute", action="store_true",
                   help="simulated compute: runs take at least partition FLOPs / profile FLOP/s")
    p.add_argument("--threads", type=int, default=None,
                   help="onnxruntime intra-op threads per session (default: all cores; 1 when simulating)")
    p.add_argument("--workers", type=int, default=1, help="executor worker threads")
    p.add_argument("--queue-size", type=int, default=64, help="bounded activation queue; full -> error reply")
    p.add_argument("--cache-mb", type=int, default=256, help="artifact cache size (MiB, LRU)")
    p.add_argument("--max-command-bytes", type=int, default=16 * 1024 * 1024,
                   help="larger command envelopes are rejected as oversized")
    p.add_argument("--flops", type=float, help="advertised FLOP/s (default: profile or estimate)")
    p.add_argument("--discovery-timeout", type=float, default=5.0, metavar="S")
    p.add_argument("--json", action="store_true", help="key: print JSON")
    p.set_defaults(func=handler)


def _profile_names() -> list[str]:
    return ["pi4", "pi5", "orin-nano", "jetson-nano", "x86-gateway", "camera", "laptop"]


def handler(args: argparse.Namespace) -> int:
    if args.action == "key":
        return _key(args)
    return _run(args)


def _default_dir(device_id: str) -> Path:
    return Path.home() / ".local" / "share" / "fogline" / f"agent-{device_id}"


def _key(args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415

    from runtime.security import Identity  # noqa: PLC0415

    from .agent import KEY_FILE  # noqa: PLC0415

    data_dir = args.data_dir or _default_dir(args.device_id or _hostname())
    ident = Identity.load_or_create(args.device_id or "agent", Path(data_dir) / KEY_FILE)
    if args.json:
        print(json.dumps({"public_key": ident.public_key_bytes.hex(), "fingerprint": ident.fingerprint,
                          "key_file": str(Path(data_dir) / KEY_FILE)}))
    else:
        print(f"public key:  {ident.public_key_bytes.hex()}")
        print(f"fingerprint: {ident.fingerprint}")
    return 0


def _hostname() -> str:
    import socket  # noqa: PLC0415

    name = socket.gethostname().split(".")[0] or "device"
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name)


def _discover(site: str | None, timeout: float) -> tuple[str, int, str] | None:
    """(host, port, site) of a fog broker found with zeroconf, or None."""
    try:
        from runtime.discovery import browse  # noqa: PLC0415 - zeroconf only when needed
    except ImportError as exc:
        log.error("zeroconf discovery unavailable (%s); pass --broker HOST:PORT", exc)
        return None
    found = browse(timeout, site)
    if site is not None:
        found = [s for s in found if s.site == site]
    if not found:
        return None
    svc = found[0]
    return svc.host, svc.port, svc.site


def _run(args: argparse.Namespace) -> int:
    from runtime.mqtt import parse_hostport  # noqa: PLC0415

    from .commands import parse_labels, parse_taints  # noqa: PLC0415

    try:
        labels = parse_labels(args.labels)
        taints = parse_taints(args.taints)
        fog_key = bytes.fromhex(args.fog_key) if args.fog_key else None
        if fog_key is not None and len(fog_key) != 32:
            raise ValueError("--fog-key must be 64 hex characters (an Ed25519 public key)")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.count > 1 and not args.simulate:
        print("error: --count needs --simulate PROFILE", file=sys.stderr)
        return 2
    profile = None
    if args.simulate:
        from simulations.profiles import PROFILES  # noqa: PLC0415

        profile = PROFILES.get(args.simulate)
        if profile is None:
            print(f"error: unknown profile {args.simulate!r}; known: {', '.join(sorted(PROFILES))}",
                  file=sys.stderr)
            return 2
    site = args.site
    if args.broker:
        try:
            host, port = parse_hostport(args.broker)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    else:
        found = _discover(site, args.discovery_timeout)
        if found is None:
            print("error: no fog broker found with zeroconf; pass --broker HOST:PORT", file=sys.stderr)
            return 2
        host, port, found_site = found
        site = site or found_site
    site = site or "default"

    from .agent import AgentConfig  # noqa: PLC0415

    if args.count > 1:
        width = len(str(args.count - 1))
        ids = [f"{args.id_prefix}{i:0{width}d}" for i in range(args.count)]
        base = args.data_dir or Path.home() / ".local" / "share" / "fogline" / "fleet"
        dirs = [Path(base) / i for i in ids]
    else:
        ids = [args.device_id or (f"{args.id_prefix}0" if args.simulate and not args.device_id else _hostname())]
        dirs = [args.data_dir or _default_dir(ids[0])]
    bad = [i for i in ids if not i or len(i) > 128 or any(c in i for c in "/+#\x00")]
    if bad:
        print(f"error: invalid device id {bad[0]!r}: 1-128 characters, no '/', '+', '#'", file=sys.stderr)
        return 2
    threads = args.threads if args.threads is not None else (1 if profile is not None else 0)
    cfgs = [AgentConfig(device_id=i, data_dir=d, host=host, port=port, site=site, labels=dict(labels),
                        taints=taints, state_interval_s=args.state_interval, probe_interval_s=args.probe_interval,
                        keepalive=args.keepalive, fog_key=fog_key, intra_op_threads=threads,
                        workers=args.workers, queue_size=args.queue_size, cache_bytes=args.cache_mb * 1024 * 1024,
                        max_command_bytes=args.max_command_bytes, slowdown=args.sim_slowdown,
                        model_compute=bool(args.sim_compute and profile is not None))
            for i, d in zip(ids, dirs)]
    from .runner import run_agents  # noqa: PLC0415

    return run_agents(cfgs, profile=profile, speedup=args.sim_speedup, flops=args.flops)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m edge_agent [ARGS]``: the same as ``fogline agent [ARGS]``, without the other commands."""
    parser = argparse.ArgumentParser(prog="python -m edge_agent")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    sub = parser.add_subparsers(dest="command")
    register(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    lead = [a for a in argv if a in ("-v", "-vv", "--verbose")]
    rest = [a for a in argv if a not in lead]
    args = parser.parse_args(lead + ["agent"] + rest)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
