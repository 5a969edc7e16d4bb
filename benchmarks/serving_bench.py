"""Benchmark: many streams against one SLO, over HTTPS OIP, open loop (issue 32).

A real secure site (``simulations.local_site.LocalSite``: ``fogline broker --http 0``, mosquitto
with TLS, client certificates) with real agents (``simulations.agent_group``), each worker in
its own process: five simulated workers of ``--flops`` FLOP/s (a stage runs the real partition,
then sleeps up to its FLOPs / that rate) and a camera. The model is a 2-stage CNN (``zoo``'s
resnet at widths 48/96/192, ~220 MFLOP), deployed with ``replicas: 2``, the throughput objective
and two partitions per chain.

Requests arrive open loop (Poisson) over HTTPS with the app's client certificate, binary tensors,
``parameters.timeout`` = the SLO (1 s). One chain's capacity is measured first (closed loop, the
primary chain only). Phases, each at a rate relative to that capacity:

- ``1.5x`` and ``3x`` with 2 replicas: the router of this version (every replica serves,
  admission against the deadline) against the baseline in the same run (the same site restarted
  with ``--primary-only``: the router before, primary chain, no admission);
- ``kill``: 1.5x with a ``kill -9`` of the process of a device of replica 0 midway (this version):
  admitted requests that failed, against those in flight when it died.

Reported per phase: goodput (200 within the SLO, per second) and its share of the offered rate,
p99 latency of the answers, the shares answered 504 and 503, the p99 of a refusal's latency,
and which replicas answered. JSON on stdout and in out/bench/serving.json; a summary on stderr.

Run: ``python -m benchmarks.serving_bench [--quick]`` (or ``fogline bench serving``).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._emit import emit
from benchmarks.serving_load import Load, ms, pct, start_site, wait_until
from runtime import children

WIDTHS = (48, 96, 192)
WORKERS = 5  # 2 replicas x 2 stages, and one spare a killed stage is re-placed on


def figures(rows: list[dict[str, Any]], duration: float, slo_s: float, capacity: float, rate: float
            ) -> dict[str, Any]:
    n = len(rows)
    ok = [r for r in rows if r["status"] == 200]
    good = [r for r in ok if r["latency"] <= slo_s]
    st = Counter(r["status"] for r in rows)
    refused = [r["latency"] for r in rows if r["status"] == 503]
    errors = Counter(str(r.get("error", ""))[:90] for r in rows if r["status"] not in (200, 503))
    return {
        "offered_rps": round(n / duration, 2), "target_rps": round(rate, 2), "requests": n,
        "goodput_rps": round(len(good) / duration, 2),
        "goodput_over_offered": round(len(good) / n, 3) if n else None,
        "goodput_over_two_chains": round(len(good) / duration / (2 * capacity), 3),
        "answered_200": len(ok), "p50_ms": ms(pct([r["latency"] for r in ok], 0.5)),
        "p99_ms": ms(pct([r["latency"] for r in ok], 0.99)),
        "share_504": round(st.get(504, 0) / n, 4) if n else None,
        "share_503": round(st.get(503, 0) / n, 4) if n else None,
        "share_other_errors": round(sum(v for k, v in st.items() if k not in (200, 503, 504)) / n, 4) if n else None,
        "refusal_p50_ms": ms(pct(refused, 0.5)), "refusal_p99_ms": ms(pct(refused, 0.99)),
        "retry_after_values": sorted({str(r.get("retry_after")) for r in rows if r["status"] == 503}),
        "statuses": {str(k): v for k, v in sorted(st.items())},
        "by_replica": {str(k): v for k, v in sorted(Counter(r.get("replica") for r in ok).items())},
        "errors_top": dict(errors.most_common(3)),
    }


def _fleet(site: Any, tmp: Path, flops: float) -> tuple[list[subprocess.Popen[bytes]], dict[str, Any]]:
    tmp.mkdir(parents=True, exist_ok=True)
    groups = [site.spawn_agents([{"id": "cam", "memory": 1000, "flops": 1e8,
                                  "labels": {"role": "source", "power-domain": "pc"}}],
                                tmp / "agents", tmp / "cam.log", host="127.0.0.1")]
    procs = {}
    for i in range(WORKERS):
        w = {"id": f"w{i}", "memory": 200_000_000, "flops": flops, "link_bps": 1e9, "model_compute": True,
             "labels": {"role": "worker", "power-domain": f"pd{i}"}}
        procs[f"w{i}"] = site.spawn_agents([w], tmp / "agents", tmp / f"w{i}.log", host="127.0.0.1")
    groups.extend(procs.values())
    return groups, procs


def _deploy(c: Any, model: Path, slo_s: float) -> dict[str, Any]:
    want = {"cam", *(f"w{i}" for i in range(WORKERS))}
    wait_until(lambda: {d["id"] for d in c.status()["devices"] if d["alive"]} >= want, 180, "agents alive")
    c.deploy({"name": "cnn", "model": str(model), "source": "cam", "sink": "cam", "replicas": 2,
              "objective": "throughput", "min_partitions": 2, "max_partitions": 2,
              "selectors": {"role": "worker"}, "slo_s": slo_s}, timeout=120)
    c.wait_running("cnn", 180)
    return next(w for w in c.status(limit=0)["workloads"] if w["name"] == "cnn")


def _capacity(c: Any, x: np.ndarray, frames: int) -> float:
    """One chain's frames/s, closed loop with 8 in flight (on the primary-only site: chain 0 alone)."""
    c.infer_many("cnn", [{"x": x}] * 4, window=2, timeout=30)
    t0 = time.perf_counter()
    c.infer_many("cnn", [{"x": x}] * frames, window=8, timeout=30)
    return frames / (time.perf_counter() - t0)


