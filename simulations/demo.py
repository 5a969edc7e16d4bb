"""``fogline demo``: the whole system end to end on one machine, with faults.

Real processes throughout: the fog broker (which starts mosquitto), twelve
simulated edge agents that find it with zeroconf, Flower SuperNodes, and the
coordinator (SuperLink + ServerApp). The demo only drives them from outside
(MQTT client, CLI processes, kill -9), the way an operator would, and checks
what they answer.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from runtime.broker import free_port

from .local_site import LocalSite

__all__ = ["DemoConfig", "run_demo"]

PROFILE_MIX = ("pi4", "pi5", "orin-nano", "pi4", "x86-gateway", "pi5", "jetson-nano", "pi4", "camera", "pi5",
               "orin-nano", "pi4")
SITE = "demo"
RELEASE = "digits-cnn"
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class DemoConfig:
    out: Path
    agents: int = 12
    requests: int = 200
    rounds: int = 5
    fl_nodes: int = 5
    byzantine: int = 1  # 20 % of 5
    rule: str = "centered_clipping"
    rate: float = 40.0  # requests per second
    seed: int = 7


class Processes:
    """Every child of the demo, in its own session, killed on exit whatever happens."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def kill9(self, name: str) -> None:
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # the whole session, even when its leader is gone: children it spawned (Flower's
            # SuperExec, verify workers) may outlive a SIGTERM to the leader
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if proc.poll() is None:
                proc.wait(timeout=5)


def _reap(work: Path, grace_s: float = 3.0) -> None:
    """Whatever still names the demo's directory (Flower's detached SuperExec, which waits to notice
    its SuperLink is gone) gets ``grace_s`` to exit, then SIGKILL: the demo leaves nothing behind."""
    import psutil

    def strays() -> list[Any]:
        found = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                cmd = p.info["cmdline"] or []
                ours = any(k in " ".join(cmd) for k in ("flower-", "flwr", "runtime.cli", "edge_agent", "mosquitto"))
                if p.pid != os.getpid() and ours and any(str(work) in part for part in cmd):
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found
    _, alive = psutil.wait_procs(strays(), timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def _wait(what: str, cond: Callable[[], Any], timeout: float, poll: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - a process still starting answers with errors
            last_exc = exc
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}"
                       + (f" (last error: {last_exc})" if last_exc else ""))


