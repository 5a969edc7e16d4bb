"""``fogline coordinator``, ``fogline supernodes`` and ``fogline release``.

``fogline coordinator --app DIR`` runs a user's Flower App (``flwr new``
layout) on Flower's Deployment Engine with Fogline's supervision; without
``--app`` it runs the bundled digits app (``examples/digits``), whose run
config the digits flags (``--model``, ``--lr``, ...) set.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["register"]

log = logging.getLogger("fogline.coordinator")

# digits-app flags -> its run config keys (value transforms where the meaning differs)
_DIGITS_FLAGS = {"model": "model", "num_partitions": "num-partitions", "local_epochs": "local-epochs", "lr": "lr"}


def register(subparsers: Any) -> None:
    from runtime import cliargs as ca

    p = subparsers.add_parser(
        "coordinator", help="run a Flower App's rounds robustly (SuperLink + ServerApp), resuming from checkpoints",
        description="Start (or connect to) a Flower SuperLink with SuperNode authentication, run the app's rounds "
                    "with a Byzantine-robust rule, checkpoint to every --checkpoint-dir/--replica-dir, resume after "
                    "crashes, and release the model to the fog brokers.")
    p.add_argument("--app", type=ca.existing_dir, default=None,
                   help="Flower App directory ([tool.flwr.app] in its pyproject); default: examples/digits")
    p.add_argument("--checkpoint-dir", required=True, type=ca.writable_dir,
                   help="work directory and first checkpoint replica")
    p.add_argument("--replica-dir", action="append", type=ca.writable_dir, default=[],
                   help="another replica (repeatable)")
    p.add_argument("--quorum", type=int, default=None,
                   help="replicas a checkpoint must reach and a resume must find (default: a majority)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept per replica")
    p.add_argument("--checkpoint-mode", choices=("every-round", "young", "daly"), default="every-round")
    p.add_argument("--rounds", type=int, default=None, help="override the app's number of rounds")
    p.add_argument("--rule", default=None, help="aggregation rule, e.g. trimmed_mean, bulyan, nnm+centered_clipping")
    p.add_argument("--f", type=int, default=None, help="Byzantine clients to tolerate")
    p.add_argument("--min-clients", type=int, default=None, help="clients a round samples at least")
    p.add_argument("--min-replies", type=int, default=None,
                   help="usable replies a round needs to count (default: what the rule needs for --f, e.g. 2f+3 "
                        "for krum, 2f+1 for trimmed_mean and median); run config key 'min-replies'")
    p.add_argument("--max-attempts", type=int, default=None,
                   help="attempts per round without a quorum before the run stops with fatal.json (default 3); "
                        "run config key 'max-attempts'")
    p.add_argument("--round-timeout", type=float, default=None,
                   help="first reply deadline in seconds and its floor (default 60); later ones follow measured "
                        "reply times (p95 x 3)")
    p.add_argument("--max-round-timeout", type=float, default=None,
                   help="upper bound of the adapted reply deadline (default 5 x --round-timeout); run config key "
                        "'max-round-timeout'")
    p.add_argument("--grace", type=float, default=None, help="wait this long for stragglers after a quorum")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--superlink", default="127.0.0.1:9093", type=ca.hostport,
                   help="SuperLink HOST:PORT; started here unless one already listens there")
    p.add_argument("--insecure", action="store_true", help="plain MQTT to the sites (loopback addresses only)")
    p.add_argument("--no-supernode-auth", action="store_true",
                   help="SuperLink without TLS and SuperNode authentication (a loopback address only)")
    p.add_argument("--mqtt", default="", type=ca.hostport_or_empty,
                   help="one site's fog broker HOST:PORT (summaries in, releases out); --site/--sites for several")
    p.add_argument("--credentials", type=ca.existing_dir, default=None,
                   help="coordinator credentials issued by the fog (fogline operators add NAME --role coordinator)")
    p.add_argument("--rollout-wait", type=float, default=300.0,
                   help="after the last round, wait this long for staged rollouts to finish (they resume at the "
                        "next start, or with fogline sites resume)")
    p.add_argument("--release", dest="release_name", default="", help="release name (default: [tool.fogline])")
    p.add_argument("--workload", dest="release_name", help=argparse.SUPPRESS)
    p.add_argument("--release-every", type=int, default=0, help="release every K rounds (0: the app's setting)")
    p.add_argument("--run-config", default="", help="app run config overrides, 'key=value key2=\"text\"'")
    p.add_argument("--battery-floor", type=float, default=0.3,
                   help="a discharging device below this charge does not train (a charging one may)")
    p.add_argument("--selection", default=None, metavar="RULE",
                   help="who trains, from the fogs' summaries: battery-floor (default) or cross-device (only "
                        "charging, unmetered, idle, unthrottled devices); run config key 'selection'")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")
    p.add_argument("--max-restarts", type=int, default=5)
    p.add_argument("--watchdog", type=ca.nonneg_float, default=None,
                   help="seconds without round progress before the coordinator says what it waits for and restarts "
                        "the component that is down (default: from the round timeout and grace; 0: off)")
    p.add_argument("--new-lineage", action="store_true",
                   help="train a new model even though the checkpoints here come from another app or run config "
                        "(they stay on disk and are never resumed into it)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics (rounds, checkpoints, releases, rollouts, sites) on PORT")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="address for --metrics-port (default 127.0.0.1, plain HTTP); any other address serves "
                        "HTTPS to client certificates of a site's CA (operator, coordinator or monitor)")
    p.add_argument("--hierarchical", action="store_true",
                   help="two-level rounds: this SuperLink's SuperNodes are sites (fogline site-aggregator), each "
                        "answering with its devices' robust aggregate; the rule and --f apply to sites")
    # tests and demos of a Byzantine site: another ClientApp for the sites (simulations.faulty_bridge:app)
    p.add_argument("--site-bridge", default=None, metavar="MODULE:APP", help=argparse.SUPPRESS)
    from .sites_cli import add_site_options

    add_site_options(p, with_insecure=False)
    g = p.add_argument_group("digits app (examples/digits)")
    g.add_argument("--model", choices=("softmax", "mlp"), default=None)
    g.add_argument("--num-partitions", type=int, default=None)
    g.add_argument("--non-iid", type=float, default=None, metavar="ALPHA", help="Dirichlet(alpha) label skew")
    g.add_argument("--local-epochs", type=int, default=None)
    g.add_argument("--lr", type=float, default=None)
    p.set_defaults(func=coordinator)

    from . import sites_cli

    sites_cli.register(subparsers)

    s = subparsers.add_parser("supernodes", help="SuperNode keys the coordinator authenticates",
                              description="Flower SuperNode authentication: make a device key, authorize it.")
    ss = s.add_subparsers(dest="action", metavar="ACTION", required=True)
    k = ss.add_parser("keygen", help="make an EC P-384 key pair for a SuperNode (run on the device)")
    k.add_argument("--out", type=ca.writable_dir, required=True)
    k.add_argument("--name", default="supernode")
    a = ss.add_parser("add", help="authorize DEVICE's public key")
    a.add_argument("device")
    a.add_argument("public_key", type=ca.existing_file)
    a.add_argument("--checkpoint-dir", required=True, type=ca.writable_dir)
    r = ss.add_parser("remove", help="revoke DEVICE (takes effect when the coordinator's SuperLink restarts)")
    r.add_argument("device")
    r.add_argument("--checkpoint-dir", required=True, type=ca.existing_dir)
    ls = ss.add_parser("list", help="authorized devices and key fingerprints")
    ls.add_argument("--checkpoint-dir", required=True, type=ca.existing_dir)
    s.set_defaults(func=supernodes)

    rel = subparsers.add_parser("release", help="sign an ONNX model and publish it to a fog broker by hand",
                                description="Check MODEL.onnx in onnxruntime, sign it with the coordinator "
                                            "credentials and publish it as release NAME (not retained).")
    rel.add_argument("model", type=ca.existing_file)
    rel.add_argument("--name", required=True)
    rel.add_argument("--broker", required=True, type=ca.host_or_hostport,
                     help="fog broker HOST:PORT (port 8883, 1883 with --insecure)")
    rel.add_argument("--credentials", type=ca.existing_dir, default=None, help="coordinator credentials directory")
    rel.add_argument("--version", type=int, default=None, help="default: the current Unix time (always newer)")
    rel.add_argument("--insecure", action="store_true", help="plain MQTT (loopback only)")
    rel.set_defaults(func=release_cmd)
    from .site_aggregator.cli import register as register_site_aggregator

    register_site_aggregator(subparsers)


def _error(text: str) -> int:
    print(f"error: {text}", file=sys.stderr)
    return 2


def _parse_run_config(text: str) -> dict[str, Any]:
    import re

    import tomllib

    pairs = re.findall(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)", text)
    try:
        return tomllib.loads("\n".join(f'"{k}" = {v}' for k, v in pairs)) if pairs else {}
    except tomllib.TOMLDecodeError:
        raise ValueError(f"--run-config {text!r}: expected key=value pairs (strings in double quotes)") from None


def _overrides(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    out = _parse_run_config(args.run_config)
    for flag, key in _DIGITS_FLAGS.items():
        if getattr(args, flag) is not None:
            out[key] = getattr(args, flag)
    if args.non_iid is not None:
        out.update({"iid": False, "alpha": float(args.non_iid)})
    for flag, key in (("seed", "seed"), ("rule", "rule"), ("f", "f"), ("min_clients", "min-train-nodes"),
                      ("min_replies", "min-replies"), ("max_attempts", "max-attempts"),
                      ("max_round_timeout", "max-round-timeout"),
                      ("round_timeout", "round-timeout"), ("grace", "grace"), ("rounds", "num-server-rounds"),
                      ("selection", "selection")):
        if getattr(args, flag) is not None and key in config:  # keep the app's own config consistent
            out[key] = getattr(args, flag)
    return out


def _fatal(work: Path, text: str) -> int:
    """A run that cannot start: ``fatal.json`` (what monitoring reads, as from a ServerApp) and one line."""
    from runtime.files import atomic_write

    from .settings import FATAL_FILE

    try:
        atomic_write(work / FATAL_FILE, json.dumps({"error": text, "at": time.time()}))
    except OSError as exc:
        log.error("cannot record the failure in %s: %s", work, exc)
    return _error(text)


def _check_run_config(cfg: dict[str, Any], args: argparse.Namespace) -> str | None:
    """The strategy options of the effective run config (app config, --run-config, flags), checked now.

    A bad value fails here in a second, not in a ServerApp log after the SuperLink and the
    devices are up. Returns the rule the run will use (None: the strategy's default).
    """
    from .aggregation import get_rule

    rule = args.rule or str(cfg.get("rule", "") or "") or None
    selection_rule(cfg, args)
    f = args.f if args.f is not None else cfg.get("f", 1)
    if isinstance(f, bool) or not isinstance(f, int):
        raise ValueError(f"f must be an integer, got {f!r}")
    if rule is not None or args.f is not None or "f" in cfg:
        get_rule(rule or "centered_clipping", f)
    checks = (("fraction-train", lambda v: 0 <= v <= 1, "in [0, 1]"),
              ("fraction-evaluate", lambda v: 0 <= v <= 1, "in [0, 1]"),
              ("round-timeout", lambda v: v > 0, "> 0"), ("grace", lambda v: v >= 0, ">= 0"),
              ("num-server-rounds", lambda v: v >= 1 and float(v).is_integer(), "an integer >= 1"),
              ("min-train-nodes", lambda v: v >= 1 and float(v).is_integer(), "an integer >= 1"),
              ("min-replies", lambda v: v >= 1 and float(v).is_integer(), "an integer >= 1"),
              ("max-attempts", lambda v: v >= 1 and float(v).is_integer(), "an integer >= 1"),
              ("max-round-timeout", lambda v: v > 0, "> 0"))
    for key, ok, what in checks:
        v = cfg.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
            raise ValueError(f"{key} must be {what}, got {v!r}")
    return rule


def _round_options(args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    """Quorum, retry budget and deadline bound of the run: the flag, else the run config's key, else None."""
    out: dict[str, Any] = {}
    for flag, key, kind in (("min_replies", "min-replies", int), ("max_attempts", "max-attempts", int),
                            ("max_round_timeout", "max-round-timeout", float)):
        v = getattr(args, flag)
        out[flag] = kind(v if v is not None else cfg[key]) if v is not None or cfg.get(key) is not None else None
    return out


def selection_rule(cfg: dict[str, Any], args: argparse.Namespace) -> str:
    """The selection rule of --selection, else the run config's ``selection`` (checked: a bad name is one line)."""
    from .selection import DEFAULT_RULE, policy_named

    name = args.selection if args.selection is not None else cfg.get("selection", DEFAULT_RULE)
    if not isinstance(name, str):
        raise ValueError(f"selection must be a name, got {name!r}")
    policy_named(name, args.battery_floor)  # LocalViolation: unknown name, or a floor outside [0, 1]
    return name


def coordinator(args: argparse.Namespace) -> int:
    from runtime.errors import FoglineError
    from runtime.security import Identity

    from .aggregation import get_rule
    from .app import STAGED_DIR, bundled_app, load_app, stage
    from .launcher import RunStopped, Supervisor, SupervisorOptions, require_loopback_superlink
    from .policy import CheckpointPolicy
    from .release import ReleaseError, resolve_export
    from .settings import RELEASES_DIR, Settings, key_path
    from .sites import summaries_dir_of
    from .supervision import watchdog_bound

    if ":" not in args.superlink:
        return _error("--superlink must be HOST:PORT")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        return _error("--metrics-port must be a port number (0: any free port)")
    if any(v is not None and v < 1 for v in (args.rounds, args.min_clients, args.min_replies, args.max_attempts)) or \
            (args.f is not None and args.f < 0):
        return _error("--rounds, --min-clients, --min-replies and --max-attempts must be >= 1, --f >= 0")
    if args.max_round_timeout is not None and args.max_round_timeout < (args.round_timeout or 0.0):
        return _error("--max-round-timeout must be at least --round-timeout")
    try:
        spec = load_app(args.app if args.app is not None else bundled_app("digits"))
        rule = args.rule or str(spec.config.get("rule", "")) or None
        if rule is not None or args.f is not None:
            get_rule(rule or "centered_clipping", args.f if args.f is not None else int(spec.config.get("f", 1)))
        dirs = [args.checkpoint_dir.resolve(), *(d.resolve() for d in args.replica_dir)]
        CheckpointPolicy(mode=args.checkpoint_mode, keep=args.keep, quorum=args.quorum).quorum_for(len(dirs))
        host = args.superlink.rpartition(":")[0]
        if args.no_supernode_auth:
            require_loopback_superlink(host)
        work = dirs[0]
        work.mkdir(parents=True, exist_ok=True)
        many = bool(args.site_args or args.sites_file)
        if many and (args.mqtt or args.credentials is not None):
            return _error("--site/--sites name each site's credentials: leave out --mqtt and --credentials")
        creds = None
        if args.credentials is not None or args.mqtt:
            from runtime.credentials import load_credentials

            creds = load_credentials(args.credentials)
            if args.mqtt and creds.role != "coordinator":
                return _error(f"{creds.dir} holds {creds.role!r} credentials ({creds.name}); a coordinator needs "
                              "its own: fogline operators add NAME --role coordinator --data-dir FOGDIR")
        if not (many or args.mqtt) and (args.canary or args.rollout_set or args.holdout):
            return _error("--canary, --rollout-set and --holdout need sites: --site/--sites, or --mqtt")
        table = None
        if many or args.mqtt:
            from .sites_cli import site_table

            table = site_table(args, work, legacy=creds if args.mqtt else None, insecure=args.insecure)
        if creds is not None:  # one site, as before: checkpoints and releases signed with its credentials
            signing_path, signer = creds.dir / "signing.key", creds.name
        else:
            signing_path, signer = key_path(work, "coordinator.key"), "coordinator"
            Identity.load_or_create(signer, signing_path)
        if spec.export:  # import the hook here too: a typo fails now, not in a ServerApp log
            sys.path.insert(0, str(spec.dir))
            try:
                resolve_export(spec.export)
            finally:
                sys.path.remove(str(spec.dir))
        overrides = _overrides(args, dict(spec.config))
        try:
            rule = _check_run_config({**dict(spec.config), **overrides}, args) or rule
        except (FoglineError, ValueError) as exc:
            return _fatal(work, f"run config: {exc}")
        effective = {**dict(spec.config), **overrides}
        for key in ("selection", "min-replies", "max-attempts", "max-round-timeout"):
            if key not in spec.config:  # the coordinator's keys (settings), not ones the app knows
                overrides.pop(key, None)
        round_s = float(args.round_timeout or effective.get("round-timeout") or 60.0)
        grace_s = float(args.grace if args.grace is not None else effective.get("grace", 5.0))
        rounds_cfg = _round_options(args, effective)
        max_round_s = rounds_cfg["max_round_timeout"] or 5.0 * round_s
        if max_round_s < round_s:
            return _fatal(work, f"run config: max-round-timeout {max_round_s:g} s is below the round timeout "
                                f"{round_s:g} s")
        # from the first deadline; the supervisor raises it as the ServerApp's deadline adapts (progress.json)
        watchdog = args.watchdog if args.watchdog is not None else watchdog_bound(round_s, grace_s)
        if watchdog and watchdog <= round_s + grace_s:
            return _error(f"--watchdog {watchdog:g} must exceed round-timeout + grace ({round_s + grace_s:g} s): "
                          "a working round waits that long for replies without a word")
        from .lineage import app_digest, bind, config_digest

        lineage = bind(work, app_digest(spec.dir),
                       config_digest({**dict(spec.config), **overrides},
                                     {"rule": args.rule, "f": args.f, "seed": args.seed,
                                      "hierarchical": True if args.hierarchical else None}),
                       has_checkpoints=any(any(d.glob("ckpt-*")) for d in dirs if d.is_dir()),
                       new_lineage=args.new_lineage)
        settings = Settings(
            work_dir=str(work), checkpoint_dirs=tuple(map(str, dirs)), quorum=args.quorum, keep=args.keep,
            checkpoint_mode=args.checkpoint_mode, signing_key=str(signing_path), signer=signer,
            rule=args.rule, f=args.f, rounds=args.rounds, round_timeout=args.round_timeout, grace=args.grace,
            min_train_nodes=args.min_clients, seed=args.seed, export=spec.export, **rounds_cfg,
            release_name=args.release_name or spec.release or spec.name,
            release_every=args.release_every or spec.every, input_shape=spec.input_shape,
            supernodes="" if args.no_supernode_auth else str(work / "supernodes.json"),
            sites={s.name: {"summaries_dir": str(summaries_dir_of(work, s.name)), "fog_id": s.creds.fog.fog_id,
                            "fog_key": s.creds.fog.public_key.hex(), "fog_site": s.creds.fog.site}
                   for s in table.sites} if table is not None else {},
            battery_floor=args.battery_floor, selection=selection_rule(effective, args), lineage=lineage.id,
            client_evaluate=spec.client_evaluate and not args.hierarchical)  # a site bridge does not evaluate
        if not args.no_supernode_auth and not (work / "supernodes.json").exists():
            log.warning("no SuperNode authorized yet: fogline supernodes add DEVICE KEY.pub --checkpoint-dir %s", work)
        from .site_aggregator.cli import BRIDGE_COMPONENT

        bridge = args.site_bridge or BRIDGE_COMPONENT
        if bridge != BRIDGE_COMPONENT:
            log.warning("WARNING: the sites run %s, not the production bridge (--site-bridge: tests and demos only)",
                        bridge)
        staged = stage(spec, work / STAGED_DIR, overrides,
                       components={"clientapp": bridge} if args.hierarchical else None)
        settings_path = settings.save()
        service = None
        if table is not None:
            from .siteservice import SiteService

            service = SiteService(work, table, Identity.load(signer, signing_path), insecure=args.insecure).start()
        sup = Supervisor(SupervisorOptions(work, staged, settings_path, args.superlink, args.no_supernode_auth,
                                           args.max_restarts, args.timeout, watchdog_s=watchdog or None))
        rolled: list[dict[str, Any]] = []
        exporter = None
        try:
            if args.metrics_port is not None:
                exporter = _serve_metrics(args, settings, sup, service, table, dirs, rule, spec.config)
            doc = sup.run()
            if service is not None and not service.drain(args.rollout_wait):
                log.warning("rollouts still running after --rollout-wait %g s; they resume at the next start "
                            "(or: fogline sites resume --checkpoint-dir %s)", args.rollout_wait, work)
        finally:
            if service is not None:
                service.stop()
                rolled = service.outcomes()
            if exporter is not None:
                exporter.close()
    except RunStopped as exc:
        return _error(str(exc))
    except (FoglineError, ReleaseError, ValueError) as exc:
        return _error(str(exc))
    _print_report(doc, work / RELEASES_DIR, settings, rolled)
    return 0


def _serve_metrics(args: argparse.Namespace, settings: Any, sup: Any, service: Any, table: Any, dirs: list[Path],
                   rule: str | None, config: Any) -> Any:
    """Start the coordinator's exporter (``cloud_coordinator.metrics``); the supervisor's poll feeds it."""
    from runtime.errors import LocalViolation
    from runtime.security import Identity

    from .metrics import CoordinatorWatch, Source, serve

    rounds = args.rounds if args.rounds is not None else config.get("num-server-rounds")
    source = Source(Path(settings.work_dir), tuple(dirs),
                    Identity.load(settings.signer, settings.signing_key).public_key_bytes,
                    rule=rule or "app", release=settings.release_name if settings.export else "",
                    checkpoint_mode=settings.checkpoint_mode,
                    rounds_target=int(rounds) if isinstance(rounds, int) else None)
    watch = CoordinatorWatch(source, supervisor=sup, service=service)
    sup.on_tick = watch.observe
    cas = [s.creds.dir / "ca.pem" for s in table.sites] if table is not None else []
    try:
        server = serve(watch, args.metrics_port, args.metrics_host, client_cas=cas, work_dir=Path(settings.work_dir),
                       server_names=[args.superlink.rpartition(":")[0]])  # the name SuperNodes dial
    except OSError as exc:
        raise LocalViolation(f"cannot serve metrics on {args.metrics_host}:{args.metrics_port}: "
                             f"{exc.strerror or exc}") from None
    host, port = server.address
    print(f"metrics: {'https' if server.tls else 'http'}://{host}:{port}/metrics", file=sys.stderr, flush=True)
    return server


def _print_report(doc: dict[str, Any], releases: Path, s: Any, rolled: list[dict[str, Any]] | None = None) -> None:
    from .selection import selection_line

    hist = doc.get("history", [])
    print(f"fogline coordinator: {doc.get('rounds_done')}/{doc.get('rounds')} rounds, resumed after round "
          f"{doc.get('resumed_from')}, config {doc.get('config_hash')}")
    for h in hist:
        acc = (h.get("server") or {}).get("accuracy")
        extra = f" rejected {h['rejected']}" if h.get("rejected") else ""
        skipped = f" SKIPPED: {h['skipped']}" if h.get("skipped") else ""
        quorum = f", {h['replies']}/{h['quorum']} replies of its quorum" if "quorum" in h else ""
        retried = "".join(f"\n    retried: {why}" for why in h.get("retried", ()))
        print(f"  round {h['round']}: {len(h.get('accepted', []))}/{len(h.get('clients', []))} accepted{quorum}"
              f"{'' if acc is None else f', accuracy {acc:.4f}'}{extra}{skipped}{retried}")
        if isinstance(h.get("selection"), dict):
            print(f"    {selection_line(h['selection'])}")
    for rel in doc.get("releases", []):
        if rel.get("unchanged"):
            print(f"  round {rel['round']}: model unchanged since {s.release_name} v{rel['version']}, not released")
        elif "error" in rel:
            print(f"  release after round {rel['round']} failed: {rel['error']}")
        else:
            print(f"  released {s.release_name} v{rel['version']} sha256 {rel['sha256'][:12]}")
    if rolled:
        from .sites_cli import rollout_line

        for r in rolled:
            print(f"  {rollout_line(r)}")
    print(f"checkpoints in {', '.join(s.checkpoint_dirs)}; report {Path(s.work_dir) / 'report.json'}")


def supernodes(args: argparse.Namespace) -> int:
    from runtime.errors import FoglineError

    from .supernodes import SUPERNODES_FILE, KeyBook, keygen

    try:
        if args.action == "keygen":
            priv, pub = keygen(args.out, args.name)
            print(f"private key {priv} (flower-supernode --auth-supernode-private-key {priv})")
            print(f"public key  {pub} (on the coordinator: fogline supernodes add DEVICE {pub} --checkpoint-dir D)")
            return 0
        book = KeyBook(args.checkpoint_dir / SUPERNODES_FILE)
        if args.action == "add":
            try:
                data = args.public_key.read_bytes()
            except OSError as exc:
                return _error(f"cannot read {args.public_key}: {exc.strerror or exc}")
            node = book.add(args.device, data)
            print(f"authorized {node.device_id}: key {node.key_id[:16]}")
        elif args.action == "remove":
            book.remove(args.device)
            print(f"removed {args.device}")
        else:
            for dev, node in sorted(book.nodes.items()):
                print(f"{dev}\t{node.key_id[:16]}")
        return 0
    except FoglineError as exc:
        return _error(str(exc))


def release_cmd(args: argparse.Namespace) -> int:
    from runtime import codec
    from runtime.credentials import load_credentials
    from runtime.errors import FoglineError
    from runtime.mqtt import MqttClient, parse_hostport
    from runtime.net import require_loopback
    from runtime.topics import Topics

    from .release import build_release, onnx_file

    try:
        host, port = parse_hostport(args.broker, 1883 if args.insecure else 8883)
        if args.insecure:
            require_loopback(host)
        creds = load_credentials(args.credentials)
        blob = onnx_file(args.model)
        version = args.version if args.version is not None else int(time.time())
        rel = build_release(blob, creds.signing, args.name, version, {"source": args.model.name})
        client = MqttClient(creds.name, host, port, tls=None if args.insecure else creds.tls_for(None))
        client.start(wait_s=15.0)
        try:
            topic = Topics(creds.fog.site).release(creds.name)
            if not client.publish(topic, codec.encode(rel), qos=1, retain=False).wait(15):
                return _error(f"the broker at {args.broker} did not acknowledge the release")
        finally:
            client.stop()
    except (FoglineError, ValueError) as exc:
        return _error(str(exc))
    print(json.dumps({"name": rel.workload, "version": rel.version, "sha256": rel.sha256, "signer": rel.signer,
                      "bytes": len(blob)}))
    return 0
