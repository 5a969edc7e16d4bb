"""``fogline agent``: run one edge agent, a fleet of simulated ones, or print the device key.

Before it runs, an agent needs the fog's key and TLS credentials: the first
start with ``--token`` enrols the data dir (``edge_agent.enrol``); later
starts read them from it. ``--insecure --fog-key HEX`` skips TLS for a
loopback test broker only. Every refusal is one line and exit code 2.

Heavy imports (paho, cryptography, numpy) happen inside the handlers so that
``fogline --help`` stays fast; ``python -m edge_agent`` skips the other
packages' commands and starts an agent fastest (the fog broker and the demo
spawn agents that way).
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["register", "main", "handler", "TOKEN_ENV"]

log = logging.getLogger("edge_agent")

TOKEN_ENV = "FOGLINE_TOKEN"


def register(subparsers: Any) -> None:
    from runtime import cliargs as ca

    p = subparsers.add_parser(
        "agent", help="run an edge agent (or: fogline agent key --data-dir DIR)",
        description="Run the Fogline edge agent on this device, simulate devices, or print the device key.")
    p.add_argument("action", nargs="?", choices=("run", "key"), default="run",
                   help="run (default) or key: print the public key and fingerprint for enrolment")
    p.add_argument("--broker", metavar="HOST:PORT", type=ca.host_or_hostport,
                   help="fog MQTT broker (port 8883; 1883 with --insecure); default: find it with zeroconf")
    p.add_argument("--id", dest="device_id", help="device id (default: the host name)")
    p.add_argument("--data-dir", type=ca.writable_dir, help="key, epoch, pinned fog key, artifact cache "
                   "(default: ~/.local/share/fogline/agent-ID)")
    p.add_argument("--site", help="site name (default: the discovered fog's, else 'default')")
    p.add_argument("--labels", default="", help="k=v,... (override probed labels such as arch)")
    p.add_argument("--taints", default="", help="k=v:NoSchedule,...")
    p.add_argument("--state-interval", type=float, default=10.0, metavar="S", help="state advert period (10 s)")
    p.add_argument("--probe-interval", type=float, default=1.0, metavar="S",
                   help="how often probes run to catch significant changes (1 s)")
    p.add_argument("--keepalive", type=int, default=5, metavar="S", help="MQTT keepalive (5 s)")
    p.add_argument("--fog-key", metavar="HEX", help="the fog broker's Ed25519 public key, from its operator "
                   "(default: the one enrolment stored in DIR/fog.json; never learned from the network)")
    p.add_argument("--token-file", type=Path, metavar="FILE",
                   help="file holding the bootstrap token (fgl1.…) to enrol DIR on first start (or set "
                        f"{TOKEN_ENV}); on the fog: fogline token create --data-dir FOGDIR [--uses N]")
    p.add_argument("--token", metavar="TOKEN", help="the bootstrap token itself: discouraged, a command line is "
                   f"visible to every user in ps (use --token-file or {TOKEN_ENV}); the agent moves it out of "
                   "its command line at once")
    p.add_argument("--enroll", metavar="HOST:PORT", type=ca.hostport,
                   help="the fog's enrolment service (default: the broker host, broker port + 1)")
    p.add_argument("--enroll-timeout", type=float, default=600.0, metavar="S",
                   help="how long to wait for an operator's approval (600 s)")
    p.add_argument("--insecure", action="store_true",
                   help="plain MQTT without TLS (needs --fog-key; loopback brokers only: tests and demos)")
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
    p.add_argument("--max-batch", type=int, default=1, metavar="N",
                   help="dynamic batching: run up to N queued frames of a partition with a batch axis as one "
                        "batch (default 1: off; on these CPUs it gains ~nothing, see README)")
    p.add_argument("--max-batch-wait-ms", type=float, default=2.0, metavar="MS",
                   help="dynamic batching: wait at most this long for more frames (never past a deadline)")
    p.add_argument("--sim-batch-slope", type=float, default=1.0, metavar="S",
                   help="simulated compute: a batch of n costs one frame's time x (1 + S (n - 1)); 1: no gain")
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
    try:
        args.token = _token(args)
    except _Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return _run(args)


def _token(args: argparse.Namespace) -> str | None:
    """The bootstrap token from --token-file, $FOGLINE_TOKEN or (warned) --token.

    A token on the command line stays readable in ``ps`` by every user of the host for the agent's
    life: it is moved to the environment (readable by this user only) by re-executing the same
    command without it, so it is visible only for the moment the process takes to start.
    """
    import os

    given = [n for n, v in (("--token", args.token), ("--token-file", args.token_file)) if v]
    if len(given) > 1:
        raise _Refused("--token and --token-file exclude each other")
    if args.token_file is not None:
        try:
            return Path(args.token_file).read_text(encoding="utf-8", errors="replace").strip()[:512] or None
        except OSError as exc:
            raise _Refused(f"cannot read --token-file {args.token_file}: {exc.strerror or exc}") from None
    if args.token:
        log.warning("--token puts the bootstrap token in the command line, which every user of this host can "
                    "read (ps); use --token-file FILE or %s", TOKEN_ENV)
        _reexec_without_token(args.token)
        return str(args.token)
    return os.environ.pop(TOKEN_ENV, "").strip() or None  # popped: the agent's children never see it


def _reexec_without_token(token: str) -> None:
    """Start this same command again with the token in the environment instead of the argv (only
    when the process was started with it in its argv: not when ``main`` is called in-process)."""
    import os

    argv = list(getattr(sys, "orig_argv", []))
    if os.environ.get(TOKEN_ENV) or not argv or token not in argv:
        return
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--token":
            skip = True
        elif a != f"--token={token}":
            out.append(a)
    if token in out:
        return  # the token also appears elsewhere: leave the command as it is
    env = dict(os.environ, **{TOKEN_ENV: token})
    sys.stderr.flush()
    sys.stdout.flush()
    try:
        os.execve(sys.executable, out, env)
    except OSError as exc:
        log.warning("could not move the token out of the command line (%s)", exc)


def _default_dir(device_id: str) -> Path:
    return Path.home() / ".local" / "share" / "fogline" / f"agent-{device_id}"


def _key(args: argparse.Namespace) -> int:
    import json

    from runtime.security import Identity

    from .agent import KEY_FILE

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
    import socket

    name = socket.gethostname().split(".")[0] or "device"
    name = "".join(c if (c.isascii() and c.isalnum()) or c in "-_" else "-" for c in name)[:64]
    return name if name[:1].isalnum() else f"device{name}"[:64]


def _discover(site: str | None, timeout: float) -> tuple[str, int, str] | None:
    """(host, port, site) of a fog broker found with zeroconf, or None."""
    try:
        from runtime.discovery import browse
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


class _Refused(Exception):
    """A one-line reason the agent will not start (exit code 2)."""


def _run(args: argparse.Namespace) -> int:
    try:
        cfgs, profile = _configs(args)
    except _Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from runtime.errors import LocalViolation

    from .runner import run_agents

    try:
        return run_agents(cfgs, profile=profile, speedup=args.sim_speedup, flops=args.flops)
    except LocalViolation as exc:  # e.g. a key file readable by others, a corrupt replay state
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _configs(args: argparse.Namespace) -> tuple[list[Any], Any]:
    """AgentConfigs for this command line, enrolling data dirs first when a token is given."""
    from runtime.mqtt import parse_hostport

    from .commands import parse_labels, parse_taints

    try:
        labels = parse_labels(args.labels)
        taints = parse_taints(args.taints)
        fog_key = bytes.fromhex(args.fog_key) if args.fog_key else None
        if fog_key is not None and len(fog_key) != 32:
            raise ValueError("--fog-key must be 64 hex characters (an Ed25519 public key)")
    except ValueError as exc:
        raise _Refused(str(exc)) from None
    if args.count > 1 and not args.simulate:
        raise _Refused("--count needs --simulate PROFILE")
    if args.insecure and fog_key is None:
        raise _Refused("--insecure needs --fog-key HEX (the fog's key from its operator)")
    if args.insecure and args.token:
        raise _Refused("--insecure and --token exclude each other: enrolment is for TLS")
    profile = None
    if args.simulate:
        from .profiles import PROFILES

        profile = PROFILES.get(args.simulate)
        if profile is None:
            raise _Refused(f"unknown profile {args.simulate!r}; known: {', '.join(sorted(PROFILES))}")

    if args.count > 1:
        width = len(str(args.count - 1))
        ids = [f"{args.id_prefix}{i:0{width}d}" for i in range(args.count)]
        base = args.data_dir or Path.home() / ".local" / "share" / "fogline" / "fleet"
        dirs = [Path(base) / i for i in ids]
    else:
        ids = [args.device_id or (f"{args.id_prefix}0" if args.simulate and not args.device_id else _hostname())]
        dirs = [args.data_dir or _default_dir(ids[0])]
    from runtime.ids import id_problem

    bad = [p for p in (id_problem(i, "device id") for i in ids) if p]
    if bad:
        raise _Refused(bad[0])

    from runtime.errors import LocalViolation

    from .credentials import NOT_ENROLLED, is_enrolled, load_fog_info, tls_config

    site = args.site
    if args.broker:
        try:
            host, port = parse_hostport(args.broker, 1883 if args.insecure else 8883)
        except ValueError as exc:
            raise _Refused(str(exc)) from None
    else:
        found = _discover(site, args.discovery_timeout)
        stored = _stored_fog(dirs[0])
        if found is not None:
            host, port, found_site = found
            site = site or found_site
        elif stored is not None and stored.mqtt:  # the address the fog gave at enrolment
            try:
                host, port = parse_hostport(stored.mqtt)
            except ValueError as exc:
                raise _Refused(f"{dirs[0]}/fog.json: {exc}; pass --broker HOST:PORT") from None
        else:
            raise _Refused("no fog broker found with zeroconf; pass --broker HOST:PORT")

    if args.insecure:
        from runtime.net import require_loopback

        try:
            require_loopback(host, "--insecure")
        except LocalViolation as exc:
            raise _Refused(f"{exc}; enrol with --token") from None
    else:
        todo = [(i, d) for i, d in zip(ids, dirs) if not is_enrolled(d)]
        if todo:
            if not args.token:
                raise _Refused(NOT_ENROLLED.format(dir=todo[0][1]))
            _enrol(args, todo, host, port)

    cfgs = []
    from .agent import AgentConfig

    threads = args.threads if args.threads is not None else (1 if profile is not None else 0)
    if args.max_batch < 1:
        raise _Refused(f"--max-batch must be >= 1, not {args.max_batch}")
    if not 0.0 <= args.max_batch_wait_ms <= 1000.0:
        raise _Refused(f"--max-batch-wait-ms must be in [0, 1000], not {args.max_batch_wait_ms}")
    if not 0.0 <= args.sim_batch_slope <= 1.5:
        raise _Refused(f"--sim-batch-slope must be in [0, 1.5], not {args.sim_batch_slope}")
    for i, d in zip(ids, dirs):
        tls = None
        key = fog_key
        cfg_site = site
        if not args.insecure:
            try:
                info = load_fog_info(d)
            except LocalViolation as exc:
                raise _Refused(str(exc)) from None
            if info is None:
                raise _Refused(NOT_ENROLLED.format(dir=d))
            if key is not None and key != info.public_key:
                raise _Refused(f"--fog-key differs from the key the fog gave at enrolment ({d}/fog.json)")
            key = info.public_key
            cfg_site = site or info.site
            tls = tls_config(d, info.fog_id)  # the broker certificate names the fog id, whatever IP we dial
        cfgs.append(AgentConfig(
            device_id=i, data_dir=d, host=host, port=port, site=cfg_site or "default", labels=dict(labels),
            taints=taints, state_interval_s=args.state_interval, probe_interval_s=args.probe_interval,
            keepalive=args.keepalive, fog_key=key, tls=tls, intra_op_threads=threads, workers=args.workers,
            queue_size=args.queue_size, cache_bytes=args.cache_mb * 1024 * 1024,
            max_command_bytes=args.max_command_bytes, slowdown=args.sim_slowdown,
            model_compute=bool(args.sim_compute and profile is not None), max_batch=args.max_batch,
            max_batch_wait_s=args.max_batch_wait_ms / 1000.0, sim_batch_slope=args.sim_batch_slope))
    return cfgs, profile


def _stored_fog(data_dir: Path) -> Any:
    from runtime.errors import LocalViolation

    from .credentials import load_fog_info

    try:
        return load_fog_info(data_dir)
    except LocalViolation:
        return None  # reported when the agent's config is built


def _enrol(args: argparse.Namespace, todo: list[tuple[str, Path]], host: str, port: int) -> None:
    """Enrol each (id, dir) with the token: fetch and check the CA once, then request and wait."""
    from runtime.mqtt import parse_hostport

    from .enrol import EnrolError, enrol_dirs

    try:
        ehost, eport = parse_hostport(args.enroll) if args.enroll else (host, port + 1)
        done = enrol_dirs(args.token, todo, ehost, eport, timeout_s=args.enroll_timeout,
                          notify=lambda line: print(line, file=sys.stderr, flush=True))
    except (EnrolError, ValueError) as exc:
        raise _Refused(str(exc)) from None
    for r in done:
        if r.fog is not None:
            print(f"{r.device_id}: enrolled with fog {r.fog.fog_id} (site {r.fog.site})", file=sys.stderr)


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
