"""Scale benchmark: a 1,000-agent MQTT fleet on this machine, and 10,000 devices on the discrete-event engine.

Run: ``python -m benchmarks.scale_bench [--quick]``. Prints JSON on stdout, writes
``out/bench/scale.json``, a human summary (and progress lines) on stderr. Baselines come from the same run:

* mqtt: a real fog broker (``fogline broker``, mosquitto) and simulated agents as real MQTT clients
  (``python -m edge_agent --simulate pi4 --count N``) in several processes. We time the ramp until
  every device is alive (and the fog's verified-advert rate during it and in steady state, against
  the rate the fleet offers), the deployment of 20 workloads until all replicas run, then ``kill -9``
  of one agent process (10 % of the devices; quick: 25 %) until every hit workload runs all its
  replicas again. Baseline: the same kill-to-running for a single-device process (one partition).
* des: ``city-10k`` (10,000 devices, 100 workloads x 2 replicas, churn) over simulated time, with 10 %
  of the devices crashed at once half way: simulated hours per wall second, events/s, placement
  and repair solve times, recovery; baseline: the same scenario on 1,000 devices (scaling ratio).
* registry: the fleet snapshot at 10,000 devices, rebuilt from scratch (the former behaviour)
  vs incremental after one state advert.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._emit import report, run_header

ROOT = Path(__file__).resolve().parents[1]


def _log(msg: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(xs: Sequence[float], q: float) -> float | None:
    s = sorted(xs)
    if not s:
        return None
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(pred: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return False


# ---------------------------------------------------------------- real MQTT fleet


class _Fleet:
    """The fog broker and agent processes; everything is killed in ``close``."""

    def __init__(self, tmp: Path, site: str, interval: float) -> None:
        self.tmp, self.site, self.interval = tmp, site, interval
        self.port = _free_port()
        self.env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ids: dict[str, list[str]] = {}
        self.fog: Any = None

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        self.procs[name] = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def start_fog(self) -> None:
        """``fogline broker`` as the README starts it: TLS, client certificates, ACL (secure by default)."""
        from simulations.local_site import LocalSite
        self.fog = LocalSite(self.tmp / "fog", site=self.site, port=self.port, env=self.env,
                             log=self.tmp / "fog.log", args=["--state-interval", f"{self.interval:g}"]).start(120)

    def start_agents(self, name: str, count: int, labels: str, profile: str = "pi4") -> None:
        width = len(str(count - 1))
        self.ids[name] = [f"{name}-{i:0{width}d}" for i in range(count)] if count > 1 else [f"{name}-0"]
        self._spawn(name, ["-m", "edge_agent", "--simulate", profile, "--count", str(count), "--id-prefix",
                           f"{name}-", "--data-dir", str(self.tmp / "agents" / name), "--broker",
                           f"127.0.0.1:{self.port}", "--site", self.site, "--state-interval",
                           f"{self.interval:g}", "--probe-interval", "5", "--labels", labels,
                           "--token", self.fog.token(uses=count)])  # each enrols over HTTPS once

    def kill9(self, name: str) -> None:
        p = self.procs[name]
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)

    def close(self) -> None:
        if self.fog is not None:
            self.fog.stop()
        for name, p in reversed(list(self.procs.items())):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM if name == "fog" else signal.SIGKILL)
                except ProcessLookupError:
                    continue
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


def _alive(st: dict[str, Any]) -> set[str]:
    return {d["id"] for d in st["devices"] if d["alive"]}


def _hosts(st: dict[str, Any]) -> dict[str, set[str]]:
    """workload -> devices of its current placement."""
    return {w["name"]: {p["device"] for r in w["placement"] for p in r["partitions"]} for w in st["workloads"]}


def _all_running(st: dict[str, Any], names: set[str], avoid: set[str]) -> bool:
    by = {w["name"]: w for w in st["workloads"]}
    for n in names:
        w = by.get(n)
        if w is None or w["healthy_replicas"] < w["replicas"]:
            return False
        if any(p["device"] in avoid for r in w["placement"] for p in r["partitions"]):
            return False
    return True


def bench_mqtt(procs: int, per: int, n_workloads: int, tmp: Path, interval: float = 10.0) -> dict[str, Any]:
    from fog_broker.client import FogClient

    site = "scale"
    fl = _Fleet(tmp, site, interval)
    total = procs * per
    res: dict[str, Any] = {"agents": total, "processes": procs, "agents_per_process": per,
                           "state_interval_s": interval, "workloads": n_workloads}
    c: FogClient | None = None
    try:
        fl.start_fog()
        t0 = time.monotonic()
        while True:
            try:
                c = FogClient("127.0.0.1", fl.port, credentials=fl.fog.credentials(), connect_timeout=2.0)
                c.status(timeout=2.0)
                break
            except Exception as exc:  # the broker is still starting: retry; at last, the cause
                if c is not None:
                    c.close()
                    c = None
                if time.monotonic() - t0 > 60:
                    raise RuntimeError("fog broker did not start: "
                                       + (tmp / "fog.log").read_text()[-2000:]) from exc
                time.sleep(0.3)
        res["fog_start_s"] = _r(time.monotonic() - t0)
        _log(f"mqtt: fog broker up on port {fl.port}; starting {total} agents in {procs} processes")

        # --- ramp: every agent process at once, plus the sources and the two single-device baselines
        marks: list[tuple[float, int, int]] = []  # (t, verified adverts, alive devices)
        t_ramp = time.monotonic()
        fl.start_agents("cam", 2, "role=source", profile="camera")
        for k in range(procs):
            fl.start_agents(f"w{k}", per, "role=worker")
        fl.start_agents("solo-a", 1, "role=solo")
        fl.start_agents("solo-b", 1, "role=solo")
        want = {i for ids in fl.ids.values() for i in ids}
        born_at = None
        last_print = 0.0
        while time.monotonic() - t_ramp < 300:
            st = c.status(timeout=10.0, limit=5000)
            now = time.monotonic()
            n_alive = len(_alive(st) & want)
            marks.append((now, int(st["counters"].get("verifier.accepted", 0)), n_alive))
            if now - last_print > 10:
                _log(f"mqtt: ramp {now - t_ramp:.0f} s: {n_alive}/{len(want)} alive")
                last_print = now
            if n_alive == len(want):
                born_at = now
                break
            time.sleep(0.25)
        if born_at is None:
            raise RuntimeError(f"only {marks[-1][2]}/{len(want)} agents alive after 300 s")
        res["all_alive_s"] = _r(born_at - t_ramp)
        first = next((m for m in marks if m[1] > 0), marks[0])
        res["ramp_verified_adverts"] = marks[-1][1]
        res["ramp_ingest_per_s"] = _r(marks[-1][1] / max(born_at - first[0], 1e-9), 1)
        # --- steady state: every agent sends a state per interval
        steady = max(2 * interval, 15.0)
        _log(f"mqtt: all {len(want)} alive after {res['all_alive_s']} s; steady state for {steady:g} s")
        a0 = int(c.status()["counters"].get("verifier.accepted", 0))
        s0 = time.monotonic()
        time.sleep(steady)
        st = c.status(limit=5000)
        a1 = int(st["counters"].get("verifier.accepted", 0))
        offered = len(want) / interval
        res["steady_ingest_per_s"] = _r((a1 - a0) / (time.monotonic() - s0), 1)
        res["steady_offered_per_s"] = _r(offered, 1)
        res["steady_ingest_over_offered"] = _r((a1 - a0) / (time.monotonic() - s0) / offered, 3)
        res["rejections"] = {k: v for k, v in st["counters"].items() if k.startswith("verifier.") and
                             k != "verifier.accepted" and v}

        # --- deployment of n workloads at once
        specs: list[dict[str, Any]] = [
            {"name": f"mlp{k:02d}", "model": "zoo:mlp", "replicas": 2, "source": "cam-0", "sink": "cam-1",
             "selectors": {"role": "worker"}} for k in range(n_workloads)]
        names = {s["name"] for s in specs}
        t_dep = time.monotonic()
        c.deploy({"workloads": specs}, timeout=120.0)
        t_acc = time.monotonic()
        if not _wait(lambda: _all_running(c.status(), names, set()), 180, 0.1):
            raise RuntimeError("workloads not running after 180 s")
        t_run = time.monotonic()
        st = c.status(limit=5000)
        res["deploy_accepted_s"] = _r(t_acc - t_dep)
        res["deploy_to_all_running_s"] = _r(t_run - t_dep)
        res["partitions_placed"] = sum(len(r["partitions"]) for w in st["workloads"] if w["name"] in names
                                       for r in w["placement"])
        _log(f"mqtt: {n_workloads} workloads ({res['partitions_placed']} partitions) running after "
             f"{res['deploy_to_all_running_s']} s")

        # --- baseline: kill -9 of a single-device process hosting one partition
        c.deploy({"workloads": [{"name": "solo", "model": "zoo:mlp", "source": "cam-0", "sink": "cam-1",
                                 "selectors": {"role": "solo"}, "max_partitions": 1}]}, timeout=60.0)
        if not _wait(lambda: _all_running(c.status(), {"solo"}, set()), 60, 0.1):
            raise RuntimeError("solo workload not running")
        host = next(iter(_hosts(c.status())["solo"]))
        res["single_kill"] = _kill_and_time(c, fl, host.rsplit("-", 1)[0], {"solo"}, [host])

        # --- kill -9 of the worker process hosting the most partitions
        hosts = _hosts(c.status())
        count = {f"w{k}": 0 for k in range(procs)}
        for devs in hosts.values():
            for d in devs:
                p = d.rsplit("-", 1)[0]
                if p in count:
                    count[p] += 1
        victim = max(count, key=lambda p: (count[p], p))
        hit = {w for w, devs in hosts.items() if any(d.rsplit("-", 1)[0] == victim for d in devs)}
        _log(f"mqtt: kill -9 {victim} ({per} devices, {count[victim]} partitions, {len(hit)} workloads)")
        res["process_kill"] = _kill_and_time(c, fl, victim, hit, fl.ids[victim])
        res["process_kill"]["partitions_hit"] = count[victim]
        res["process_kill"]["share_of_devices"] = _r(per / len(want), 3)
        pk, sk = res["process_kill"], res["single_kill"]
        if pk.get("kill_to_all_running_s") and sk.get("kill_to_all_running_s"):
            res["kill_to_running_ratio_vs_single"] = _r(pk["kill_to_all_running_s"] / sk["kill_to_all_running_s"], 2)
        return res
    finally:
        if c is not None:
            c.close()
        fl.close()


def _kill_and_time(c: Any, fl: _Fleet, proc: str, workloads: set[str], devices: list[str]) -> dict[str, Any]:
    """kill -9 ``proc``; time until the fog marks its devices dead and every hit workload runs elsewhere."""
    gone = set(devices)
    n_rec = len(c.status()["recoveries_s"])
    t_kill = time.monotonic()
    fl.kill9(proc)
    t_detect = t_run = None
    while time.monotonic() - t_kill < 120:
        st = c.status(timeout=10.0)
        now = time.monotonic()
        if t_detect is None and not (_alive(st) & gone):
            t_detect = now
        if t_detect is not None and _all_running(st, workloads, gone):
            t_run = now
            break
        time.sleep(0.05)
    rec = c.status()["recoveries_s"][n_rec:] if t_run is not None else []
    return {"devices": len(gone), "workloads_hit": len(workloads),
            "kill_to_detection_s": _r(None if t_detect is None else t_detect - t_kill),
            "kill_to_all_running_s": _r(None if t_run is None else t_run - t_kill),
            "detection_to_running_p50_s": _r(pct(rec, 0.5)), "detection_to_running_p99_s": _r(pct(rec, 0.99)),
            "repairs": len(rec)}


# ---------------------------------------------------------------- discrete event


def bench_des(devices: int, duration_s: float, fraction: float = 0.1) -> dict[str, Any]:
    from simulations.des import run_scenario, scaled
    from simulations.scenario import load_scenario

    sc = scaled(load_scenario("city-10k"), devices)
    r = run_scenario(sc, clock=time.perf_counter, duration_s=duration_s, mass_failure_at_s=duration_s / 2,
                     mass_failure_fraction=fraction)
    s = r.summary()
    solves = r.schedule_wall_s
    repairs = solves[1:]
    avail = list(r.availability.values())
    return {
        "devices": devices, "workloads": len(sc.workloads), "sim_hours": s["sim_hours"], "wall_s": s["wall_s"],
        "sim_hours_per_wall_s": s["sim_hours_per_wall_s"], "events": r.events,
        "events_per_wall_s": round(r.events / r.wall_s, 1), "adverts": r.adverts,
        "adverts_per_wall_s": round(r.adverts / r.wall_s), "crashes": r.crashes,
        "initial_placement_ms": _r(solves[0] * 1e3 if solves else None, 1),
        "solve_p50_ms": _r((pct(solves, 0.5) or 0) * 1e3, 1), "solve_p99_ms": _r((pct(solves, 0.99) or 0) * 1e3, 1),
        "repair_solves": len(repairs),
        "repair_solve_p50_ms": _r(None if not repairs else pct(repairs, 0.5) * 1e3, 1),  # type: ignore[operator]
        "repair_solve_p99_ms": _r(None if not repairs else pct(repairs, 0.99) * 1e3, 1),  # type: ignore[operator]
        "recovery_p50_sim_s": _r(pct(r.recoveries_s, 0.5)), "recovery_p99_sim_s": _r(pct(r.recoveries_s, 0.99)),
        "recoveries": len(r.recoveries_s), "mass_failure": r.mass_failure,
        "availability_mean": _r(sum(avail) / len(avail), 5) if avail else None,
        "availability_min": _r(min(avail), 5) if avail else None,
        "counters": r.counters,
    }


def bench_registry(devices: int, reps: int = 5) -> dict[str, Any]:
    """Fleet snapshot: full rebuild (what every call cost before the cache) vs one advert then a call."""
    import random

    from fog_broker.registry import Registry
    from simulations.des import make_fleet

    reg = Registry()
    fleet = make_fleet(devices, random.Random(1))
    for d in fleet:
        reg.handle(d.birth(), 0.0)
        reg.handle(d.state_advert(0.0), 0.1)
    full, inc, rep_full, rep_inc = [], [], [], []
    for k in range(reps):
        reg.invalidate()
        full.append(_timed(reg.fleet))
        rep_full.append(_timed(reg.reported))
        d = fleet[k % len(fleet)]
        d.state = None
        reg.handle(d.state_advert(float(1000 * (k + 1))), 1.0 + k)
        inc.append(_timed(reg.fleet))
        rep_inc.append(_timed(reg.reported))
    f, i = pct(full, 0.5) or 0.0, pct(inc, 0.5) or 1e-9
    return {"devices": devices, "fleet_full_rebuild_ms": round(f * 1e3, 2), "fleet_incremental_ms": round(i * 1e3, 3),
            "fleet_speedup": round(f / i, 1), "reported_full_ms": round((pct(rep_full, 0.5) or 0) * 1e3, 2),
            "reported_incremental_ms": round((pct(rep_inc, 0.5) or 0) * 1e3, 3)}


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scale_bench", description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="200 agents, 2,000 simulated devices (~2 min)")
    ap.add_argument("--skip", choices=("mqtt", "des", "registry"), action="append", default=[])
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    q = args.quick
    out = run_header("scale", q)
    t0 = time.monotonic()
    if "registry" not in args.skip:
        _log("registry: fleet snapshot, full vs incremental")
        out["registry"] = bench_registry(2000 if q else 10_000)
    if "des" not in args.skip:
        n, dur = (2000, 900.0) if q else (10_000, 3600.0)
        _log(f"des: city-10k scaled to 1,000 devices, {dur / 60:g} simulated minutes (baseline)")
        base = bench_des(1000, dur)
        _log(f"des: {n} devices, {dur / 60:g} simulated minutes")
        big = bench_des(n, dur)
        out["des"] = {"baseline_1000": base, "fleet": big, "device_ratio": n / 1000,
                      "wall_ratio": round(big["wall_s"] / base["wall_s"], 2),
                      "initial_placement_ratio": _r(big["initial_placement_ms"] / base["initial_placement_ms"], 2)
                      if big["initial_placement_ms"] and base["initial_placement_ms"] else None}
    if "mqtt" not in args.skip:
        procs, per = (4, 50) if q else (10, 100)
        with tempfile.TemporaryDirectory(prefix="scale-bench-") as d:
            out["mqtt"] = bench_mqtt(procs, per, 10 if q else 20, Path(d))
    out["bench_wall_s"] = round(time.monotonic() - t0, 1)
    return report("scale", out, _human)


def _human(out: dict[str, Any]) -> str:
    lines = []
    rg = out.get("registry")
    if rg:
        lines.append(f"registry at {rg['devices']} devices: fleet() full rebuild {rg['fleet_full_rebuild_ms']} ms, "
                     f"incremental {rg['fleet_incremental_ms']} ms (x{rg['fleet_speedup']}); reported() "
                     f"{rg['reported_full_ms']} -> {rg['reported_incremental_ms']} ms")
    de = out.get("des")
    if de:
        for key in ("baseline_1000", "fleet"):
            b = de[key]
            m = b["mass_failure"]
            lines.append(f"des {b['devices']} devices: {b['sim_hours_per_wall_s']} sim h / wall s, "
                         f"{b['events_per_wall_s']} events/s, {b['adverts_per_wall_s']} adverts/s; initial placement "
                         f"{b['initial_placement_ms']} ms, repair solve p50 {b['repair_solve_p50_ms']} ms p99 "
                         f"{b['repair_solve_p99_ms']} ms; recovery p50 {b['recovery_p50_sim_s']} s p99 "
                         f"{b['recovery_p99_sim_s']} s; {m.get('devices_crashed')} devices down at once -> "
                         f"{m.get('partitions_hit')} partitions re-placed, all running after "
                         f"{m.get('recovered_after_s')} sim s")
        lines.append(f"des scaling: x{de['device_ratio']:g} devices -> x{de['wall_ratio']} wall time")
    mq = out.get("mqtt")
    if mq:
        lines.append(f"mqtt {mq['agents']} agents: all alive after {mq['all_alive_s']} s (ramp ingest "
                     f"{mq['ramp_ingest_per_s']} verified adverts/s), steady {mq['steady_ingest_per_s']}/s of "
                     f"{mq['steady_offered_per_s']}/s offered; {mq['workloads']} workloads running "
                     f"{mq['deploy_to_all_running_s']} s after deploy")
        for key in ("single_kill", "process_kill"):
            k = mq.get(key) or {}
            lines.append(f"  kill -9 {key} ({k.get('devices')} devices, {k.get('workloads_hit')} workloads): "
                         f"detected {k.get('kill_to_detection_s')} s, all running {k.get('kill_to_all_running_s')} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
