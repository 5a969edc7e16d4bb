"""``fogline coordinator``: run (or resume) federated training through Flower's Deployment Engine."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["register", "run_config_from_args"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "coordinator", help="run federated rounds (Flower SuperLink + ServerApp), resuming from checkpoints",
        description="Start (or connect to) a Flower SuperLink, run the rounds with a Byzantine-robust rule, "
                    "checkpoint to every --checkpoint-dir/--replica-dir, resume after crashes, release the model.")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rule", default="trimmed_mean", help="aggregation rule, e.g. trimmed_mean, bulyan, "
                   "nnm+centered_clipping (see cloud_coordinator.aggregation.RULES)")
    p.add_argument("--f", type=int, default=1, help="Byzantine clients to tolerate")
    p.add_argument("--checkpoint-dir", required=True, type=Path)
    p.add_argument("--replica-dir", action="append", type=Path, default=[],
                   help="another checkpoint replica (repeatable); writes need a quorum of 2")
    p.add_argument("--superlink", default="127.0.0.1:9093",
                   help="SuperLink HOST:PORT; started here unless one already listens there")
    p.add_argument("--mqtt", default="", help="MQTT broker HOST:PORT for fleet summaries and model releases")
    p.add_argument("--site", default="default")
    p.add_argument("--min-clients", type=int, default=2)
    p.add_argument("--round-timeout", type=float, default=60.0)
    p.add_argument("--grace", type=float, default=5.0, help="wait this long for stragglers after a quorum")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", choices=("softmax", "mlp"), default="softmax")
    p.add_argument("--num-partitions", type=int, default=3, help="how the digits data is split among devices")
    p.add_argument("--non-iid", type=float, default=None, metavar="ALPHA", help="Dirichlet(alpha) split")
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept per replica")
    p.add_argument("--checkpoint-mode", choices=("every-round", "young", "daly"), default="every-round")
    p.add_argument("--release-every", type=int, default=0, help="release the model every N rounds (0: never)")
    p.add_argument("--workload", default="digits")
    p.add_argument("--battery-floor", type=float, default=0.3)
    p.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")
    p.add_argument("--max-restarts", type=int, default=5)
    p.add_argument("--model-module", default="models.train", help=argparse.SUPPRESS)
    p.set_defaults(func=handler)


def run_config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    from .rounds import RunConfig

    cfg = RunConfig(rounds=args.rounds, rule=args.rule, f=args.f, seed=args.seed, min_clients=args.min_clients,
                    num_partitions=args.num_partitions, model=args.model, local_epochs=args.local_epochs,
                    lr=args.lr, iid=args.non_iid is None, alpha=args.non_iid or 0.5,
                    round_timeout_s=args.round_timeout, grace_s=args.grace)
    dirs = [args.checkpoint_dir.resolve(), *(d.resolve() for d in args.replica_dir)]
    rc: dict[str, Any] = {**cfg.to_mapping(), "checkpoint-dirs": os.pathsep.join(map(str, dirs)),
                          "checkpoint-mode": args.checkpoint_mode, "keep": args.keep, "quorum": 2,
                          "release-every": args.release_every, "workload": args.workload, "site": args.site,
                          "mqtt": args.mqtt, "model-module": args.model_module,
                          "battery-floor": args.battery_floor}
    if args.mqtt:
        rc["summaries-dir"] = str(dirs[0] / "summaries")
    return rc


def handler(args: argparse.Namespace) -> int:
    from runtime.errors import FoglineError

    from .aggregation import RULES
    from .launcher import CoordinatorOptions, Supervisor

    rule = args.rule.split("+")[-1]
    if rule not in RULES:
        print(f"error: unknown rule {args.rule!r}; choose from {', '.join(RULES)}", file=sys.stderr)
        return 2
    if args.rounds < 1 or args.min_clients < 1 or args.f < 0:
        print("error: --rounds and --min-clients must be >= 1, --f >= 0", file=sys.stderr)
        return 2
    if ":" not in args.superlink:
        print("error: --superlink must be HOST:PORT", file=sys.stderr)
        return 2
    try:
        rc = run_config_from_args(args)
    except FoglineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    bridge = None
    if args.mqtt:
        from .summaries import SummaryBridge

        bridge = SummaryBridge(args.mqtt, args.site, Path(rc["summaries-dir"]))
        bridge.start()
    try:
        doc = Supervisor(CoordinatorOptions(args.checkpoint_dir.resolve(), rc, args.superlink,
                                            max_restarts=args.max_restarts, timeout_s=args.timeout)).run()
    finally:
        if bridge is not None:
            bridge.stop()
    last = doc["history"][-1] if doc["history"] else {}
    acc = last.get("accuracy")
    print(f"fogline coordinator: {doc['rounds_done']}/{doc['rounds']} rounds, rule {args.rule} f={args.f}, "
          f"resumed after round {doc['resumed_from']}, config {doc['config_hash']}")
    for h in doc["history"]:
        extra = f" rejected {sorted(h['rejected'])}" if h.get("rejected") else ""
        print(f"  round {h['round']}: {len(h['clients'])} clients, accuracy {h.get('accuracy', float('nan')):.4f}"
              f"{extra}")
    if acc is not None:
        print(f"final accuracy {acc:.4f}; checkpoints in {args.checkpoint_dir}")
    for rel in doc.get("releases", []):
        print(f"  released v{rel['version']} sha256 {rel['sha256'][:12]} published={rel['published']}")
    return 0