def _phases(load: Load, rates: dict[str, float], duration: float, slo_s: float, capacity: float
            ) -> dict[str, Any]:
    out = {}
    for i, (name, rate) in enumerate(rates.items()):
        rows = load.run(rate, duration, seed=i)
        out[name] = figures(rows, duration, slo_s, capacity, rate)
        out[name]["loadavg"] = round(os.getloadavg()[0], 2)
        time.sleep(1.5)  # what is left in flight ends (its deadline) before the next phase
    return out


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import onnx

    from models import zoo

    model = tmp / "cnn.onnx"
    onnx.save(zoo.build("resnet", widths=WIDTHS), str(model))
    x = np.random.default_rng(0).random((1, 3, 32, 32), dtype=np.float32)
    slo = args.slo
    res: dict[str, Any] = {"model": f"zoo resnet widths {list(WIDTHS)}", "device_flops": args.flops,
                           "slo_s": slo, "phase_s": args.duration, "workers": WORKERS}
    groups: list[subprocess.Popen[bytes]] = []
    capacity = 0.0
    for label, baseline in (("baseline_primary_only", True), ("spread_admission", False)):
        site = start_site(tmp, "base" if baseline else "serve", baseline)
        try:
            groups, procs = _fleet(site, tmp / label, args.flops)
            c = site.client()
            w = _deploy(c, model, slo)
            if baseline:
                capacity = _capacity(c, x, args.capacity_frames)
                res["one_chain_capacity_fps"] = round(capacity, 2)
                res["predicted_chain_fps"] = (w.get("throughput") or {}).get("predicted_fps")
            creds = site.issue("bench-app", "app")  # the app's client certificate
            load = Load(site.ready["http"], "cnn", x, str(creds / "ca.pem"),
                        (str(creds / "cert.pem"), str(creds / "key.pem")), slo)
            load.run(2.0, 2.0, seed=99)  # warm: connections, sessions, stage times in the fog
            rates = {"1.5x": 1.5 * capacity, "3x": 3.0 * capacity}
            res[label] = _phases(load, rates, args.duration, slo, capacity)
            if not baseline:
                res["kill9"] = _kill(c, load, procs, capacity, args, slo)
            c.close()
        finally:
            children.stop_all(groups, 10.0)
            site.kill()
    base, new = res["baseline_primary_only"], res["spread_admission"]
    res["ratios"] = {k: {"goodput_vs_baseline": round(new[k]["goodput_rps"] / max(base[k]["goodput_rps"], 1e-9), 2)}
                     for k in new}
    g15, g3 = new["1.5x"], new["3x"]
    res["targets"] = {
        "1.5x_goodput_ge_0.9_offered": (g15["goodput_over_offered"] or 0) >= 0.9,
        "1.5x_p99_within_slo": (g15["p99_ms"] or 1e9) <= slo * 1000,
        "3x_goodput_ge_0.85_two_chains": g3["goodput_over_two_chains"] >= 0.85,
        "3x_504_le_1pct": (g3["share_504"] or 0) <= 0.01,
        "3x_refusals_p99_le_50ms": (g3["refusal_p99_ms"] or 0) <= 50,
    }
    if not args.no_autoscale:  # issue 33: a step in load on an autoscaled workload (its own site)
        from benchmarks import serving_autoscale  # loads matplotlib: only when asked for

        res["autoscale"] = serving_autoscale.run(args, tmp, model, x, capacity)
        res["targets"].update({f"autoscale_{k}": v for k, v in res["autoscale"]["targets"].items()})
    return res


