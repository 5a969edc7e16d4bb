"""``fogline demo``: the whole system end to end on one machine, with faults, at two sites.

Real processes throughout: two sites, ``store-1`` (the canary) and ``store-2``,
each a fog broker of its own (its own CA, data dir, port and mosquitto) with
simulated edge agents that find their site's fog with zeroconf (by site name);
Flower SuperNodes on devices of both sites; and one coordinator (SuperLink +
ServerApp) connected to both sites with the coordinator credentials each fog
issued (``fogline operators add cloud --role coordinator``), which rolls every
model release out staged: the canary first, checked there, then ``store-2``.
The demo only drives them from outside (MQTT clients, CLI processes, kill -9),
the way an operator would, and checks what they answer.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from runtime.broker import free_port

from .demo_procs import ChildDied, Processes, _on_sigterm, _reap, _restore_sigterm, _wait
from .demo_report import STEPS, Reporter, _failure_reason, _progress, failure_line, write_report
from .local_site import LocalSite

__all__ = ["SITES", "STEPS", "Budgets", "DemoConfig", "run_demo", "site_sizes", "failure_line", "write_report"]

PROFILE_MIX = ("pi4", "pi5", "orin-nano", "pi4", "x86-gateway", "pi5", "jetson-nano", "pi4", "camera", "pi5",
               "orin-nano", "pi4")
SITES = ("store-1", "store-2")  # the first one is the canary of every release rollout
CANARY = SITES[0]
RELEASE = "digits-cnn"
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class DemoConfig:
    out: Path
    agents: int = 14        # both sites together (site_sizes: 8 at the canary, 6 at store-2)
    requests: int = 200     # per site
    rounds: int = 5
    fl_nodes: int = 5       # SuperNodes, on devices of both sites (3 + 2)
    byzantine: int = 1  # 20 % of 5
    rule: str = "centered_clipping"
    rate: float = 40.0  # requests per second, per site
    seed: int = 7


ROUND_TIMEOUT_S = 90.0    # the coordinator's --round-timeout: a round waits this long for its quorum
ROLLOUT_WAIT_S = 120.0    # the coordinator's --rollout-wait: after the last round, for the staged rollout


@dataclass(frozen=True, slots=True)
class Budgets:
    """Upper bounds of the demo's waits, derived from the work each one waits for (agents to enrol,
    rounds to train, a rollout to finish). They only catch a hang: a child that dies ends a wait at
    once with its reason, so bounds generous enough for a machine under heavy load cost nothing."""

    fog_start_s: float     # the fog brokers (each with its mosquitto, CA and keys) up, started together
    join_s: float          # every agent enrolled and alive (enrolments are serialised at each fog)
    running_s: float       # a deployed workload running on all its replicas
    superlink_s: float     # the coordinator's SuperLink up with every SuperNode key registered
    round_s: float         # one round, before any was measured: the coordinator's own round timeout
    restart_s: float       # a coordinator restarted after kill -9 back to training
    release_s: float       # a release listed / served at a site once the coordinator has it

    @classmethod
    def of(cls, cfg: DemoConfig) -> Budgets:
        return cls(fog_start_s=60.0 * len(SITES), join_s=30.0 + 5.0 * cfg.agents, running_s=60.0 + 2.0 * cfg.agents,
                   superlink_s=30.0 + 12.0 * cfg.fl_nodes, round_s=ROUND_TIMEOUT_S + 15.0,
                   restart_s=30.0 + 12.0 * cfg.fl_nodes, release_s=ROLLOUT_WAIT_S + 30.0)

    def rounds(self, n: int, measured_round_s: float | None = None) -> float:
        """``n`` rounds: the coordinator's round timeout each, or 3x a round as measured in this run
        when that is longer (a machine that slow keeps being that slow)."""
        per = max(self.round_s, 3.0 * measured_round_s) if measured_round_s else self.round_s
        return n * per

    def finish(self, rounds_left: int, measured_round_s: float | None = None) -> float:
        """A restarted coordinator: start, the rounds left (one more if the killed one is repeated),
        then its wait for the staged rollout."""
        return self.restart_s + self.rounds(rounds_left + 1, measured_round_s) + ROLLOUT_WAIT_S

    def total(self, cfg: DemoConfig) -> float:
        """The whole demo at most (each wait at its bound, plus the requests at ``cfg.rate``): what a
        caller that runs the demo (a test) may wait before calling it hung."""
        kill_after = min(2, cfg.rounds - 1)
        serve = 2 * cfg.requests / cfg.rate + 60.0
        return (self.fog_start_s + self.join_s + 2 * self.running_s + serve + self.running_s + self.superlink_s
                + 60.0 + self.rounds(kill_after) + self.finish(cfg.rounds - kill_after)
                + 3 * self.release_s + self.running_s)


def site_sizes(agents: int) -> tuple[int, int]:
    """Agents per site. The canary, where a device is killed mid-stream, keeps at least 8: its 3 x 2
    replica chains on distinct power domains need 6 devices and a lost partition somewhere to go."""
    if agents < 11:
        raise ValueError(f"the two-site demo needs at least 11 agents (8 at {CANARY}, 3 at {SITES[1]}), "
                         f"not {agents}")
    first = max(8, agents - agents * 3 // 7)
    return first, agents - first


def _python() -> list[str]:
    return [sys.executable, "-m"]


def _reference_output(x: np.ndarray) -> tuple[dict[str, np.ndarray], Any]:
    import onnxruntime as ort

    from models.zoo import build

    model = build("resnet")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    outs = sess.run(None, {name: x})
    return {o.name: v for o, v in zip(sess.get_outputs(), outs)}, name


@dataclass(slots=True)
class DemoSite:
    """One site of the demo: its fog broker, its devices and the operator's client there."""

    name: str
    fog: LocalSite
    devices: list[str]
    labels: dict[str, dict[str, str]]
    client: Any = None

    @property
    def role(self) -> str:
        return "canary" if self.name == CANARY else f"#{SITES.index(self.name)}"

    @property
    def source(self) -> str:
        return self.devices[0]

    @property
    def sink(self) -> str:
        return self.devices[1]


