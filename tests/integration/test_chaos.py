"""Chaos under load (issue 7 §3): random kill -9 of agents, the fog broker and the coordinator.

Real processes on 127.0.0.1, driven from outside the way an operator would.

* ``test_inference_chaos``: a fog broker (owning mosquitto) and 8 simulated edge
  agents on 6 power domains serve a residual CNN as 2 replicas x 3 partitions to
  an open-loop client. A seeded ``random.Random`` kills -9 three agents (one
  replica's worth at a time; two of them come back later with the same data
  dir, the last stays dead) and the fog broker once (restarted on the same data
  dir; its mosquitto died with it and is started anew), in a random order at
  random times. Invariants: every request ends in an answer (a result or an
  explicit error); the only requests without an answer are those sent to a dead
  fog broker, inside its downtime window; every result equals the monolithic
  model's (onnxruntime); no partition stays scheduled on a device dead for longer
  than the detection deadline (checked on every status snapshot during the run,
  and after it); the workload ends running with both replicas.
* ``test_federated_chaos``: Flower SuperLink (owned by ``fogline coordinator``),
  4 SuperNodes, 3 rounds. At seeded random moments the coordinator's process
  group is killed -9 mid-run and restarted, and one SuperNode is killed -9 and
  restarted. Invariants: the run reaches its round count with every round in
  its history; every checkpoint in every replica verifies (checksum).

The seed is printed; rerun a failure with ``FOGLINE_CHAOS_SEED=<seed>``.
Every wait is bounded and every process is killed in teardown.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime.broker import find_mosquitto, free_port, port_open

from _chaos_harness import PY, VENV_BIN, OpenLoop, Procs, base_env, new_site, read_ready
from waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

SEED = int(os.environ.get("FOGLINE_CHAOS_SEED", "7031"))

# ------------------------------------------------------------------ inference chaos: parameters

N_AGENTS = 8
PROFILES = ("pi5", "pi4", "orin-nano", "pi5", "x86-gateway", "pi4", "pi5", "orin-nano")
SOURCE, SINK = "dev-00", "dev-01"   # never killed: a workload needs its source and sink
STATE_INTERVAL_S = 1.0              # agents' state adverts; dead after 3 missed
STARTUP_WAIT_S = 3.0                # a restarted fog waits this long for devices before re-placing
DETECT_MARGIN_S = 3.0               # scheduling slack on a loaded 2-core CI machine
DETECT_S = 3 * STATE_INTERVAL_S + DETECT_MARGIN_S
RATE = 8.0                          # open-loop requests per second
REQUEST_TIMEOUT_S = 5.0             # the router's budget; the client waits 2 s more
CLIENT_WAIT_S = REQUEST_TIMEOUT_S + 2.0
FOG_READY_SLACK_S = 2.0             # after "ready", requests must be answered again
LIVE_PHASES = {"pending", "deploying", "running", "unconfirmed"}  # "lost" = known dead, not scheduled

if find_mosquitto() is None:  # pragma: no cover - make test installs it
    pytest.skip("mosquitto not installed", allow_module_level=True)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    pr = Procs(tmp_path, base_env(tmp_path))
    try:
        yield pr
    finally:
        pr.close()


def _reference(model: str, xs: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    import onnxruntime as ort

    from models import zoo
    sess = ort.InferenceSession(zoo.build(model).SerializeToString(), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    outs = [o.name for o in sess.get_outputs()]
    return [{k: np.asarray(v, dtype=np.float64) for k, v in zip(outs, sess.run(None, {name: x}))} for x in xs]


@dataclass
class Ground:
    """What the test did, on the test's monotonic clock: the truth the fog's view is checked against."""

    kills: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # device -> [(kill, back)]
    fog_down: list[tuple[float, float]] = field(default_factory=list)          # (kill, ready again)
    events: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def note(self, text: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.2f}s] {text}"
        self.events.append(line)
        print(line, flush=True)

    def dead_at(self, device: str, t: float) -> float | None:
        """When ``device`` died if it was dead at ``t`` (else None)."""
        for k, back in self.kills.get(device, []):
            if k <= t < back:
                return k
        return None

    def deadline(self, killed: float) -> float:
        """The latest moment a partition may still be scheduled on a device killed at ``killed``.

        A fog broker that restarted after the kill never heard of the device: it
        waits its startup window for devices, then the same detection deadline.
        """
        d = killed + DETECT_S
        for _kill, ready in self.fog_down:
            if ready > killed:
                d = max(d, ready + STARTUP_WAIT_S + DETECT_S)
        return d


def _fog_args(port: int, data: Path, site: str) -> list[str]:
    return [PY, "-m", "runtime.cli", "-v", "broker", "--port", str(port), "--data-dir", str(data), "--site", site,
            "--state-interval", str(STATE_INTERVAL_S), "--startup-wait", str(STARTUP_WAIT_S),
            "--summary-interval", "1", "--no-zeroconf"]


def _agent_args(i: int, port: int, site: str, tmp: Path, token: str) -> list[str]:
    """An agent enrolling with ``token`` on its first start (a restart with the same data dir needs none)."""
    did = f"dev-{i:02d}"
    return [PY, "-m", "edge_agent", "--simulate", PROFILES[i], "--id", did, "--broker", f"127.0.0.1:{port}",
            "--site", site, "--data-dir", str(tmp / "agents" / did), "--state-interval", str(STATE_INTERVAL_S),
            "--labels", f"power-domain=pd-{i % 6}", "--token", token]


def _workload(st: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((w for w in st["workloads"] if w["name"] == name), None)


def _scheduled(w: dict[str, Any]) -> list[tuple[int, int, str, str]]:
    return [(r["replica"], p["index"], p["device"], p["phase"]) for r in w["placement"] for p in r["partitions"]]


def test_inference_chaos(procs: Procs, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    print(f"\nchaos seed {SEED} (FOGLINE_CHAOS_SEED={SEED} reproduces the schedule)")
    from fog_broker.client import FogClient

    site, port, fog_dir = new_site(), free_port(), tmp_path / "fog"
    ground = Ground()
    fog = procs.start("fog", _fog_args(port, fog_dir, site), stdout_pipe=True)
    ready = read_ready(fog, 60)
    from fog_broker.site import Site
    trust = Site(fog_dir)
    token = trust.create_token(time.time(), uses=N_AGENTS, auto_approve=True)  # fogline token create
    trust.close()
    for i in range(N_AGENTS):
        procs.start(f"dev-{i:02d}", _agent_args(i, port, site, tmp_path, token))
    client = wait_for(lambda: FogClient("127.0.0.1", port, credentials=ready["credentials"]),
                      30, "an operator client", interval=0.2, retry_on=Exception)
    load: OpenLoop | None = None
    monitor_stop = threading.Event()
    snapshots: list[tuple[float, float, dict[str, Any]]] = []
    try:
        wait_for(lambda: sum(d["alive"] for d in client.status(timeout=5)["devices"]) >= N_AGENTS,
                 120, lambda: f"{N_AGENTS} devices alive; fog log:\n{procs.log_tail('fog')}", interval=0.5,
                 retry_on=Exception)
        client.deploy({"name": "res", "tenant": "chaos", "priority": 10, "replicas": 2, "objective": "latency",
                       "source": SOURCE, "sink": SINK, "selectors": {}, "tolerations": [],
                       "model": "zoo:resnet", "min_partitions": 3, "max_partitions": 3}, timeout=60)
        w = client.wait_running("res", timeout=90)
        ground.note("deployed: " + "; ".join(
            f"r{r['replica']}: " + " -> ".join(f"p{p['index']}@{p['device']}" for p in r["partitions"])
            for r in w["placement"]))

        xs = [np.random.default_rng(SEED + i).standard_normal((1, 3, 32, 32)).astype(np.float32) for i in range(6)]
        refs = _reference("resnet", xs)

        def monitor() -> None:  # status snapshots all along: the deadline invariant is checked on each
            while not monitor_stop.is_set():
                t_send = time.monotonic()
                try:
                    st = client.status(timeout=3)
                except Exception:  # noqa: BLE001 - the fog broker is down
                    continue
                snapshots.append((t_send, time.monotonic(), st))
                monitor_stop.wait(0.4)

        mon = threading.Thread(target=monitor, name="chaos-monitor", daemon=True)
        mon.start()
        load = OpenLoop(client, "res", [{"x": x} for x in xs], refs, RATE, REQUEST_TIMEOUT_S).start()

        restarts: list[tuple[float, int]] = []   # (when, agent index) pending
        dead_forever: list[str] = []

        def pump() -> None:
            now = time.monotonic()
            for item in [r for r in restarts if r[0] <= now]:
                restarts.remove(item)
                did = f"dev-{item[1]:02d}"
                procs.start(did, _agent_args(item[1], port, site, tmp_path, token))
                k, _ = ground.kills[did][-1]
                ground.kills[did][-1] = (k, time.monotonic())
                ground.note(f"restart {did} (same data dir)")

        def until(what: str, cond: Any, timeout: float) -> Any:
            def step() -> Any:
                pump()
                return cond()
            return wait_for(step, timeout, what, interval=0.3, retry_on=Exception)

        def restored(st: dict[str, Any], gone: str | None = None) -> bool:
            w = _workload(st, "res")
            return bool(st["ready"] and w and w["healthy_replicas"] == 2
                        and (gone is None or all(d != gone for _, _, d, _ in _scheduled(w))))

        plan = ["agent", "agent", "agent", "fog"]
        rng.shuffle(plan)
        ground.note(f"fault plan: {plan}")
        time.sleep(rng.uniform(2.0, 4.0))  # steady state first
        n_agent = 0
        for kind in plan:
            pump()
            time.sleep(rng.uniform(0.5, 3.0))
            if kind == "agent":
                n_agent += 1
                st = client.status(timeout=5)
                w = _workload(st, "res")
                assert w is not None
                reps = sorted({r for r, *_ in _scheduled(w)})
                rep = rng.choice(reps)
                now = time.monotonic()
                spare = {d for _, _, d, _ in _scheduled(w)
                         if d not in (SOURCE, SINK) and ground.dead_at(d, now) is None}
                hosts = sorted({d for r, _, d, _ in _scheduled(w) if r == rep} & spare)
                if not hosts:  # this replica lives on the source/sink only: take the other one
                    hosts = sorted(spare)
                victim = rng.choice(hosts)
                procs.kill9(victim)
                t_kill = time.monotonic()
                ground.kills.setdefault(victim, []).append((t_kill, float("inf")))
                ground.note(f"kill -9 agent {victim} (replica {rep})")
                if n_agent < plan.count("agent"):
                    restarts.append((t_kill + rng.uniform(DETECT_S + 1.0, DETECT_S + 4.0), int(victim[4:])))
                else:
                    dead_forever.append(victim)
                # without the victim while it is dead: once restarted it is a device like any
                # other (replicas keep off each other's power domains, so a repair may need it)
                until(f"res back to 2 replicas without {victim} while it is dead",
                      lambda victim=victim: restored(
                          client.status(timeout=3),
                          victim if ground.dead_at(victim, time.monotonic()) is not None else None), 60)
                ground.note(f"res restored after the loss of {victim}")
            else:
                procs.kill9("fog")  # its verify workers and its mosquitto die with it (no orphan broker)
                t_kill = time.monotonic()
                ground.note("kill -9 fog broker")
                until("mosquitto gone with its fog broker", lambda: not port_open("127.0.0.1", port), 10)
                time.sleep(rng.uniform(0.5, 2.0))
                fog = procs.start("fog", _fog_args(port, fog_dir, site), stdout_pipe=True)
                ready = read_ready(fog, 60)
                ground.fog_down.append((t_kill, time.monotonic()))
                ground.note(f"fog broker restarted (epoch {ready['epoch']})")
                until("the restarted fog broker to serve res with 2 replicas",
                      lambda: restored(client.status(timeout=3)), 60)
                ground.note("res restored after the fog broker restart")
        until("the pending agent restarts", lambda: not restarts, 30)
        time.sleep(3.0)  # a little load after the last fault
        load.stop(CLIENT_WAIT_S + 5.0)
        ground.note(f"load stopped: {load.sent} requests sent")

        # the dust settles: every partition on a device the test knows is alive, 2 replicas
        def settled() -> Any:
            st = client.status(timeout=5)
            w = _workload(st, "res")
            if not (st["ready"] and w and w["healthy_replicas"] == 2):
                return None
            if any(ground.dead_at(d, time.monotonic()) is not None for _, _, d, _ in _scheduled(w)):
                return None
            return st
        st = wait_for(settled, 60, "the fleet to settle", interval=0.5, retry_on=Exception)
        now = time.monotonic()
        for dev in st["devices"]:
            k = ground.dead_at(dev["id"], now)
            if k is not None and now > ground.deadline(k):
                assert not dev["alive"], f"{dev['id']} was killed {now - k:.1f} s ago but is shown alive"
        for i, x in enumerate(xs[:3]):  # served correctly at the end
            out = client.infer("res", {"x": x}, timeout=REQUEST_TIMEOUT_S)
            np.testing.assert_allclose(out["logits"], refs[i]["logits"], rtol=1e-4, atol=1e-5)
    finally:
        monitor_stop.set()
        if load is not None:
            load.stop(0.0)
        client.close()
        # post-mortem record, pass or fail: events, every request, every status snapshot
        (tmp_path / "chaos.json").write_text(json.dumps({
            "seed": SEED, "events": ground.events,
            "outcomes": [{**vars(o), "sent_at": round(o.sent_at - ground.t0, 3),
                          "done_at": round(o.done_at - ground.t0, 3)} for o in (load.outcomes if load else [])],
            "snapshots": [{"t": round(a - ground.t0, 3), "ready": st["ready"], "epoch": st["epoch"],
                           "alive": sorted(d["id"] for d in st["devices"] if d["alive"]),
                           "res": _workload(st, "res")} for a, _, st in list(snapshots)]},
            indent=1, default=str))

    # ---------------------------------------------------------------- invariants
    outcomes = sorted(load.outcomes, key=lambda o: o.seq)

    kinds = {k: sum(o.kind == k for o in outcomes) for k in ("ok", "error", "timeout", "exception")}
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.kind == "error":
            key = o.error.split(":")[0][:80]
            errors[key] = errors.get(key, 0) + 1
    print(f"requests: {load.sent} sent, {kinds}; error kinds {errors}")
    print("not ok (sent at s: kind): " + ", ".join(f"{o.sent_at - ground.t0:.2f}:{o.kind}" for o in outcomes
                                                   if o.kind != "ok"))
    print(f"status snapshots: {len(snapshots)}; fog downtime windows "
          f"{[(round(a - ground.t0, 2), round(b - ground.t0, 2)) for a, b in ground.fog_down]}")
    assert len(outcomes) == load.sent, f"{load.sent - len(outcomes)} requests never ended (client side)"
    assert kinds["exception"] == 0, [o.error for o in outcomes if o.kind == "exception"][:5]
    assert kinds["ok"] >= 0.5 * load.sent, kinds
    # 1. nothing the fog accepted is lost: an unanswered request was sent to a dead fog broker
    def in_downtime(o: Any) -> bool:
        return any(kill - CLIENT_WAIT_S - 0.5 <= o.sent_at <= ready + FOG_READY_SLACK_S
                   for kill, ready in ground.fog_down)
    lost = [(round(o.sent_at - ground.t0, 2), o.error) for o in outcomes if o.kind == "timeout" and not in_downtime(o)]
    assert not lost, f"{len(lost)} requests unanswered outside the fog broker's downtime: {lost[:10]}"
    # 1b. one replica's worth down at a time: the other replica serves, except while the fog broker
    #     itself is down or waits for its devices after a restart
    def fog_restarting(o: Any) -> bool:
        return any(kill - CLIENT_WAIT_S - 0.5 <= o.sent_at <= ready + STARTUP_WAIT_S + FOG_READY_SLACK_S
                   for kill, ready in ground.fog_down)
    unserved = [(round(o.sent_at - ground.t0, 2), o.error[:120]) for o in outcomes
                if o.kind == "error" and "no running replica" in o.error and not fog_restarting(o)]
    assert not unserved, f"{len(unserved)} requests found no running replica while one was healthy: {unserved[:5]}"
    other = [o for o in outcomes if o.kind == "error" and not fog_restarting(o)]
    assert len(other) <= 0.05 * load.sent, [(round(o.sent_at - ground.t0, 2), o.error[:120]) for o in other][:10]
    # 2. every result is the monolithic model's
    bad = [(o.seq, o.max_diff) for o in outcomes
           if o.kind == "ok" and not (o.max_diff is not None and o.max_diff <= 1e-4)]
    assert not bad, f"{len(bad)} results differ from the monolithic model: {bad[:10]}"
    # 3. no partition scheduled on a device dead for longer than the detection deadline
    violations = []
    for t_send, t_recv, snap in snapshots:
        w = _workload(snap, "res")
        if w is None:
            continue
        for rep, idx, dev, phase in _scheduled(w):
            if phase not in LIVE_PHASES:
                continue
            k = ground.dead_at(dev, t_send)
            if k is not None and ground.dead_at(dev, t_recv) is not None and t_send > ground.deadline(k):
                violations.append(f"r{rep}p{idx} {phase} on {dev}, dead for {t_send - k:.1f} s "
                                  f"(deadline {ground.deadline(k) - k:.1f} s) at {t_send - ground.t0:.1f} s")
    assert not violations, violations[:10]
    assert len(snapshots) > 10, "the status monitor saw too little"


# ------------------------------------------------------------------ federated chaos

N_NODES = 4
ROUNDS = 3


def _supernode(procs: Procs, i: int, port: int, tmp: Path) -> subprocess.Popen[bytes]:
    env = {**procs.env, "FLWR_HOME": str(tmp / f"node-{i}")}
    return procs.start(f"supernode-{i}", [str(VENV_BIN / "flower-supernode"), "--insecure", "--superlink",
                                          f"127.0.0.1:{port}", "--port", str(free_port()), "--node-config",
                                          f"device-id='dev-{i}' partition-id={i} num-partitions={N_NODES}"],
                       env=env)


def test_federated_chaos(procs: Procs, tmp_path: Path) -> None:
    from cloud_coordinator.store import REPORT_FILE, CheckpointStore

    rng = random.Random(SEED + 1)
    print(f"\nchaos seed {SEED} (FOGLINE_CHAOS_SEED={SEED} reproduces the schedule)")
    port = free_port()
    ckpt, replica = tmp_path / "ckpt", tmp_path / "ckpt-replica"
    for i in range(N_NODES):
        _supernode(procs, i, port, tmp_path)
    argv = [PY, "-m", "runtime.cli", "-v", "coordinator", "--no-supernode-auth", "--rounds", str(ROUNDS),
            "--rule", "trimmed_mean",
            "--f", "1", "--seed", "7", "--checkpoint-dir", str(ckpt), "--replica-dir", str(replica),
            "--superlink", f"127.0.0.1:{port}", "--min-clients", str(N_NODES - 1), "--grace", "2",
            "--num-partitions", str(N_NODES), "--round-timeout", "30", "--timeout", "170"]
    t0 = time.monotonic()
    procs.start("coordinator", argv)

    def latest() -> int:
        rounds = [int(p.name[5:13]) for d in (ckpt, replica) if d.exists() for p in d.glob("ckpt-*.json")]
        return max(rounds, default=0)

    def note(text: str) -> None:
        print(f"[{time.monotonic() - t0:6.2f}s] {text}", flush=True)

    # Seeded fault times: after round k's checkpoint (k < ROUNDS), plus a delay into round k+1.
    faults = sorted([(rng.randint(1, ROUNDS - 1), rng.uniform(0.0, 2.5), "coordinator"),
                     (rng.randint(1, ROUNDS - 1), rng.uniform(0.0, 2.5), "supernode")])
    node = rng.randrange(N_NODES)
    note(f"fault plan: {faults}, supernode {node}")
    killed_after = 0
    for k, delay, what in faults:
        wait_for(lambda k=k: latest() >= k, 120, f"round {k} checkpoint", interval=0.2,
                 retry_on=Exception)
        time.sleep(delay)
        if what == "coordinator":
            if (ckpt / REPORT_FILE).exists():
                note("run already finished; no coordinator kill")
                continue
            killed_after = latest()
            procs.kill9("coordinator")  # with its SuperLink, flwr run and the ServerApp
            note(f"kill -9 coordinator (latest checkpoint: round {killed_after})")
            time.sleep(rng.uniform(0.2, 1.5))
            procs.start("coordinator", argv)
            note("coordinator restarted")
        else:
            procs.kill9(f"supernode-{node}")
            note(f"kill -9 supernode-{node}")
            time.sleep(rng.uniform(1.0, 3.0))
            _supernode(procs, node, port, tmp_path)
            note(f"supernode-{node} restarted")
    coord = procs.procs["coordinator"]
    try:
        rc = coord.wait(max(10.0, 200 - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        pytest.fail(f"coordinator did not finish:\n{procs.log_tail('coordinator')}")
    note(f"coordinator exited {rc}")
    assert rc == 0, procs.log_tail("coordinator")
    rep = json.loads((ckpt / REPORT_FILE).read_text())
    assert rep["rounds_done"] == ROUNDS
    assert [h["round"] for h in rep["history"]] == list(range(1, ROUNDS + 1)), rep["history"]
    if killed_after:
        assert rep["resumed_from"] >= killed_after, (rep["resumed_from"], killed_after)
    assert rep["history"][-1]["accuracy"] > 0.7, rep["history"][-1]
    # every checkpoint in every replica verifies; the newest of each replica is the last round
    store = CheckpointStore([ckpt, replica])
    scan = store.scan()
    assert scan.entries and not scan.skipped, scan.skipped
    for i in range(2):
        assert max(e.server_round for e in scan.entries if e.replica == i) == ROUNDS
    latest_ck, _ = store.load_latest()
    assert latest_ck is not None and latest_ck.server_round == ROUNDS
    note(f"done: resumed from round {rep['resumed_from']}, accuracy {rep['history'][-1]['accuracy']:.3f}, "
         f"{len(scan.entries)} checkpoint files verified")