def _kill(c: Any, load: Load, procs: dict[str, Any], capacity: float, args: argparse.Namespace, slo: float
          ) -> dict[str, Any]:
    w = next(w for w in c.status(limit=0)["workloads"] if w["name"] == "cnn")
    rep0 = next(r for r in w["placement"] if r["replica"] == 0)
    victim = rep0["partitions"][-1]["device"]
    killed: list[float] = []

    def kill() -> None:
        killed.append(time.monotonic())
        os.killpg(procs[victim].pid, signal.SIGKILL)

    rate = 1.5 * capacity
    rows = load.run(rate, args.duration, seed=7, at={args.duration / 2: kill})
    figs = figures(rows, args.duration, slo, capacity, rate)
    k = killed[0] if killed else 0.0
    in_flight = [r for r in rows if r["sent"] <= k < r["sent"] + r["latency"]]
    failed = [r for r in rows if r["status"] not in (200, 503)]
    figs.update({
        "killed": f"{victim} (replica 0, last stage): kill -9 of its process, {args.duration / 2:g} s in",
        "admitted_then_failed": len(failed),
        "in_flight_at_kill": len(in_flight),
        "failed_beyond_in_flight": len([r for r in failed if r not in in_flight]),
    })
    try:
        wait_until(lambda: next((x["healthy_replicas"] >= 2 for x in c.status(limit=0)["workloads"]
                            if x["name"] == "cnn"), False), 60, "2 replicas again")
        figs["two_replicas_again_after_s"] = round(time.monotonic() - k, 1)
    except TimeoutError:
        figs["two_replicas_again_after_s"] = None
    return figs


def main(argv: Sequence[str] | None = None) -> int:
    from runtime.cliargs import positive_float, positive_int

    ap = argparse.ArgumentParser(prog="serving_bench")
    ap.add_argument("--quick", action="store_true", help="short phases (~4 min in all)")
    ap.add_argument("--duration", type=positive_float, default=40.0, help="seconds per phase")
    ap.add_argument("--flops", type=positive_float, default=1e9, help="each worker's FLOP/s (simulated)")
    ap.add_argument("--slo", type=positive_float, default=1.0, help="each request's deadline (s)")
    ap.add_argument("--no-autoscale", action="store_true",
                    help="skip the autoscaling phase (a step from 0.5x to 2.5x one chain's capacity and back)")
    ap.add_argument("--capacity-frames", type=positive_int, default=80,
                    help="frames of the closed-loop measure of one chain's capacity")
    args = ap.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.ERROR)
    if args.quick:
        args.duration, args.capacity_frames = min(args.duration, 15.0), min(args.capacity_frames, 40)
    out: dict[str, Any] = {"benchmark": "serving", "quick": args.quick, "cpu_count": os.cpu_count(),
                           "loadavg_at_start": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="serving-bench-") as d:
        out.update(run(args, Path(d)))
    out["loadavg_at_end"] = round(os.getloadavg()[0], 2)
    emit("serving", out)
    _summary(out)
    return 0


def _summary(out: dict[str, Any]) -> None:
    p = sys.stderr
    print(f"one chain: {out['one_chain_capacity_fps']} frames/s measured (SLO {out['slo_s']} s, "
          f"load average {out['loadavg_at_start']} -> {out['loadavg_at_end']})", file=p)
    for phase in ("1.5x", "3x"):
        for label in ("baseline_primary_only", "spread_admission"):
            f = out[label][phase]
            print(f"{phase:>4} {label:<22} offered {f['offered_rps']:6.2f}/s goodput {f['goodput_rps']:6.2f}/s "
                  f"({f['goodput_over_offered']}) p99 {f['p99_ms']} ms 504 {f['share_504']} 503 {f['share_503']} "
                  f"refusal p50/p99 {f['refusal_p50_ms']}/{f['refusal_p99_ms']} ms replicas {f['by_replica']}", file=p)
    k = out["kill9"]
    print(f"kill -9 at 1.5x: goodput {k['goodput_over_offered']} of offered, {k['admitted_then_failed']} admitted "
          f"then failed ({k['in_flight_at_kill']} in flight at the kill), 2 replicas again "
          f"{k['two_replicas_again_after_s']} s after it", file=p)
    a = out.get("autoscale")
    if a:
        print(f"autoscale 0.5x -> 2.5x -> 0.5x: second chain after {a['second_chain_running_after_s']} s, third "
              f"after {a['third_chain_running_after_s']} s, goodput {a['goodput_over_offered_last_20s_of_step']} of "
              f"offered in the step's last 20 s, one chain again {a['one_chain_again_after_step_down_s']} s after "
              f"the step down, {a['answers_not_200_or_503']} answers neither 200 nor 503; plot {a['plot']}", file=p)
    print("targets: " + ", ".join(f"{k}={v}" for k, v in out["targets"].items()), file=p)


if __name__ == "__main__":
    raise SystemExit(main())