class RolloutWatch:
    """What each site's fog says about the release, polled from outside with a ``monitor`` identity
    (status only): when each site first lists each version, and when its ``release:`` workload first
    serves that version's bytes on every replica (the switch), on the demo's clock."""

    def __init__(self, clients: dict[str, Any], t0: float, name: str, interval: float = 0.5) -> None:
        self.clients = clients
        self.t0 = t0
        self.name = name
        self.interval = interval
        self.accepted: dict[str, dict[int, float]] = {s: {} for s in clients}
        self.serving: dict[str, dict[int, float]] = {s: {} for s in clients}
        self.refs: dict[int, str] = {}
        self.events: list[dict[str, Any]] = []
        self.last: dict[str, dict[str, Any]] = {}
        self.errors: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-watch", daemon=True)

    def start(self) -> RolloutWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(10)
        for c in self.clients.values():
            c.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            for site, client in self.clients.items():
                try:
                    st = client.status(timeout=3.0, limit=0)
                except Exception as exc:  # noqa: BLE001 - a fog that does not answer now is polled again
                    self.errors[site] = str(exc)
                    continue
                self._observe(site, st, time.monotonic() - self.t0)
            self._stop.wait(self.interval)

    def _observe(self, site: str, st: dict[str, Any], at: float) -> None:
        with self._lock:
            self.last[site] = st
            rel = (st.get("releases") or {}).get(self.name)
            if rel:
                v = int(rel["version"])
                self.refs.setdefault(v, str(rel.get("model")))
                if v not in self.accepted[site]:
                    self.accepted[site][v] = round(at, 2)
                    self.events.append({"t": round(at, 2), "site": site, "version": v, "event": "accepted"})
            wl = next((w for w in st.get("workloads", []) if w["name"] == self.name), None)
            if wl and wl["healthy_replicas"] >= wl["replicas"] and not wl.get("switch"):
                v2 = next((v for v, ref in self.refs.items() if ref == wl.get("model")), None)
                if v2 is not None and v2 not in self.serving[site]:
                    self.serving[site][v2] = round(at, 2)
                    self.events.append({"t": round(at, 2), "site": site, "version": v2, "event": "serving",
                                        "workload_version": wl["version"]})

    def has(self, site: str, version: int | None = None) -> bool:
        with self._lock:
            got = self.accepted[site]
            return bool(got) if version is None else version in got

    def serves(self, site: str, version: int) -> bool:
        with self._lock:
            return version in self.serving[site]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"events": sorted(self.events, key=lambda e: e["t"]),
                    "accepted_s": {s: dict(v) for s, v in self.accepted.items()},
                    "serving_s": {s: dict(v) for s, v in self.serving.items()}}