class Reporter:
    """Step lines and a progress bar for people; a JSON record for scripts."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.t0 = time.monotonic()
        self.steps: list[dict[str, Any]] = []
        try:
            from rich.console import Console

            self.console: Any = Console(stderr=True, highlight=False)
        except ImportError:  # rich is in the [sim] extra
            self.console = None

    def say(self, text: str) -> None:
        if self.quiet:
            return
        stamp = f"[{time.monotonic() - self.t0:6.1f}s]"
        if self.console is not None:
            self.console.print(f"[dim]{stamp}[/dim] {text}")
        else:
            print(f"{stamp} {text}", file=sys.stderr)

    def step(self, title: str) -> None:
        self.steps.append({"step": title, "at_s": round(time.monotonic() - self.t0, 2)})
        self.say(f"[bold cyan]==> {title}[/bold cyan]" if self.console else f"==> {title}")


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


def run_demo(cfg: DemoConfig, *, quiet: bool = False) -> dict[str, Any]:
    from fog_broker.client import FogClient

    rep = Reporter(quiet)
    work = cfg.out
    work.mkdir(parents=True, exist_ok=True)
    procs = Processes(work / "logs")
    result: dict[str, Any] = {"ok": False, "counters": {}, "faults": [], "recoveries": []}
    counters = result["counters"]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1", "FOGLINE_CACHE_DIR": str(work / "cache")}
    client = None
    fog: LocalSite | None = None
    try:
        # 1. fog broker (it starts and owns mosquitto) --------------------------------
        rep.step("start the fog broker: site CA, mosquitto with TLS + client certificates + ACL, zeroconf")
        fog = LocalSite(work / "fog", site=SITE, env=env, log=work / "logs" / "fog-broker.log", zeroconf=True,
                        args=["--state-interval", "2", "--summary-interval", "2"]).start()
        port = fog.port
        client = fog.client()
        rep.say(f"fog broker online: site {client.site!r}, MQTT over TLS on 127.0.0.1:{port}, enrolment on "
                f"{fog.enroll}; operator credentials in {fog.credentials()}")
        result["security"] = {"tls": True, "ca_sha256": fog.ready.get("ca_sha256"), "enroll": fog.enroll}

        # 2. agents, discovered by zeroconf, enrolled with one bootstrap token --------
        rep.step(f"start {cfg.agents} simulated edge agents (mixed profiles); they discover the fog by mDNS and "
                 "enrol with one bootstrap token (fogline token create --uses N --auto-approve)")
        token = fog.token(uses=cfg.agents, auto_approve=True)
        for i in range(cfg.agents):
            did = f"dev-{i:02d}"
            profile = PROFILE_MIX[i % len(PROFILE_MIX)]
            procs.start(did, _python() + ["edge_agent", "--simulate", profile, "--id", did, "--data-dir",
                                          str(work / "agents" / did), "--site", SITE, "--state-interval", "2",
                                          "--labels", f"power-domain=pd-{i % 6},zone=z-{i % 2}",
                                          "--token", token], env)
        devices = _wait(f"{cfg.agents} devices alive",
                        lambda: (lambda st: st["devices"] if sum(d["alive"] for d in st["devices"]) >= cfg.agents
                                 else None)(client.status()), 90, poll=0.5)
        result["devices"] = [{"id": d["id"], "labels": d["labels"]} for d in devices]
        rep.say(f"{len(devices)} devices alive: " + ", ".join(d["id"] for d in devices))

        # 3. deploy the residual CNN as 3 partitions x 2 replicas ---------------------
        rep.step("deploy the residual CNN: 3 partitions, 2 replicas on different power domains (gang)")
        spec = {"name": "resnet", "tenant": "demo", "priority": 10, "replicas": 2, "objective": "latency",
                "source": "dev-00", "sink": "dev-01", "selectors": {}, "tolerations": [],
                "model": "zoo:resnet", "min_partitions": 3, "max_partitions": 3}
        t_deploy = time.monotonic()
        client.deploy(spec)
        wl = client.wait_running("resnet", timeout=90)
        result["deploy_s"] = round(time.monotonic() - t_deploy, 3)
        result["placement"] = wl["placement"]
        for r in wl["placement"]:
            chain = " -> ".join(f"p{p['index']}{p['segments']}@{p['device']}" for p in r["partitions"])
            rep.say(f"replica {r['replica']}: {chain}  (predicted {1e3 * (r['latency_s'] or 0):.1f} ms)")

        # 4. serve requests, kill a device mid-stream ---------------------------------
        rep.step(f"serve {cfg.requests} requests, checked against the monolithic model; kill -9 a device midway")
        rng = np.random.default_rng(cfg.seed)
        x = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
        ref, in_name = _reference_output(x)
        primary = wl["placement"][0]["partitions"]
        # the victim hosts a partition of the primary chain; not the source or sink, and preferably
        # not a device that trains later (a dead device is not selected for rounds: the federated
        # part should show the Byzantine client and the coordinator crash, not this fault again)
        trainers = {f"dev-{i + 2:02d}" for i in range(cfg.fl_nodes)}
        candidates = [p["device"] for p in primary if p["device"] not in ("dev-00", "dev-01")]
        victim = next((d for d in candidates if d not in trainers), None) or \
            next(iter(candidates), primary[len(primary) // 2]["device"])
        timeline: list[dict[str, Any]] = []
        sent = answered = errors = lost = mismatched = 0
        max_diff = 0.0
        kill_at = time.monotonic() + 1e9
        progress = _progress(rep, cfg.requests, "requests")
        pace = 1.0 / cfg.rate if cfg.rate > 0 else 0.0
        next_send = time.monotonic()
        for i in range(cfg.requests):
            next_send += pace
            time.sleep(max(0.0, next_send - time.monotonic()))  # an open-loop client at ``rate`` req/s
            if i == cfg.requests // 2:
                procs.kill9(victim)
                kill_at = time.monotonic()
                result["faults"].append({"kind": "kill -9 device", "target": victim, "at_request": i,
                                         "at_s": round(kill_at - rep.t0, 2)})
                rep.say(f"[red]kill -9 {victim}[/red] (hosts a partition of the primary chain)"
                        if rep.console else f"kill -9 {victim}")
            sent += 1
            t0 = time.monotonic()
            try:
                res = client.infer_result("resnet", {in_name: x}, timeout=5.0)
            except TimeoutError:
                lost += 1
                timeline.append({"t": t0 - rep.t0, "latency_s": None, "ok": False})
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
        counters.update({"requests_sent": sent, "requests_answered": answered, "requests_lost": lost,
                         "requests_failed": errors, "outputs_mismatched": mismatched})
        result["max_abs_diff"] = max_diff
        result["timeline"] = timeline
        rep.say(f"{answered}/{sent} answered, {errors} errors, {lost} lost; max |diff| vs monolithic "
                f"{max_diff:.2e}")

        rep.step("wait for the lost partition to be re-placed (replica count restored)")
        wl = client.wait_running("resnet", timeout=60)
        restored = time.monotonic() - kill_at
        result["placement_after"] = wl["placement"]
        st = client.status()
        rec = [r for r in st.get("recoveries_s", [])]
        result["recoveries"].append({"fault": f"kill -9 {victim}", "replicas_restored_after_s": round(restored, 3),
                                     "detect_to_running_s": rec[-1] if rec else None})
        rep.say(f"{victim} dead; replicas restored {restored:.2f} s after the kill "
                f"(detection -> running {rec[-1] if rec else '?'} s)")

        # 5. federated rounds with Byzantine clients, coordinator crash -----------------
        fl = _federated(cfg, work, procs, env, rep, fog, result)
        counters.update(fl)

        # 6. the released model reaches the fleet -------------------------------------
        counters["release_predictions_agree"] = _release(cfg, work, client, rep, result)

        counters["faults_injected"] = len(result["faults"])
        counters["recoveries"] = len(result["recoveries"])
        result["metrics"] = client.status()["metrics"]
        result["ok"] = (lost == 0 and mismatched == 0 and errors == 0
                        and counters.get("rounds_completed", 0) >= cfg.rounds
                        and result.get("release", {}).get("agreement") == 1.0)
    finally:
        if client is not None:
            client.close()
        procs.stop_all()
        if fog is not None:
            fog.stop()
        _reap(work)
        result["elapsed_s"] = round(time.monotonic() - rep.t0, 1)
        result["steps"] = rep.steps
    return result


def _progress(rep: Reporter, total: int, what: str) -> Callable[[int], None]:
    if rep.quiet:
        return lambda n: None
    last = [-1]

    def update(n: int) -> None:
        pct = n * 100 // total
        if pct // 10 != last[0] // 10 or n == total:
            last[0] = pct
            bar = "#" * (pct // 5) + "." * (20 - pct // 5)
            rep.say(f"  [{bar}] {n}/{total} {what}")

    return update


def _federated(cfg: DemoConfig, work: Path, procs: Processes, env: dict[str, str], rep: Reporter,
               fog: LocalSite, result: dict[str, Any]) -> dict[str, Any]:
    """The PyTorch CNN app (examples/pytorch) trained by authenticated SuperNodes, robust rounds,
    a kill -9 of the coordinator and a resume, and signed releases of the CNN to the fog."""
    from cloud_coordinator.launcher import READY_FILE, TLS_DIR
    from cloud_coordinator.store import REPORT_FILE, CheckpointStore
    from runtime.credentials import load_credentials

    rep.step(f"federated training of the CNN app (examples/pytorch): {cfg.rounds} robust rounds, {cfg.fl_nodes} "
             f"authenticated Flower SuperNodes, {cfg.byzantine} Byzantine (sign-flip)")
    superlink = free_port()
    ckpt, replica = work / "ckpt", work / "ckpt-replica"
    fogline = _python() + ["runtime.cli"]
    creds = fog.issue("coordinator", role="coordinator")  # fogline operators add coordinator --role coordinator
    keys: dict[str, Path] = {}
    for i in range(cfg.fl_nodes):  # each device's SuperNode key, registered with the coordinator
        dev = f"dev-{i + 2:02d}"
        kdir = work / "flower" / dev
        subprocess.run(fogline + ["supernodes", "keygen", "--out", str(kdir)], env=env, check=True,
                       capture_output=True)
        subprocess.run(fogline + ["supernodes", "add", dev, str(kdir / "supernode.pub"), "--checkpoint-dir",
                                  str(ckpt)], env=env, check=True, capture_output=True)
        keys[dev] = kdir / "supernode.key"
    argv = fogline + ["coordinator", "--app", str(REPO / "examples" / "pytorch"), "--rounds", str(cfg.rounds),
                      "--rule", cfg.rule, "--f", str(cfg.byzantine), "--seed", str(cfg.seed),
                      "--checkpoint-dir", str(ckpt), "--replica-dir", str(replica),
                      "--superlink", f"127.0.0.1:{superlink}", "--min-clients", str(cfg.fl_nodes - cfg.byzantine),
                      "--round-timeout", "90", "--grace", "3", "--release", RELEASE, "--release-every", "2",
                      "--run-config", "fraction-evaluate=0.0", "--mqtt", fog.mqtt, "--credentials", str(creds),
                      "--timeout", "300"]
    procs.start("coordinator", argv, env)
    _wait("the SuperLink with the SuperNode keys registered", lambda: (ckpt / READY_FILE).exists(), 90, poll=0.3)
    for i, (dev, key) in enumerate(keys.items()):
        attack = " byzantine='sign-flip'" if i >= cfg.fl_nodes - cfg.byzantine else ""
        procs.start(f"supernode-{i}", ["flower-supernode", "--superlink", f"127.0.0.1:{superlink}",
                                       "--port", str(free_port()), "--root-certificates",
                                       str(ckpt / TLS_DIR / "ca.pem"), "--auth-supernode-private-key", str(key),
                                       "--node-config", f"partition-id={i} num-partitions={cfg.fl_nodes}{attack}"],
                    {**env, "FLWR_HOME": str(work / "flower" / f"node-{i}")})
    # checkpoints are signed with the coordinator's own key: resume (and this demo) trust only that
    store = CheckpointStore([ckpt, replica], trusted_key=load_credentials(creds).signing.public_key_bytes)

    def latest_round() -> int:
        ck, _ = store.load_latest()
        return ck.server_round if ck is not None else 0

    kill_after = min(2, cfg.rounds - 1)
    _wait(f"round {kill_after} checkpoint", lambda: latest_round() >= kill_after, 240, poll=0.5)
    rep.say(f"round {latest_round()} checkpointed; [red]kill -9 the coordinator[/red] (with its SuperLink)"
            if rep.console else "kill -9 the coordinator")
    at_kill = latest_round()
    procs.kill9("coordinator")
    result["faults"].append({"kind": "kill -9 coordinator", "target": "coordinator", "after_round": at_kill,
                             "at_s": round(time.monotonic() - rep.t0, 2)})
    t_restart = time.monotonic()
    procs.start("coordinator-restarted", argv, env)  # the SuperNodes reconnect by themselves
    report_path = ckpt / REPORT_FILE
    report = _wait("the restarted coordinator to finish",
                   lambda: (json.loads(report_path.read_text()) if report_path.exists() else None), 300, poll=1.0)
    resumed = report.get("resumed_from")
    result["recoveries"].append({"fault": "kill -9 coordinator", "resumed_from_round": resumed,
                                 "finished_after_restart_s": round(time.monotonic() - t_restart, 1)})
    history = report.get("history", [])
    result["federated"] = {"rule": cfg.rule, "app": "examples/pytorch", "history": history, "resumed_from": resumed,
                           "releases": [r.get("version") for r in report.get("releases", [])],
                           "killed_after_round": at_kill}
    accs = [h.get("accuracy") for h in history]
    rep.say(f"resumed from round {resumed}; accuracy per round: "
            + ", ".join(f"{a:.3f}" for a in accs if a is not None))
    return {"rounds_completed": int(report.get("rounds_done", 0)),
            "rounds_repeated": max(0, at_kill - int(resumed or 0))}


def _release(cfg: DemoConfig, work: Path, client: Any, rep: Reporter, result: dict[str, Any]) -> int:
    """Serve the released CNN as partitions; its answers must equal torch's on the final checkpoint."""
    import importlib.util

    import torch

    from cloud_coordinator.store import CheckpointStore
    from runtime.credentials import load_credentials

    rep.step(f"release: the signed CNN reaches the fog broker; serve it as workload {RELEASE!r} (partitions)")
    rel = _wait("the final model release at the fog broker",
                lambda: (lambda r: r if r and int(r.get("version", 0)) >= cfg.rounds else None)(
                    client.status(limit=0).get("releases", {}).get(RELEASE)), 90, poll=0.5)
    client.deploy({"name": RELEASE, "tenant": "demo", "priority": 5, "replicas": 1, "objective": "latency",
                   "source": "dev-00", "sink": "dev-01", "selectors": {}, "tolerations": [],
                   "model": f"release:{RELEASE}", "min_partitions": 2})
    wl = client.wait_running(RELEASE, timeout=90)
    spec = importlib.util.spec_from_file_location("demo_pytorch_task",
                                                  REPO / "examples" / "pytorch" / "pytorchexample" / "task.py")
    assert spec is not None and spec.loader is not None
    task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task)
    key = load_credentials(work / "fog" / "credentials" / "coordinator").signing.public_key_bytes
    ck, _ = CheckpointStore([work / "ckpt", work / "ckpt-replica"], trusted_key=key).load_latest()
    assert ck is not None
    net = task.Net()
    net.load_state_dict({n: torch.from_numpy(np.asarray(w)) for n, w in zip(ck.names, ck.weights)})
    net.eval()
    x = next(iter(task.load_centralized_dataset()))[0][:50]
    with torch.no_grad():
        want = net(x).argmax(dim=1).numpy()
    agree = 0
    for i in range(len(x)):
        out = client.infer(RELEASE, {"x": x[i:i + 1].numpy()}, timeout=5.0)
        agree += int(np.argmax(next(iter(out.values())))) == int(want[i])
    n = len(x)
    result["release"] = {"release_version": rel["version"], "workload_version": wl["version"],
                         "signer": rel.get("signer"), "placement": wl["placement"], "checked": n,
                         "agreement": agree / n}
    parts = sum(len(r["partitions"]) for r in wl["placement"])
    rep.say(f"release v{rel['version']} (signed by {rel.get('signer')}) serving as {RELEASE} v{wl['version']} in "
            f"{parts} partitions: {agree}/{n} predictions equal torch's")
    return agree
