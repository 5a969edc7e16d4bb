"""``fogline site-aggregator``: a fog site's half of two-level (hierarchical) robust rounds.

On the fog host, next to ``fogline broker``: a Flower SuperLink for the
site's devices (their SuperNodes authenticate with keys added by
``fogline supernodes add DEVICE KEY.pub --checkpoint-dir WORK``), the user's
app submitted to it with the site server as its ServerApp, and one
SuperNode towards the cloud's SuperLink (the cloud authorizes its key like a
device's, under the site's name) whose ClientApp is the bridge. Supervised
like ``fogline coordinator``: the SuperLink, the run and the cloud
SuperNode are restarted when they die; the site keeps no model state of its
own, so nothing is lost by a restart but the round in flight, which the
cloud retries.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["register"]

log = logging.getLogger("fogline.site-rounds")
SERVER_COMPONENT = "cloud_coordinator.site_aggregator.site_server:app"
BRIDGE_COMPONENT = "cloud_coordinator.site_aggregator.bridge:app"
CLOUD_NODE_LOG = "cloud-supernode.log"


def register(subparsers: Any) -> None:
    from runtime import cliargs as ca

    p = subparsers.add_parser(
        "site-aggregator", help="aggregate this site's devices robustly for the cloud (two-level Flower rounds)",
        description="Run a Flower SuperLink for this site's devices and a SuperNode towards the cloud: every cloud "
                    "round becomes one robust round here, and the WAN carries one update for the whole site.")
    p.add_argument("--app", type=ca.existing_dir, required=True,
                   help="the Flower App the cloud runs (its ClientApp trains here)")
    p.add_argument("--work-dir", type=ca.writable_dir, required=True,
                   help="site work directory (supernodes.json, spool, logs)")
    p.add_argument("--site", required=True, help="this site's name (the cloud authorizes its SuperNode under it)")
    p.add_argument("--listen", default="127.0.0.1:9095", type=ca.hostport,
                   help="the site SuperLink's Fleet API HOST:PORT")
    p.add_argument("--rule", default="trimmed_mean", help="the site's robust rule (e.g. median, nnm+trimmed_mean)")
    p.add_argument("--f", type=int, default=1, help="Byzantine devices to tolerate in this site")
    p.add_argument("--min-clients", type=int, default=None, help="device replies a site round needs at least")
    p.add_argument("--round-timeout", type=float, default=30.0,
                   help="longest site round (seconds); the cloud's own round-timeout caps it")
    p.add_argument("--grace", type=float, default=2.0, help="wait this long for stragglers after a quorum")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cloud", default="", type=ca.hostport_or_empty,
                   help="the cloud SuperLink's Fleet API HOST:PORT (none: site only)")
    p.add_argument("--cloud-ca", type=ca.existing_file, default=None,
                   help="CA certificate of the cloud SuperLink (TLS)")
    p.add_argument("--cloud-key", type=ca.existing_file, default=None,
                   help="this site's SuperNode private key (fogline supernodes keygen; the cloud adds the .pub)")
    p.add_argument("--cloud-node-config", default="", help="extra node config for the cloud SuperNode")
    p.add_argument("--cloud-insecure", action="store_true",
                   help="plain connection to the cloud SuperLink (a loopback address only)")
    p.add_argument("--no-supernode-auth", action="store_true",
                   help="site SuperLink without TLS and SuperNode authentication (a loopback address only)")
    p.set_defaults(func=site_aggregator)


def _error(text: str) -> int:
    print(f"error: {text}", file=sys.stderr)
    return 2


class CloudNode:
    """The site's SuperNode towards the cloud: started once the site server runs, restarted when it dies."""

    def __init__(self, argv: list[str], env: dict[str, str], logfile: Path) -> None:
        self.argv, self.env, self.logfile = argv, env, logfile
        self.proc: subprocess.Popen[bytes] | None = None
        self.next_start = 0.0
        self.starts = 0

    def tick(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        now = time.monotonic()
        if now < self.next_start:
            return
        if self.proc is not None:
            log.warning("the cloud SuperNode exited (%s); restarting it (see %s)", self.proc.returncode, self.logfile)
        from runtime import children

        self.proc = children.spawn(self.argv, log=self.logfile, env=self.env, whole_tree=True)
        self.starts += 1
        self.next_start = now + min(30.0, 2.0 * self.starts)  # backoff between restarts

    def close(self) -> None:
        from runtime import children

        children.stop(self.proc, 10.0)


def _cloud_node(args: argparse.Namespace, work: Path, spool: Path) -> CloudNode | None:
    from cloud_coordinator.launcher import flower_bin, flower_env, require_loopback_superlink
    from runtime.broker import free_port

    if not args.cloud:
        log.warning("no --cloud: this site aggregates but nobody asks it to (site-only mode)")
        return None
    if ":" not in args.cloud:
        raise ValueError("--cloud must be HOST:PORT")
    argv = [flower_bin("flower-supernode"), "--superlink", args.cloud, "--port", str(free_port())]
    if args.cloud_insecure:
        require_loopback_superlink(args.cloud.rpartition(":")[0])
        argv.append("--insecure")
    else:
        if args.cloud_ca is None or args.cloud_key is None:
            raise ValueError("--cloud needs --cloud-ca (the cloud SuperLink's CA) and --cloud-key (this site's "
                             "SuperNode key), or --cloud-insecure on loopback")
        for what, path in (("--cloud-ca", args.cloud_ca), ("--cloud-key", args.cloud_key)):
            if not path.is_file():
                raise ValueError(f"{what} {path} does not exist")
        argv += ["--root-certificates", str(args.cloud_ca.resolve()),
                 "--auth-supernode-private-key", str(args.cloud_key.resolve())]
    config = f"site-spool={json.dumps(str(spool))} site={json.dumps(args.site)}"  # TOML basic strings
    if args.cloud_node_config:
        config += f" {args.cloud_node_config}"
    argv += ["--node-config", config]
    env = flower_env(work / ".flwr-cloud-node")
    return CloudNode(argv, env, work / CLOUD_NODE_LOG)


def site_aggregator(args: argparse.Namespace) -> int:
    from cloud_coordinator.aggregation import get_rule
    from cloud_coordinator.app import STAGED_DIR, load_app, stage
    from cloud_coordinator.launcher import (
        RunStopped,
        Supervisor,
        SupervisorOptions,
        require_loopback_superlink,
    )
    from cloud_coordinator.settings import Settings
    from cloud_coordinator.supernodes import SUPERNODES_FILE, valid_device_id
    from runtime.errors import FoglineError

    from .site_server import SPOOL_DIR
    from .spool import Spool

    if not valid_device_id(args.site):
        return _error(f"site name {args.site!r}: letters, digits, '.', '_' and '-' only")
    if ":" not in args.listen:
        return _error("--listen must be HOST:PORT")
    if args.round_timeout <= 0 or args.grace < 0 or args.f < 0:
        return _error("--round-timeout must be > 0, --grace and --f >= 0")
    node: CloudNode | None = None
    try:
        spec = load_app(args.app)
        get_rule(args.rule, args.f)
        if args.no_supernode_auth:
            require_loopback_superlink(args.listen.rpartition(":")[0])
        work = args.work_dir.resolve()
        work.mkdir(parents=True, exist_ok=True)
        spool = Spool(work / SPOOL_DIR)
        node = _cloud_node(args, work, spool.root)
        settings = Settings(work_dir=str(work), rule=args.rule, f=args.f, round_timeout=args.round_timeout,
                            grace=args.grace, min_train_nodes=args.min_clients, seed=args.seed,
                            supernodes="" if args.no_supernode_auth else str(work / SUPERNODES_FILE))
        if not args.no_supernode_auth and not (work / SUPERNODES_FILE).exists():
            log.warning("no device SuperNode authorized at this site yet: fogline supernodes add DEVICE KEY.pub "
                        "--checkpoint-dir %s", work)
        staged = stage(spec, work / STAGED_DIR, {}, components={"serverapp": SERVER_COMPONENT})
        settings_path = settings.save()
        sup = Supervisor(SupervisorOptions(work, staged, settings_path, args.listen, args.no_supernode_auth,
                                           max_restarts=1000, timeout_s=10 * 365 * 86400.0),
                         on_tick=node.tick if node is not None else None)

        def _stop(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, _stop)
        print(f"site {args.site}: devices' SuperLink on {args.listen}"
              f"{'' if node is None else f', cloud SuperNode to {args.cloud}'}; {args.rule} f={args.f}", flush=True)
        sup.run()
        return 0
    except KeyboardInterrupt:
        return 0
    except RunStopped as exc:
        return _error(str(exc))
    except (FoglineError, ValueError) as exc:
        return _error(str(exc))
    finally:
        if node is not None:
            node.close()