def run_demo(cfg: DemoConfig, *, quiet: bool = False) -> dict[str, Any]:
    rep = Reporter(quiet)
    work = cfg.out
    work.mkdir(parents=True, exist_ok=True)
    procs = Processes(work / "logs")
    result: dict[str, Any] = {"ok": False, "counters": {}, "faults": [], "recoveries": [], "sites": {}}
    counters = result["counters"]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1", "FOGLINE_CACHE_DIR": str(work / "cache")}
    sites: dict[str, DemoSite] = {}
    fogs: dict[str, LocalSite] = {}
    watch: RolloutWatch | None = None
    background = ThreadPoolExecutor(2, thread_name_prefix="demo-background")
    result["logs"] = str(procs.logs)
    budgets = Budgets.of(cfg)
    rep.on_step = lambda: write_report(work, {**result, "steps": rep.steps, "incomplete": True,
                                              "status": "running", "elapsed_s": round(time.monotonic() - rep.t0, 1)})
    old_term = _on_sigterm()
    try:
        sizes = site_sizes(cfg.agents)
        # 1. two fog brokers, each with its own CA, data dir, port and mosquitto ----------
        rep.step("sites", f"start {len(SITES)} sites ({', '.join(SITES)}; canary {CANARY}): a fog broker each with its "
                 "own site CA, mosquitto with TLS + client certificates + ACL, zeroconf")
        fogs.update({name: LocalSite(work / f"fog-{name}", site=name, env=env,
                                     log=work / "logs" / f"fog-{name}.log", zeroconf=True,
                                     args=["--state-interval", "2", "--summary-interval", "2"])
                     for name in SITES})
        with ThreadPoolExecutor(len(fogs)) as pool:  # both start at once; each waits for its ready line
            started = list(pool.map(lambda f: f.start(timeout=budgets.fog_start_s), fogs.values()))
        for name, fog in fogs.items():  # every wait from now on stops early if a fog broker dies
            procs.watch(f"fog-{name}", fog.proc, fog.log)
        n = 0
        for (name, fog), size in zip(fogs.items(), sizes):
            ids = [f"dev-{n + j:02d}" for j in range(size)]
            labels = {d: {"power-domain": f"pd-{j % 6}", "zone": f"z-{j % 2}"} for j, d in enumerate(ids)}
            sites[name] = DemoSite(name, fog, ids, labels, fog.client())
            n += size
        assert all(s.alive for s in started)
        for s in sites.values():
            rep.say(f"{s.name} ({s.role}): fog {s.fog.ready.get('fog_id')}, MQTT over TLS on {s.fog.mqtt}, "
                    f"enrolment on {s.fog.enroll}, CA {str(s.fog.ready.get('ca_sha256'))[:12]}...")
        result["security"] = {"tls": True, "ca_sha256": sites[CANARY].fog.ready.get("ca_sha256"),
                              "sites": {s.name: {"ca_sha256": s.fog.ready.get("ca_sha256"), "enroll": s.fog.enroll}
                                        for s in sites.values()}}
        # on each fog host: fogline operators add cloud --role coordinator, the directory copied to the
        # coordinator (here: written there with --out); done while the agents start
        creds = {s.name: background.submit(s.fog.operators_add, "cloud", role="coordinator",
                                           out=work / "coordinator-sites" / s.name) for s in sites.values()}
        for s in sites.values():
            result["sites"][s.name] = {"role": s.role, "mqtt": s.fog.mqtt, "fog_id": s.fog.ready.get("fog_id"),
                                       "devices": list(s.devices), "faults": []}

        # 2. agents, discovered by zeroconf by site name, enrolled with their site's token ---
        per_site = ", ".join(f"{len(s.devices)} at {s.name}" for s in sites.values())
        rep.step("agents", f"start {cfg.agents} simulated edge agents ({per_site}"
                 "); each finds its site's fog by mDNS (by site name) and enrols with that site's bootstrap token "
                 "(fogline token create --uses N --auto-approve)")
        i = 0
        argvs: dict[str, list[str]] = {}
        for s in sites.values():
            token = s.fog.token(uses=len(s.devices), auto_approve=True)
            for did in s.devices:
                lab = s.labels[did]
                argvs[did] = _python() + [
                    "edge_agent", "--simulate", PROFILE_MIX[i % len(PROFILE_MIX)], "--id", did,
                    "--data-dir", str(work / "agents" / s.name / did), "--site", s.name, "--state-interval", "2",
                    "--labels", ",".join(f"{k}={v}" for k, v in lab.items()), "--token", token]
                procs.start(did, argvs[did], env)
                i += 1
        result["devices"] = []
        result["agent_restarts"] = _wait_alive(sites, procs, argvs, env, rep, work / "logs",
                                               timeout=budgets.join_s)
        for s in sites.values():
            devs = s.client.status()["devices"]
            got = sorted(d["id"] for d in devs)
            if got != sorted(s.devices):  # an agent at the wrong site would show up here (or never enrol)
                raise RuntimeError(f"site {s.name} has devices {got}, expected {sorted(s.devices)}")
            result["devices"] += [{"id": d["id"], "site": s.name, "labels": d["labels"]} for d in devs]
            rep.say(f"{s.name}: {len(devs)} devices alive: " + ", ".join(got))

        # 3. deploy the residual CNN at both sites -----------------------------------------
        rep.step("deploy", "deploy the residual CNN at both sites: 3 partitions, 2 replicas on different "
                 "power domains (gang)")
        t_deploy = time.monotonic()
        wls: dict[str, dict[str, Any]] = {}
        for s in sites.values():
            s.client.deploy({"name": "resnet", "tenant": "demo", "priority": 10,
                             "replicas": 2 if len(s.devices) >= 6 else 1, "objective": "latency",
                             "source": s.source, "sink": s.sink, "selectors": {}, "tolerations": [],
                             "model": "zoo:resnet", "min_partitions": 3, "max_partitions": 3})
        for s in sites.values():
            wls[s.name] = _wait(f"workload resnet running at {s.name}", partial(_running, s.client, "resnet"),
                                budgets.running_s,
                                watch=procs.watching("fog-*", "dev-*"))
            result["sites"][s.name]["placement"] = wls[s.name]["placement"]
            for r in wls[s.name]["placement"]:
                chain = " -> ".join(f"p{p['index']}{p['segments']}@{p['device']}" for p in r["partitions"])
                rep.say(f"{s.name} replica {r['replica']}: {chain}  (predicted {1e3 * (r['latency_s'] or 0):.1f} ms)")
        result["deploy_s"] = round(time.monotonic() - t_deploy, 3)
        result["placement"] = wls[CANARY]["placement"]

        # 4. serve requests at both sites at once, kill a device of the canary midway ------
        canary = sites[CANARY]
        primary = wls[CANARY]["placement"][0]["partitions"]
        # the victim hosts a partition of the primary chain, not the source or sink
        candidates = [p["device"] for p in primary if p["device"] not in (canary.source, canary.sink)]
        victim = next(iter(candidates), primary[len(primary) // 2]["device"])
        # the devices that train: live ones, not this victim (its fault does not come back in the
        # rounds); their SuperNode keys are made and authorized meanwhile
        trainers = _trainers(cfg, sites, {victim})
        supernode_keys = background.submit(_supernode_keys, work, env, trainers)
        rep.step("serve", f"serve {cfg.requests} requests at each site, checked against the monolithic model; kill -9 "
                 f"{victim} at {CANARY} midway")
        rng = np.random.default_rng(cfg.seed)
        x = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
        ref, in_name = _reference_output(x)
        kill_at = [0.0]

        def kill(site: str) -> None:
            procs.kill9(victim)
            kill_at[0] = time.monotonic()
            fault = {"kind": "kill -9 device", "site": site, "target": victim, "at_request": cfg.requests // 2,
                     "at_s": round(kill_at[0] - rep.t0, 2)}
            result["faults"].append(fault)
            result["sites"][site]["faults"].append(fault)
            rep.say(f"[red]kill -9 {victim}[/red] at {site} (hosts a partition of the primary chain)"
                    if rep.console else f"kill -9 {victim} at {site}")

        with ThreadPoolExecutor(len(sites)) as pool:
            futs = {s.name: pool.submit(_serve, cfg, s, rep, x, ref, in_name,
                                        kill if s.name == CANARY else None, procs.watching(f"fog-{s.name}"))
                    for s in sites.values()}
            served = {name: f.result() for name, f in futs.items()}
        result["timeline"] = []
        for name, (stats, timeline) in served.items():
            result["sites"][name]["requests"] = stats
            result["timeline"] += [{**e, "site": name} for e in timeline]
            rep.say(f"{name}: {stats['answered']}/{stats['sent']} answered, {stats['failed']} errors, "
                    f"{stats['lost']} lost; max |diff| vs monolithic {stats['max_abs_diff']:.2e}")
        for key in ("sent", "answered", "lost", "failed", "mismatched"):
            counters[f"requests_{key}" if key != "mismatched" else "outputs_mismatched"] = sum(
                st[key] for st, _ in served.values())
        result["max_abs_diff"] = max(st["max_abs_diff"] for st, _ in served.values())

        rep.step("re-place", f"wait for the lost partition to be re-placed at {CANARY} (replica count restored)")
        wl = _wait(f"workload resnet running again at {CANARY}", partial(_running, canary.client, "resnet"),
                   budgets.running_s,
                   watch=procs.watching(f"fog-{CANARY}"))
        restored = time.monotonic() - kill_at[0]
        result["placement_after"] = wl["placement"]
        result["sites"][CANARY]["placement_after"] = wl["placement"]
        rec = list(canary.client.status().get("recoveries_s", []))
        result["recoveries"].append({"fault": f"kill -9 {victim}", "site": CANARY,
                                     "replicas_restored_after_s": round(restored, 3),
                                     "detect_to_running_s": rec[-1] if rec else None})
        rep.say(f"{victim} dead; replicas restored {restored:.2f} s after the kill "
                f"(detection -> running {rec[-1] if rec else '?'} s)")

        # 5. federated rounds with Byzantine clients, coordinator crash, staged rollouts ---
        watch = RolloutWatch({s.name: s.fog.client(s.fog.issue("demo-monitor", role="monitor").name)
                              for s in sites.values()}, rep.t0, RELEASE).start()
        # torch and the held-out digits load while the rounds run (the demo only waits then)
        preload = background.submit(_load_task)
        fl = _federated(cfg, work, procs, env, rep, sites, watch, result, budgets, trainers=trainers,
                        supernode_keys=supernode_keys, creds={n: f.result() for n, f in creds.items()})
        counters.update(fl)

        # 6. the released model reaches both sites, canary first -------------------------
        counters["release_predictions_agree"] = _release(cfg, work, sites, watch, rep, result, preload,
                                                         fogs_alive=procs.watching("fog-*"), budgets=budgets)

        counters["faults_injected"] = len(result["faults"])
        counters["recoveries"] = len(result["recoveries"])
        result["metrics"] = {}
        for s in sites.values():
            st = s.client.status(limit=0)
            result["metrics"][s.name] = st["metrics"]
            out = result["sites"][s.name]
            out["devices_live"] = st["metrics"].get("devices_live")
            out["devices_total"] = st.get("devices_total")
            out["fog_requests_answered"] = st.get("counters", {}).get("router.answered")
            out["releases"] = {k: v.get("version") for k, v in (st.get("releases") or {}).items()}
        result["ok"] = (counters["requests_lost"] == 0 and counters["outputs_mismatched"] == 0
                        and counters["requests_failed"] == 0
                        and counters.get("rounds_completed", 0) >= cfg.rounds
                        and result.get("release", {}).get("agreement") == 1.0
                        and bool(result.get("rollout", {}).get("canary_first")))
        rep.finish()
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the demo's boundary: a failed step
        result["ok"] = False
        result["failed_step"] = rep.fail(_failure_reason(exc))
        if isinstance(exc, KeyboardInterrupt):
            result["interrupted"] = str(exc) or "SIGINT"
        if not isinstance(exc, (ChildDied, TimeoutError, KeyboardInterrupt)):  # unexpected: keep the trace
            import traceback

            with open(procs.logs / "demo.log", "a") as f:
                f.write("".join(traceback.format_exception(exc)))
    finally:
        _restore_sigterm(old_term)
        rep.say("stopping every process of the demo" + (" after the failure" if result.get("failed_step") else ""))
        background.shutdown(wait=False, cancel_futures=True)
        if watch is not None:
            watch.stop()
        for s in sites.values():
            if s.client is not None:
                s.client.close()
        procs.stop_all()
        stops = [threading.Thread(target=fog.stop, name=f"stop-{name}") for name, fog in fogs.items()]
        for t in stops:  # each fog stops its own mosquitto; both at once
            t.start()
        for t in stops:
            t.join(30)
        _reap(work)
        result["elapsed_s"] = round(time.monotonic() - rep.t0, 1)
        result["steps"] = rep.steps
        done = [st["name"] for st in rep.steps if st["status"] == "done"]
        result["incomplete"] = done != list(STEPS)
        result["status"] = "failed" if result.get("failed_step") else "done"
    return result


def _running(client: Any, name: str) -> dict[str, Any] | None:
    """Workload ``name`` when all its replicas are healthy (as the fog client's ``wait_running``)."""
    for w in client.status(limit=0)["workloads"]:
        if w["name"] == name and w["healthy_replicas"] >= w["replicas"]:
            return dict(w)
    return None


def _wait_alive(sites: dict[str, DemoSite], procs: Processes, argvs: dict[str, list[str]], env: dict[str, str],
                rep: Reporter, logs: Path, timeout: float = 90.0, stuck_s: float = 20.0) -> list[str]:
    """Wait until every site has all its devices alive. An agent that enrolled but has not joined after
    ``stuck_s`` is restarted once (it is enrolled by then, so it only reconnects): its first connection
    can race the fog's ACL reload for the new identity (mosquitto then drops its BIRTH and refuses its
    subscriptions, and the agent waits forever). Returns the restarted devices."""
    t0 = time.monotonic()
    restarted: list[str] = []
    missing: set[str] = set()
    while time.monotonic() - t0 < timeout:
        procs.check("fog-*", "dev-*")  # an agent or a fog that died will not join: say why now
        missing = set()
        for s in sites.values():
            try:
                alive = {d["id"] for d in s.client.status()["devices"] if d["alive"]}
            except Exception:  # noqa: BLE001 - a fog busy with enrolments answers late: ask again
                alive = set()
            missing |= set(s.devices) - alive
        if not missing:
            return restarted
        if time.monotonic() - t0 >= stuck_s:
            for did in sorted(missing - set(restarted)):
                try:
                    enrolled = f"{did}: enrolled with fog" in (logs / f"{did}.log").read_text(errors="replace")
                except OSError:
                    enrolled = False
                if enrolled:
                    rep.say(f"{did} enrolled but has not joined after {stuck_s:g} s: restarting its agent "
                            "(enrolled now, it only reconnects)")
                    procs.kill9(did)
                    procs.start(did, argvs[did], env)
                    restarted.append(did)
        time.sleep(0.5)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for devices to join: {', '.join(sorted(missing))} "
                       "not alive")


def _serve(cfg: DemoConfig, site: DemoSite, rep: Reporter, x: np.ndarray, ref: dict[str, np.ndarray],
           in_name: str, kill: Callable[[str], None] | None,
           watch: Callable[[], None] = lambda: None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """An open-loop client at ``cfg.rate`` req/s against one site; ``kill`` runs at the midpoint.
    ``watch`` raises when the site's fog is gone (no point sending the rest into the void)."""
    timeline: list[dict[str, Any]] = []
    sent = answered = errors = lost = mismatched = 0
    max_diff = 0.0
    progress = _progress(rep, cfg.requests, f"requests at {site.name}")
    pace = 1.0 / cfg.rate if cfg.rate > 0 else 0.0
    next_send = time.monotonic()
    for i in range(cfg.requests):
        next_send += pace
        time.sleep(max(0.0, next_send - time.monotonic()))
        if kill is not None and i == cfg.requests // 2:
            kill(site.name)
        watch()
        sent += 1
        t0 = time.monotonic()
        try:
            res = site.client.infer_result("resnet", {in_name: x}, timeout=5.0)
        except TimeoutError:
            lost += 1
            timeline.append({"t": round(t0 - rep.t0, 4), "latency_s": None, "ok": False})
            progress(i + 1)
            continue
        dt = time.monotonic() - t0
        answered += 1
        if res.ok:
            diff = max(float(np.max(np.abs(np.asarray(res.tensors[k]) - v))) for k, v in ref.items())
            max_diff = max(max_diff, diff)
            mismatched += diff > 1e-4
        else:
            errors += 1
        timeline.append({"t": round(t0 - rep.t0, 4), "latency_s": round(dt, 5), "ok": res.ok,
                         "replica": res.replica, "error": res.error or None})
        progress(i + 1)
    lat = sorted(e["latency_s"] for e in timeline if e.get("latency_s") is not None and e["ok"])
    return ({"sent": sent, "answered": answered, "lost": lost, "failed": errors, "mismatched": mismatched,
             "max_abs_diff": max_diff, "p50_ms": round(1e3 * lat[len(lat) // 2], 2) if lat else None},
            timeline)


def _supernode_keys(work: Path, env: dict[str, str], trainers: list[tuple[str, str]]) -> dict[str, Path]:
    """Each training device's SuperNode key (``fogline supernodes keygen``, on the device), authorized at
    the coordinator (``fogline supernodes add``): device -> private key file."""
    fogline = _python() + ["runtime.cli"]
    keys: dict[str, Path] = {}
    for _, dev in trainers:
        kdir = work / "flower" / dev
        subprocess.run(fogline + ["supernodes", "keygen", "--out", str(kdir)], env=env, check=True,
                       capture_output=True)
        subprocess.run(fogline + ["supernodes", "add", dev, str(kdir / "supernode.pub"), "--checkpoint-dir",
                                  str(work / "ckpt")], env=env, check=True, capture_output=True)
        keys[dev] = kdir / "supernode.key"
    return keys


def _trainers(cfg: DemoConfig, sites: dict[str, DemoSite], dead: set[str]) -> list[tuple[str, str]]:
    """(site, device) of the SuperNodes: live devices that are neither a source nor a sink, 3 at the canary
    and 2 at store-2 (of 5); the last one is the Byzantine one."""
    pools = {s.name: [d for d in s.devices if d not in dead and d not in (s.source, s.sink)]
             for s in sites.values()}
    other = cfg.fl_nodes * 2 // 5
    want = {CANARY: cfg.fl_nodes - other, SITES[1]: other}
    picked = [(name, d) for name in SITES for d in pools[name][:want[name]]]
    spare = [(name, d) for name in SITES for d in pools[name][want[name]:]]
    return (picked + spare)[:cfg.fl_nodes]


def _follow(sites: dict[str, DemoSite], watch: RolloutWatch, rep: Reporter, deployed: set[str]) -> None:
    """An operator at each site serves ``release:NAME`` once a release of it is there (it cannot be
    deployed before): from then on a new release is switched to and checked at the canary."""
    for s in sites.values():
        if s.name in deployed or not watch.has(s.name):
            continue
        try:
            s.client.deploy({"name": RELEASE, "tenant": "demo", "priority": 5, "replicas": 1,
                             "objective": "latency", "source": s.source, "sink": s.sink, "selectors": {},
                             "tolerations": [], "model": f"release:{RELEASE}", "min_partitions": 2})
        except Exception as exc:  # noqa: BLE001 - tried again at the next look
            rep.say(f"{s.name}: deploying {RELEASE} failed for now: {exc}")
            continue
        deployed.add(s.name)
        rep.say(f"{s.name} lists a release of {RELEASE}: the operator there deploys workload {RELEASE} "
                f"(model release:{RELEASE}, 2 partitions)")


def _federated(cfg: DemoConfig, work: Path, procs: Processes, env: dict[str, str], rep: Reporter,
               sites: dict[str, DemoSite], watch: RolloutWatch, result: dict[str, Any], budgets: Budgets, *,
               trainers: list[tuple[str, str]], supernode_keys: Future[dict[str, Path]],
               creds: dict[str, Path]) -> dict[str, Any]:
    """The PyTorch CNN app (examples/pytorch) trained by authenticated SuperNodes on devices of both
    sites, robust rounds, a kill -9 of the coordinator and a resume; the coordinator is connected to
    both sites and rolls each signed release out staged (canary first, checked, then store-2)."""
    from cloud_coordinator.launcher import READY_FILE, TLS_DIR
    from cloud_coordinator.settings import FATAL_FILE, key_path
    from cloud_coordinator.store import REPORT_FILE, CheckpointStore
    from runtime.security import Identity

    rep.step("federated", f"federated training of the CNN app (examples/pytorch): {cfg.rounds} robust rounds, "
             f"{cfg.fl_nodes} authenticated Flower SuperNodes ({', '.join(f'{d}@{s}' for s, d in trainers)}), "
             f"{cfg.byzantine} Byzantine (sign-flip); one coordinator for {len(sites)} sites, releases rolled "
             "out canary first")
    superlink = free_port()
    ckpt, replica = work / "ckpt", work / "ckpt-replica"
    fogline = _python() + ["runtime.cli"]
    site_args: list[str] = []
    for s in sites.values():  # the coordinator credentials each fog issued (fogline operators add)
        site_args += ["--site", f"{s.name}={creds[s.name]}"]
        result["sites"][s.name]["coordinator_credentials"] = str(creds[s.name])
    rep.say("coordinator credentials issued by each fog (fogline operators add cloud --role coordinator): "
            + " ".join(site_args))
    keys = supernode_keys.result()
    for site, dev in trainers:
        result["sites"][site].setdefault("trainers", []).append(dev)
    argv = fogline + ["coordinator", "--app", str(REPO / "examples" / "pytorch"), "--rounds", str(cfg.rounds),
                      "--rule", cfg.rule, "--f", str(cfg.byzantine), "--seed", str(cfg.seed),
                      "--checkpoint-dir", str(ckpt), "--replica-dir", str(replica),
                      "--superlink", f"127.0.0.1:{superlink}", "--min-clients", str(cfg.fl_nodes - cfg.byzantine),
                      "--round-timeout", f"{ROUND_TIMEOUT_S:g}", "--grace", "3", "--release", RELEASE,
                      "--release-every", "2",
                      "--run-config", "fraction-evaluate=0.0", *site_args, "--canary", CANARY,
                      "--rollout-wait", f"{ROLLOUT_WAIT_S:g}",
                      "--timeout", f"{budgets.finish(cfg.rounds) + 60:.0f}"]  # it gives up after our wait would
    procs.start("coordinator", argv, env, fatal=ckpt / FATAL_FILE)
    _wait("the SuperLink with the SuperNode keys registered", lambda: (ckpt / READY_FILE).exists(),
          budgets.superlink_s, poll=0.3,
          watch=procs.watching("coordinator", "fog-*"))
    for i, key in enumerate(keys.values()):
        attack = " byzantine='sign-flip'" if i >= cfg.fl_nodes - cfg.byzantine else ""
        procs.start(f"supernode-{i}", ["flower-supernode", "--superlink", f"127.0.0.1:{superlink}",
                                       "--port", str(free_port()), "--root-certificates",
                                       str(ckpt / TLS_DIR / "ca.pem"), "--auth-supernode-private-key", str(key),
                                       "--node-config", f"partition-id={i} num-partitions={cfg.fl_nodes}{attack}"],
                    {**env, "FLWR_HOME": str(work / "flower" / f"node-{i}")},
                    whole_tree=True)  # its ClientApps end with it, even on a kill -9 of the demo
    # with several sites the coordinator signs checkpoints (and the outbox) with its own key,
    # CKPT.keys/coordinator.key; each site's release is re-signed with the key that site issued
    trusted = Identity.load("coordinator", key_path(ckpt, "coordinator.key")).public_key_bytes
    store = CheckpointStore([ckpt, replica], trusted_key=trusted)
    deployed: set[str] = set()

    def latest_round() -> int:
        _follow(sites, watch, rep, deployed)
        ck, _ = store.load_latest()
        return ck.server_round if ck is not None else 0

    kill_after = min(2, cfg.rounds - 1)
    t_ready = time.monotonic()
    _wait(f"round {kill_after} checkpoint", lambda: latest_round() >= kill_after,
          60.0 + budgets.rounds(kill_after), poll=0.5,
          watch=procs.watching("coordinator", "supernode-*", "fog-*"))
    rep.say(f"round {latest_round()} checkpointed; [red]kill -9 the coordinator[/red] (with its SuperLink and "
            "its connections to both sites)" if rep.console else "kill -9 the coordinator")
    at_kill = latest_round()
    round_s = (time.monotonic() - t_ready) / max(1, at_kill)  # this machine's pace, now
    finish_s = budgets.finish(cfg.rounds - at_kill, round_s)
    argv[argv.index("--timeout") + 1] = f"{finish_s + 60:.0f}"
    procs.kill9("coordinator")
    fault = {"kind": "kill -9 coordinator", "site": "cloud", "target": "coordinator", "after_round": at_kill,
             "at_s": round(time.monotonic() - rep.t0, 2)}
    result["faults"].append(fault)
    t_restart = time.monotonic()
    procs.start("coordinator-restarted", argv, env, fatal=ckpt / FATAL_FILE)  # the SuperNodes reconnect
    report_path = ckpt / REPORT_FILE

    def finished() -> dict[str, Any] | None:
        _follow(sites, watch, rep, deployed)
        return json.loads(report_path.read_text()) if report_path.exists() else None

    rep.say(f"rounds take {round_s:.0f} s here: waiting up to {finish_s:.0f} s for the {cfg.rounds - at_kill} "
            "left and the rollout")
    report = _wait("the restarted coordinator to finish", finished, finish_s, poll=0.5,
                   watch=procs.watching("coordinator-restarted", "supernode-*", "fog-*"))
    resumed = report.get("resumed_from")
    result["recoveries"].append({"fault": "kill -9 coordinator", "site": "cloud", "resumed_from_round": resumed,
                                 "finished_after_restart_s": round(time.monotonic() - t_restart, 1)})
    history = report.get("history", [])
    result["federated"] = {"rule": cfg.rule, "app": "examples/pytorch", "history": history, "resumed_from": resumed,
                           "releases": [r.get("version") for r in report.get("releases", [])],
                           "killed_after_round": at_kill, "trainers": [f"{d}@{s}" for s, d in trainers],
                           "final_release": max((int(r["version"]) for r in report.get("releases", [])
                                                 if "version" in r), default=cfg.rounds)}
    accs = [h.get("accuracy") for h in history]
    rep.say(f"resumed from round {resumed}; accuracy per round: "
            + ", ".join(f"{a:.3f}" for a in accs if a is not None))
    _follow(sites, watch, rep, deployed)
    return {"rounds_completed": int(report.get("rounds_done", 0)),
            "rounds_repeated": max(0, at_kill - int(resumed or 0))}


def _load_task() -> tuple[Any, Any]:
    """The CNN app's task module (torch) and 50 held-out digits to check the released model with."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_pytorch_task",
                                                  REPO / "examples" / "pytorch" / "pytorchexample" / "task.py")
    assert spec is not None and spec.loader is not None
    task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task)
    return task, next(iter(task.load_centralized_dataset()))[0][:50]


def _release(cfg: DemoConfig, work: Path, sites: dict[str, DemoSite], watch: RolloutWatch, rep: Reporter,
             result: dict[str, Any], preload: Future[tuple[Any, Any]] | None = None,
             fogs_alive: Callable[[], None] = lambda: None, budgets: Budgets | None = None) -> int:
    """The final release reaches the canary, is checked there, then store-2; each site serves it as
    partitions and its answers must equal torch's on the final checkpoint."""
    import torch

    from cloud_coordinator.settings import key_path
    from cloud_coordinator.store import CheckpointStore
    from runtime.security import Identity

    final = int(result["federated"]["final_release"])
    budgets = budgets or Budgets.of(cfg)
    rep.step("rollout", f"staged rollout of {RELEASE} v{final}: {CANARY} (canary) first, checked, then "
             f"{', '.join(SITES[1:])}; each site serves it as partitions")
    deployed = {s for s in SITES if watch.has(s)}
    for s in sites.values():  # a site that only now lists the release gets its workload now
        if s.name not in deployed:
            _wait(f"a release of {RELEASE} at {s.name}", partial(watch.has, s.name), budgets.release_s, poll=0.5,
                  watch=fogs_alive)
            _follow({s.name: s}, watch, rep, deployed)
    for s in sites.values():
        _wait(f"{RELEASE} v{final} served at {s.name}", partial(watch.serves, s.name, final), budgets.release_s,
              poll=0.5,
              watch=fogs_alive)
    book = _rollouts(work / "ckpt")
    snap = watch.snapshot()
    mine = next((r for r in book if r["version"] == final), None)
    times = {s: {"accepted_s": snap["accepted_s"][s].get(final), "serving_s": snap["serving_s"][s].get(final)}
             for s in SITES}
    canary_first = all(times[CANARY]["accepted_s"] is not None and times[s]["accepted_s"] is not None
                       and times[CANARY]["serving_s"] is not None
                       and times[CANARY]["accepted_s"] < times[s]["accepted_s"] for s in SITES[1:])
    checked = mine is not None and any(c.startswith("held-out batch") for c in mine.get("checks", []))
    result["rollout"] = {"name": RELEASE, "final_version": final, "canary": CANARY, "order": list(SITES),
                         "final": times, "canary_first": canary_first, "canary_checked": checked,
                         "events": snap["events"], "book": book}
    for r in book:
        rep.say(f"rollout {r['name']} v{r['version']}: {r['step']}"
                + "".join(f"; {site} {st['state']}" for site, st in r["sites"].items())
                + (f" ({'; '.join(r['checks'])})" if r.get("checks") else ""))
    rep.say(f"v{final}: " + ", ".join(f"{s} listed it at {t['accepted_s']} s, served it at {t['serving_s']} s"
                                      for s, t in times.items()))

    task, x = (preload.result() if preload is not None else _load_task())
    key = Identity.load("coordinator", key_path(work / "ckpt", "coordinator.key")).public_key_bytes
    ck, _ = CheckpointStore([work / "ckpt", work / "ckpt-replica"], trusted_key=key).load_latest()
    assert ck is not None
    net = task.Net()
    net.load_state_dict({n: torch.from_numpy(np.asarray(w)) for n, w in zip(ck.names, ck.weights)})
    net.eval()
    with torch.no_grad():
        want = net(x).argmax(dim=1).numpy()
    total = 0
    per_site: dict[str, Any] = {}
    for s in sites.values():
        wl = _wait(f"workload {RELEASE} running at {s.name}", partial(_running, s.client, RELEASE), budgets.running_s,
                   watch=fogs_alive)
        rel = (s.client.status(limit=0).get("releases") or {}).get(RELEASE) or {}
        agree = 0
        for i in range(len(x)):
            out = s.client.infer(RELEASE, {"x": x[i:i + 1].numpy()}, timeout=5.0)
            agree += int(np.argmax(next(iter(out.values())))) == int(want[i])
        n = len(x)
        total += agree
        per_site[s.name] = {"release_version": rel.get("version"), "workload_version": wl["version"],
                            "signer": rel.get("signer"), "placement": wl["placement"], "checked": n,
                            "agreement": agree / n}
        result["sites"][s.name]["release"] = per_site[s.name]
        parts = sum(len(r["partitions"]) for r in wl["placement"])
        rep.say(f"{s.name}: release v{rel.get('version')} (signed by {rel.get('signer')}) serving as {RELEASE} "
                f"v{wl['version']} in {parts} partitions: {agree}/{n} predictions equal torch's")
    c = per_site[CANARY]
    result["release"] = {**c, "agreement": min(p["agreement"] for p in per_site.values()), "sites": per_site}
    return total


def _rollouts(ckpt: Path) -> list[dict[str, Any]]:
    """The coordinator's rollout book (CKPT/rollouts.json), the parts a report shows."""
    try:
        doc = json.loads((ckpt / "rollouts.json").read_text())
    except (OSError, ValueError):
        return []
    return [{"name": r["name"], "version": r["version"], "step": r["step"], "canary": r.get("canary"),
             "order": r.get("order"), "checks": r.get("checks", []), "reason": r.get("reason", ""),
             "sites": r.get("sites", {})} for r in doc.get("rollouts", [])]
