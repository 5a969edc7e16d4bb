"""Seconds per round of a third-party Flower App with 10 SuperNodes, before and after issue 24, in one run.

The app is ``examples/wine``: numpy logistic regression on scikit-learn's wine
data, ``RobustStrategy(rule, f)`` in place of FedAvg, and a ClientApp with no
evaluate function. Each trial is what a user runs: ``fogline coordinator --app
examples/wine`` (TLS SuperLink, SuperNode authentication) and 10
``flower-supernode`` processes with their own keys, all on 127.0.0.1.

"before" is the tree of commit ``--before`` (default 4fe7f5d, the last one
before the issue-24 work, taken with ``git archive``), "after" this working
tree; both run the same app from this tree, with the same interpreter, flags,
keys and host, alternating trial by trial (after, before, after, ...) so that
other load on the machine falls on both. A round's time is the strategy's own
``round_s`` in ``report.json`` (train, the evaluate round if any, central
evaluation); the first round, which includes SuperNodes connecting, is left
out. A tree that cannot finish a trial (registration crash, timeout) is
recorded with its one-line reason instead of a figure.

Run: ``fogline bench wine [--quick] [--trials N] [--rounds R] [--nodes N] [--before REV]``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

from benchmarks._emit import ROOT, emit
from cloud_coordinator.supernodes import SUPERNODES_FILE, KeyBook, keygen
from runtime import children
from runtime.broker import free_port

__all__ = ["main", "run"]

APP = ROOT / "examples" / "wine"
BEFORE = "4fe7f5d"
VENV_BIN = Path(sys.executable).parent


def before_tree(rev: str, dest: Path) -> Path:
    """The repository at ``rev`` (``git archive``), unpacked under ``dest``."""
    out = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, timeout=120, check=False)
    if out.returncode != 0:
        raise SystemExit(f"error: git archive {rev} failed: {out.stderr.decode(errors='replace').strip()}")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=BytesIO(out.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def _env(tree: Path, work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(tree), "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
                "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1", "FOGLINE_CACHE_DIR": str(work / "cache")})
    return env


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][-240:] if lines else "(empty log)"


def _count(path: Path, needle: str) -> int:
    try:
        return path.read_text(errors="replace").count(needle)
    except OSError:
        return 0


def trial(tree: Path, work: Path, keys: dict[str, Path], rounds: int, timeout_s: float) -> dict[str, Any]:
    """One coordinator run of the wine app with len(keys) authenticated SuperNodes; its seconds per round."""
    ck = work / "ck"
    ck.mkdir(parents=True)
    book = KeyBook(ck / SUPERNODES_FILE)
    for dev, key in keys.items():
        book.add(dev, key.with_name("supernode.pub").read_bytes())
    book.save()
    env = _env(tree, work)
    port = free_port()
    log = work / "coordinator.log"
    n = len(keys)
    argv = [sys.executable, "-m", "runtime.cli", "-v", "coordinator", "--app", str(APP), "--checkpoint-dir", str(ck),
            "--superlink", f"127.0.0.1:{port}", "--rounds", str(rounds), "--min-clients", str(n),
            "--keep", str(rounds + 1), "--timeout", str(timeout_s)]
    t0 = time.monotonic()
    coord = children.spawn(argv, log=log, env=env, cwd=work)
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        ready = ck / "superlink.json"
        deadline = t0 + timeout_s
        while not ready.exists():
            if coord.poll() is not None:
                return {"ok": False, "reason": f"coordinator exited {coord.returncode} before its SuperLink was "
                                               f"ready: {_last_line(log)}"}
            if time.monotonic() > deadline:
                return {"ok": False, "reason": f"SuperLink not ready within {timeout_s:.0f} s: {_last_line(log)}"}
            time.sleep(0.2)
        ready_s = time.monotonic() - t0
        doc = json.loads(ready.read_text())
        for i, (dev, key) in enumerate(sorted(keys.items())):
            cmd = [str(VENV_BIN / "flower-supernode"), "--superlink", doc["address"], "--port", str(free_port()),
                   "--root-certificates", doc["root_certificates"], "--auth-supernode-private-key", str(key),
                   "--node-config", f"partition-id={i} num-partitions={n}"]
            nodes.append(children.spawn(cmd, log=work / f"{dev}.log", env={**env, "FLWR_HOME": str(work / dev)}))
        try:
            rc = coord.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return {"ok": False, "reason": f"no result within {timeout_s:.0f} s: {_last_line(log)}"}
        wall = time.monotonic() - t0
        if rc != 0:
            return {"ok": False, "reason": f"coordinator exited {rc}: {_last_line(log)}"}
        rep = json.loads((ck / "report.json").read_text())
        round_s = [float(x) for x in rep["round_s"]]
        steady = round_s[1:] or round_s
        last = rep["history"][-1] if rep.get("history") else {}
        return {"ok": True, "seconds_per_round": statistics.fmean(steady), "median_round_s": statistics.median(steady),
                "round_s": [round(x, 3) for x in round_s], "first_round_s": round(round_s[0], 3),
                # what the SuperNodes were sent: the 'before' tree also sends evaluate messages the app cannot answer
                "evaluate_messages": sum(_count(work / f"{dev}.log", "Receiving: evaluate message") for dev in keys),
                "train_messages": sum(_count(work / f"{dev}.log", "Receiving: train message") for dev in keys),
                "accuracy": last.get("accuracy"), "ready_s": round(ready_s, 1), "wall_s": round(wall, 1),
                "load_1min": round(os.getloadavg()[0], 2)}
    finally:
        children.stop(coord, 15.0, group=True)
        for p in nodes:  # all at once (one by one, each SuperNode's slow SIGTERM would add up); and their ClientApps
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in nodes:
            p.wait(10)


def run(*, trials: int, rounds: int, nodes: int, before: str, timeout_s: float, keep: bool = False
        ) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="fogline-wine-bench-"))
    try:
        trees = {"after": ROOT, "before": before_tree(before, base / "before-tree")}
        keys = {}
        for i in range(nodes):
            dev = f"wine-{i}"
            priv, _ = keygen(base / "keys" / dev)
            keys[dev] = priv
        out: dict[str, list[dict[str, Any]]] = {"after": [], "before": []}
        for t in range(trials):
            for variant in ("after", "before") if t % 2 == 0 else ("before", "after"):
                res = trial(trees[variant], base / f"{variant}-{t}", keys, rounds, timeout_s)
                res["order"] = len(out["after"]) + len(out["before"])
                out[variant].append(res)
                print(f"wine {variant} trial {t + 1}/{trials}: " + (
                    f"{res['seconds_per_round']:.2f} s/round (rounds {res['round_s']}, accuracy {res['accuracy']}, "
                    f"train/evaluate messages {res['train_messages']}/{res['evaluate_messages']}, "
                    f"load {res['load_1min']})" if res["ok"] else f"FAILED: {res['reason']}"),
                    file=sys.stderr, flush=True)
        summary: dict[str, Any] = {}
        for variant, rows in out.items():
            ok = [r["seconds_per_round"] for r in rows if r["ok"]]
            summary[variant] = {"seconds_per_round": round(statistics.median(ok), 3) if ok else None,
                                "trials_ok": len(ok), "trials": len(rows),
                                "failures": [r["reason"] for r in rows if not r["ok"]]}
        a, b = summary["after"]["seconds_per_round"], summary["before"]["seconds_per_round"]
        return {"benchmark": "wine", "app": str(APP.relative_to(ROOT)), "nodes": nodes, "rounds": rounds,
                "before": before, "host_cores": os.cpu_count(),
                "seconds_per_round": {"before": b, "after": a},
                "speedup_before_over_after": round(b / a, 2) if a and b else None,
                "summary": summary, "trials": out}
    finally:
        if keep:
            print(f"work directories kept in {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fogline bench wine", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one trial per tree, 4 rounds")
    ap.add_argument("--trials", type=int, default=2, help="trials per tree, alternating (default 2)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--before", default=BEFORE, help=f"the 'before' commit (default {BEFORE})")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per trial before it counts as failed")
    ap.add_argument("--keep", action="store_true", help="keep the work directories (logs)")
    args = ap.parse_args(argv)
    if args.trials < 1 or args.rounds < 2 or args.nodes < 1:
        ap.error("--trials >= 1, --rounds >= 2 and --nodes >= 1")
    trials, rounds = (1, 4) if args.quick else (args.trials, args.rounds)
    out = run(trials=trials, rounds=rounds, nodes=args.nodes, before=args.before, timeout_s=args.timeout,
              keep=args.keep)
    s = out["seconds_per_round"]
    print(f"wine, {args.nodes} SuperNodes: before {s['before']} s/round, after {s['after']} s/round "
          f"({out['speedup_before_over_after']}x)", file=sys.stderr)
    emit("wine", out)
    return 0 if s["after"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
