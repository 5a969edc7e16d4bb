"""Fog broker benchmark: advert ingest with signature checks, and failure -> replacement running.

Run: ``python -m benchmarks.fog_bench [--quick]`` (or ``fogline bench fog``). Prints JSON on
stdout, writes ``out/bench/fog.json``, a human summary on stderr. Baselines come from the same run:

* ingest: single-thread CPU cost of decode-only vs verified (``Verifier.open``) state adverts;
  then through mosquitto: a counting subscriber (the transport ceiling) vs the fog broker
  verifying and ingesting adverts from N simulated agents (pre-signed states, 1,000 identities):
  ``fog_verified_*`` with Ed25519-signed states, ``fog_mac_*`` with session-MAC states (births
  still signed and offering an X25519 key, as edge agents do). Each run notes the load average.
* fair share: the same ingest (2 verify processes, session-MAC states over TLS) with the per-sender
  budgets on and off (``ServiceConfig.fair_share``), alternated in the same run; prints on/off.
* failover: real edge agents (in this process) under a live fog broker; the agent running a
  partition is crashed (socket dropped, the broker publishes its Will) repeatedly; we time
  kill -> detection -> replacement running, against the plain deploy latency (send -> ack).
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._emit import report, run_header

ROOT = Path(__file__).resolve().parents[1]

PUBLISHER = r"""
import json, sys, time, msgpack
from runtime.mqtt import MqttClient, TlsConfig
port, path, conns = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
tls = [TlsConfig(**t) for t in json.loads(sys.argv[4])] if len(sys.argv) > 4 else []
frames = msgpack.unpackb(open(path, "rb").read())
clients = [MqttClient(f"bench-pub-{i}" if tls else f"bench-pub-{i}-{time.time_ns()}", "127.0.0.1", port,
                      max_queued=1_000_000, tls=tls[i] if tls else None) for i in range(conns)]
for c in clients: c.start()
for c in clients: assert c.wait_connected(10)
t0 = time.monotonic()
last = None
for i, (topic, payload) in enumerate(frames):
    last = clients[i % conns].publish(topic, payload, qos=1)
last.wait(60)
print(time.monotonic() - t0, flush=True)
time.sleep(0.5)
for c in clients: c.stop()
"""


def pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# ---------------------------------------------------------------- fixtures


def _identities(n: int) -> list[Any]:
    from runtime.security import Identity
    return [Identity.from_seed(f"dev{i:05d}", f"bench-{i}".encode()) for i in range(n)]


def _frames(site: str, ids: list[Any], states: int, epoch: int, with_births: bool,
            fog_session: bytes | None = None) -> tuple[list, list]:
    """(births, states) as [topic, bytes] lists, signed now.

    With ``fog_session`` (a fog run's X25519 key) births offer a session and states carry
    session MACs, as an edge agent does against a fog that offers one.
    """
    from runtime.messages import DeviceBirth, DeviceState, PartitionStatus
    from runtime.security import SessionKeyPair, Signer
    from runtime.topics import Topics
    t = Topics(site)
    now = time.time()
    births, st = [], []
    signers = [Signer(i, epoch) for i in ids]
    part = (PartitionStatus("w", 1, 0, 0, "a" * 64, "running"),)
    keys: dict[str, bytes] = {}
    for s in signers:
        name = s.identity.name
        if with_births:
            sess: dict[str, Any] = {}
            if fog_session is not None:
                pair = SessionKeyPair()
                keys[name] = pair.derive(fog_session, name, epoch, pair.public_bytes, fog_session)
                sess = {"session_key": pair.public_bytes, "fog_session_key": fog_session}
            b = DeviceBirth(name, epoch, 0, site, s.identity.public_key_bytes, 5e9, 1_000_000_000, 1e8, 1e8,
                            0.001, 5.0, 2.0, state_interval_s=1000.0, simulated=True, **sess)
            births.append([t.device(name, "BIRTH"), s.seal_bytes(b, now)])
    for k in range(states):
        for s in signers:
            name = s.identity.name
            m = DeviceState(name, epoch, k + 1, 900_000_000, 0.8, cpu_load=0.1, partitions=part)
            st.append([t.device(name, "STATE"), s.seal_mac_bytes(m, now, keys[name]) if name in keys
                       else s.seal_bytes(m, now)])
    return births, st


def _publish(port: int, frames: list, tmp: Path, conns: int, tls: list[dict[str, Any]] | None = None) -> float:
    import json

    import msgpack
    path = tmp / f"frames-{time.time_ns()}.bin"
    path.write_bytes(msgpack.packb(frames, use_bin_type=True))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", PUBLISHER, str(port), str(path), str(conns)] + ([json.dumps(tls)] if tls else [])
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[0])


def _wait(pred: Any, timeout: float, step: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return False


# ---------------------------------------------------------------- ingest


def bench_cpu(n_ids: int, per: int) -> dict[str, Any]:
    from fog_broker._verify_pool import open_session
    from fog_broker.registry import Registry
    from runtime import codec
    from runtime.messages import DeviceBirth, DeviceDeath, DeviceState
    from runtime.security import SessionKeyPair, TrustStore, Verifier
    ids = _identities(n_ids)
    births, states = _frames("bench", ids, per, 1, True)
    fog = SessionKeyPair()
    mac_births, mac_states = _frames("bench", ids, per, 1, True, fog.public_bytes)
    out: dict[str, Any] = {"adverts": len(states)}
    for mode in ("decode_only", "verified", "session_mac"):
        reg = Registry()
        ver = Verifier(TrustStore({i.name: i.public_key_bytes for i in ids}), sessions=True)
        for _, b in (mac_births if mode == "session_mac" else births):
            advert = codec.decode(codec.decode_envelope(b).payload)
            assert isinstance(advert, DeviceBirth | DeviceState | DeviceDeath)
            reg.handle(advert, 0.0)
            if mode == "session_mac":
                env, msg = ver.open(b, time.time())
                open_session(ver, fog, env, msg)
        now = time.time()
        t0 = time.perf_counter()
        for _, b in (mac_states if mode == "session_mac" else states):
            if mode != "decode_only":
                _, msg = ver.open(b, now)
            else:
                msg = codec.decode(codec.decode_envelope(b).payload)  # the decoding ver.open does
            reg.handle(msg, 1.0)  # type: ignore[arg-type]
        dt = time.perf_counter() - t0
        out[f"{mode}_per_s"] = round(len(states) / dt)
        out[f"{mode}_us"] = round(dt / len(states) * 1e6, 1)
    return out


class _Site:
    """A fog data dir with its site CA, a mosquitto over TLS (or plain), and the fleet's keys enrolled.

    With TLS the broker runs as ``fogline broker`` configures it (client certificates, ACL, size
    limit); the publishers that stand in for the fleet get their own identities with write access
    to device topics (a test ACL: a real device may write only its own), so the transport is the
    secure one while a handful of connections carry a thousand devices' adverts.
    """

    def __init__(self, tmp: Path, name: str, ids: list[Any], tls: bool, conns: int) -> None:
        from fog_broker.site import Site
        from runtime.broker import BrokerConfig, MosquittoBroker
        self.site = Site(tmp / f"fog-{name}", site=name)
        now = time.time()
        for i in ids:
            self.site.add_device(i.name, i.public_key_bytes, now)
        self.pub_tls: list[dict[str, Any]] = []
        tls_dir, acl = None, None
        if tls:
            tls_dir = self.site.broker_tls_dir(["localhost", self.site.fog_id], ["127.0.0.1"])
            base = f"fogline/v1/{name}"
            extra = []
            for k in range(conns):
                cn = f"bench-pub-{k}"
                bundle = self.site.ca.issue_bundle(tmp / f"pub-{name}-{k}", cn, "device")
                self.pub_tls.append({"ca_file": bundle.ca_file, "cert_file": bundle.cert_file,
                                     "key_file": bundle.key_file, "server_hostname": self.site.fog_id})
                extra += [f"user {cn}", f"topic write {base}/dev/#", ""]
            acl = self.site.acl() + "\n" + "\n".join(extra)
        self.broker = MosquittoBroker(BrokerConfig(data_dir=tmp / f"mqtt-{name}", port=0, persistence=False,
                                                   tls_dir=tls_dir, acl=acl,
                                                   max_message_bytes=(24 << 20) if tls else 0)).start()
        self.fog_tls = self.site.fog_credentials().tls(self.site.fog_id) if tls else None

    def close(self) -> None:
        self.broker.stop()


def _transport_only(ids: list[Any], per: int, conns: int, tmp: Path) -> dict[str, Any]:
    """The transport ceiling: a subscriber that only counts (plain TCP)."""
    from runtime.broker import BrokerConfig, MosquittoBroker
    from runtime.mqtt import MqttClient
    b = MosquittoBroker(BrokerConfig(data_dir=tmp / "mqtt-ingest", port=0, persistence=False)).start()
    try:
        _, states = _frames("base", ids, per, 1, False)
        got = [0, 0.0, 0.0]

        def count(m: Any) -> None:
            if got[0] == 0:
                got[1] = time.monotonic()
            got[0] += 1
            got[2] = time.monotonic()
        sub = MqttClient("bench-counter", "127.0.0.1", b.port, inbox_size=1_000_000)
        sub.subscribe("fogline/v1/base/dev/+/STATE", count, qos=0)  # as the fog subscribes to states
        sub.start()
        sub.wait_connected(10)
        time.sleep(0.2)
        pub_s = _publish(b.port, states, tmp, conns)
        _wait(lambda: got[0] >= len(states), 60, 0.02)
        sub.stop()
        return {"received": got[0], "per_s": round(got[0] / max(got[2] - got[1], 1e-9)),
                "publisher_per_s": round(len(states) / pub_s)}
    finally:
        b.stop()


def bench_ingest(n_ids: int, per: int, conns: int, modes: Sequence[tuple[Any, ...]],
                 tmp: Path, transport: bool = True) -> dict[str, Any]:
    """Each mode is (threads|processes, workers, sig|mac, tls[, fair_share (default on)])."""
    res: dict[str, Any] = {"agents": n_ids, "states_per_agent": per, "publisher_connections": conns}
    ids = _identities(n_ids)
    if transport:
        res["transport_only"] = _transport_only(ids, per, conns, tmp)
    for mode, w, auth, tls, *more in modes:
        fair = bool(more[0]) if more else True
        key = (f"fog_{'verified' if auth == 'sig' else 'mac'}_{mode}{w}_{'tls' if tls else 'tcp'}"
               + ("" if fair else "_limits_off"))
        res[key] = _ingest_mode(ids, per, conns, tmp, mode, w, auth, tls, fair)
    return res


def _ingest_mode(ids: list[Any], per: int, conns: int, tmp: Path, mode: str, w: int, auth: str,
                 tls: bool, fair: bool) -> dict[str, Any]:
    """One ingest mode of :func:`bench_ingest` on a fresh site: the figures under its key."""
    from fog_broker.service import FogService, ServiceConfig
    n_ids = len(ids)
    name = f"ing{mode[0]}{w}{auth}{'tls' if tls else 'tcp'}{'' if fair else 'nolim'}{time.time_ns() % 10_000}"
    site = _Site(tmp, name, ids, tls, conns)
    svc = FogService(ServiceConfig(data_dir=site.site.dir, site=name, fog_id=site.site.fog_id,
                                   mqtt_port=site.broker.port, tls=site.fog_tls, state_interval_s=1000.0,
                                   verify_workers=w, verify_processes=mode == "processes",
                                   summary_interval_s=1000.0, fair_share=fair), site=site.site).start()
    try:
        births, states = _frames(name, ids, per, 1, True, svc.session.public_bytes if auth == "mac" else None)
        _publish(site.broker.port, births, tmp, conns, site.pub_tls)
        _wait(lambda: svc.ingest.counts()["in:BIRTH"] >= n_ids, 120, 0.05)
        base = svc.ingest.counts()["in:STATE"]
        marks: list[tuple[float, int]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                marks.append((time.monotonic(), svc.ingest.counts()["in:STATE"] - base))
                time.sleep(0.01)
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        load0 = round(os.getloadavg()[0], 2)
        pub_s = _publish(site.broker.port, states, tmp, conns, site.pub_tls)
        _wait(lambda: svc.ingest.counts()["in:STATE"] - base >= len(states), 120, 0.02)
        processed = _wait(lambda: svc.registry.accepted >= n_ids + len(states), 30, 0.02)
        stop.set()
        th.join()
        first = next((t for t, n in marks if n > 0), marks[0][0])
        last = next((t for t, n in marks if n >= len(states)), marks[-1][0])
        n = svc.ingest.counts()["in:STATE"] - base
        return {
            "loadavg_before": load0,
            "verified": n, "per_s": round(n / max(last - first, 1e-9)),
            "publisher_per_s": round(len(states) / pub_s), "registry_caught_up": processed,
            "rejected": dict(svc.rejections()),
            "dropped": {k: v for k, v in svc.counters.items() if "overflow" in k},
            "limited": {k: v for k, v in svc.ingest.counts().items() if k.startswith("limited:")},
        }
    finally:
        svc.stop()
        site.close()


def _intake_cpu(n_ids: int, per: int, rounds: int) -> dict[str, Any]:
    """Single-thread CPU of the intake (``Ingest.on_device``: topic, size, trust, budget, lane) per
    advert with the budgets off and on, alternated; then the whole single-thread path of a
    session-MAC state (intake + ``Verifier.open`` + registry) both ways. Thread CPU time (not wall
    time: a loaded machine deschedules us at random), the best of ``rounds``."""
    from fog_broker.ingest import DEVICE_SHARE, Ingest
    from fog_broker.registry import Registry
    from runtime.mqtt import Inbound
    from runtime.security import SessionKeyPair, TrustStore
    ids = _identities(n_ids)
    fog = SessionKeyPair()
    births, states = _frames("bench", ids, per, 1, True, fog.public_bytes)
    trust = TrustStore({i.name: i.public_key_bytes for i in ids})
    best: dict[str, float] = {}
    full: dict[str, float] = {}
    for _ in range(rounds):
        for label, share in (("off", None), ("on", DEVICE_SHARE)):
            ing = Ingest(trust, fog, lambda item: None, shards=2, share=share)
            t0 = time.monotonic()
            msgs = [Inbound(t, b, t0 + k * 1e-4) for k, (t, b) in enumerate(births + states)]
            t = time.thread_time()
            for m in msgs:
                ing.on_device(m)
            dt = time.thread_time() - t
            best[label] = min(best.get(label, math.inf), dt / len(msgs) * 1e6)
            # the whole path in this thread: what was queued, verified and registered
            reg = Registry()
            out: list[Any] = []
            t = time.thread_time()
            for sh in ing._shards:
                for m, pt in sh.lanes.take(10**9) if len(sh.lanes) else ():
                    ing._local(sh, m, pt, out)
            for item in out:  # the verified adverts (``ingest.Heard``), as the owner hands them on
                msg = getattr(item.event, "msg", None)
                if msg is not None:
                    reg.handle(msg, 1.0)
            full[label] = min(full.get(label, math.inf), (time.thread_time() - t + dt) / len(msgs) * 1e6)
            assert len(out) >= len(msgs), (label, len(out), len(msgs))  # nothing limited in this load
    return {"adverts": len(births) + len(states), "intake_us_off": round(best["off"], 2),
            "intake_us_on": round(best["on"], 2), "path_us_off": round(full["off"], 2),
            "path_us_on": round(full["on"], 2),
            "cpu_ratio_on_off": round(full["off"] / full["on"], 3)}


def bench_fair_share(n_ids: int, per: int, conns: int, rounds: int, tmp: Path) -> dict[str, Any]:
    """Ingest with the per-sender budgets off, then on, ``rounds`` times (same run, same load)."""
    cpu = _intake_cpu(n_ids, per, max(rounds, 5))
    mode = ("processes", 2, "mac", True)
    runs: dict[str, list[int]] = {"off": [], "on": []}
    limited: dict[str, int] = {}
    for _ in range(rounds):
        for label, fair in (("off", False), ("on", True)):
            r = bench_ingest(n_ids, per, conns, [(*mode, fair)], tmp, transport=False)
            row = next(v for k, v in r.items() if k.startswith("fog_"))
            runs[label].append(int(row["per_s"]))
            for k, v in row["limited"].items():
                limited[k] = limited.get(k, 0) + int(v)
    best = {k: max(v) for k, v in runs.items()}
    return {"mode": "2 verify processes, session-MAC states, TLS", "agents": n_ids, "states_per_agent": per,
            "cpu_single_thread": cpu, "per_s_off": runs["off"], "per_s_on": runs["on"],
            "best_off": best["off"], "best_on": best["on"],
            "ratio_on_off": round(best["on"] / max(best["off"], 1), 3), "goal": 0.95,
            "limited_with_limits_on": limited, "loadavg": round(os.getloadavg()[0], 2)}


# ---------------------------------------------------------------- failover


def bench_failover(kills: int, workers: int, tmp: Path) -> dict[str, Any]:
    import onnxruntime  # noqa: F401 - imported before agents start (a first import stalls them)

    from edge_agent.agent import AgentConfig, load_identity
    from edge_agent.runner import make_agent
    from fog_broker.client import FogClient
    from fog_broker.service import FogService, ServiceConfig
    from runtime.credentials import FogInfo
    from simulations.profiles import DeviceProfile
    site_name = "fail"
    site = _Site(tmp, site_name, [], True, 0)
    svc = FogService(ServiceConfig(data_dir=site.site.dir, site=site_name, fog_id=site.site.fog_id,
                                   mqtt_port=site.broker.port, tls=site.fog_tls, state_interval_s=1.0,
                                   summary_interval_s=5.0), site=site.site,
                     on_acl=site.broker.update_acl, on_crl=site.broker.update_crl).start()
    agents: dict[str, Any] = {}
    admin = site.site.issue_credentials("admin", "operator", tmp / "admin", time.time())

    def start_agent(dev_id: str, memory: int, labels: dict[str, str], flops: float = 5e9) -> None:
        """A device with what enrolment gives it (certificate, pinned fog key), over TLS."""
        d = tmp / "agents" / dev_id
        if not (d / "tls" / "cert.pem").exists():
            ident = load_identity(d, dev_id)
            site.site.add_device(dev_id, ident.public_key_bytes, time.time())
            site.site.ca.issue_bundle(d / "tls", dev_id, "device")
        prof = DeviceProfile(dev_id, flops=flops, memory_bytes=memory, uplink_bps=1e8, downlink_bps=1e8,
                             rtt_s=0.001, power_active_w=5.0, power_idle_w=2.0, labels=labels)
        fog = FogInfo(site.site.fog_id, site_name, svc.identity.public_key_bytes)
        from edge_agent.credentials import tls_config
        cfg = AgentConfig(device_id=dev_id, data_dir=d, host="127.0.0.1", port=site.broker.port,
                          site=site_name, labels=labels, state_interval_s=1.0, keepalive=5, intra_op_threads=1,
                          status_file=False, fog_key=fog.public_key, tls=tls_config(d, fog.fog_id))
        agents[dev_id] = make_agent(cfg, profile=prof).start()

    res: dict[str, Any] = {"workers": workers, "kills": kills}
    try:
        start_agent("cam", 1000, {"role": "source"}, 1e8)
        for i in range(workers):
            start_agent(f"w{i}", 700_000, {"role": "worker", "power-domain": f"pd{i}"})
        want = {"cam", *(f"w{i}" for i in range(workers))}
        _wait(lambda: set(svc.call(svc.registry.alive_ids)) >= want, 60, 0.05)
        c = FogClient("127.0.0.1", site.broker.port, credentials=admin)
        # plain deploys (baseline): one fresh workload at a time, send -> ack
        for k in range(3):
            c.deploy({"name": f"plain{k}", "model": "zoo:resnet", "source": "cam", "sink": "cam",
                      "selectors": {"role": "worker"}})
            c.wait_running(f"plain{k}", 30)
        c.delete("plain0"), c.delete("plain1"), c.delete("plain2")
        plain = list(svc.controller.deploy_latencies)
        c.deploy({"name": "res", "model": "zoo:resnet", "source": "cam", "sink": "cam",
                  "selectors": {"role": "worker"}})
        c.wait_running("res", 30)
        total, detect, recover = [], [], []
        for _ in range(kills):
            def host() -> str:
                devices: list[str] = svc.call(
                    lambda: [a.device for a in svc.controller.assignments_of("res")])
                return devices[0]
            victim = host()
            n_rec = len(svc.controller.recoveries)
            t_kill = time.monotonic()
            # the socket drops at once (as with kill -9); the agent's own threads wind down beside us,
            # so their joins are not counted as detection time
            stopper = threading.Thread(target=agents[victim].stop, kwargs={"crash": True}, daemon=True)
            stopper.start()

            def running_elsewhere(victim: str = victim) -> bool:
                return bool(svc.call(lambda: [a for a in svc.controller.assignments_of("res")
                                             if a.device != victim and a.phase.value == "running"]))
            if not _wait(running_elsewhere, 20, 0.002):
                res.setdefault("failed_kills", 0)
                res["failed_kills"] += 1
                continue
            t_run = time.monotonic()
            stopper.join(10)
            rec = svc.controller.recoveries[n_rec:]
            total.append(t_run - t_kill)
            if rec:
                recover.append(rec[0])
                detect.append(max(0.0, (t_run - t_kill) - rec[0]))
            start_agent(victim, 700_000, {"role": "worker", "power-domain": f"pd{victim[1:]}"})

            def back(victim: str = victim) -> bool:
                return victim in svc.call(svc.registry.alive_ids)
            _wait(back, 30, 0.02)
            time.sleep(0.3)
        c.close()

        def summary(xs: list[float]) -> dict[str, float]:
            return {"n": len(xs), "p50_s": round(pct(xs, 0.5), 4), "p99_s": round(pct(xs, 0.99), 4),
                    "max_s": round(max(xs), 4) if xs else float("nan")}
        res["plain_deploy_send_to_running"] = summary(plain)
        res["kill_to_replacement_running"] = summary(total)
        res["detection_to_replacement_running"] = summary(recover)
        res["kill_to_detection_est"] = summary(detect)
    finally:
        for a in agents.values():
            try:
                a.stop(timeout=1.0)
            except Exception:  # noqa: BLE001
                pass
        svc.stop()
        site.close()
    return res


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fog_bench")
    ap.add_argument("--quick", action="store_true", help="smaller run (~30 s)")
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--states", type=int, default=10, help="state adverts per agent")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--workers", type=int, default=6, help="worker agents in the failover fleet")
    ap.add_argument("--connections", type=int, default=4, help="publisher MQTT connections")
    ap.add_argument("--skip", choices=("ingest", "fairshare", "failover"), action="append", default=[])
    ap.add_argument("--rounds", type=int, default=2, help="off/on rounds of the fair-share comparison")
    args = ap.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.ERROR)
    if args.quick:
        args.states, args.kills = min(args.states, 5), min(args.kills, 8)
    out = run_header("fog", args.quick)
    with tempfile.TemporaryDirectory(prefix="fog-bench-") as d:
        tmp = Path(d)
        if "ingest" not in args.skip:
            out["ingest_cpu_single_thread"] = bench_cpu(200, 10)
            modes = [("processes", 2, "sig", False), ("processes", 2, "sig", True),
                     ("processes", 2, "mac", False), ("processes", 2, "mac", True)]
            if not args.quick:
                modes = [("threads", 1, "sig", True), ("threads", 2, "mac", True)] + modes
            out["ingest_mqtt"] = bench_ingest(args.agents, args.states, args.connections, modes, tmp)
        if "fairshare" not in args.skip:
            out["fair_share"] = bench_fair_share(args.agents, args.states, args.connections, args.rounds, tmp)
        if "failover" not in args.skip:
            out["failover"] = bench_failover(args.kills, args.workers, tmp)
    return report("fog", out, _human)


def _human(out: dict[str, Any]) -> str:
    lines = []
    cpu = out.get("ingest_cpu_single_thread")
    if cpu:
        lines.append(f"ingest (1 thread, CPU): decode-only {cpu['decode_only_per_s']}/s, "
                     f"verified {cpu['verified_per_s']}/s, session MAC {cpu['session_mac_per_s']}/s")
    ing = out.get("ingest_mqtt")
    if ing:
        lines.append(f"ingest via mosquitto ({ing['agents']} agents): transport only "
                     f"{ing['transport_only']['per_s']}/s; " + ", ".join(
                         f"{k[len('fog_'):]} {v['per_s']}/s" for k, v in ing.items() if k.startswith("fog_")))
    fs = out.get("fair_share")
    if fs:
        c = fs["cpu_single_thread"]
        lines.append(f"fair share, CPU per advert (1 thread): intake {c['intake_us_off']} us off, {c['intake_us_on']}"
                     f" us on; whole path {c['path_us_off']} us off, {c['path_us_on']} us on = "
                     f"{c['cpu_ratio_on_off']}x throughput (goal >= {fs['goal']}x)")
        lines.append(f"fair share via mosquitto ({fs['mode']}): limits on {fs['best_on']}/s vs off {fs['best_off']}/s"
                     f" = {fs['ratio_on_off']}x (best of {len(fs['per_s_on'])}; load {fs['loadavg']}); dropped with "
                     f"limits on: {fs['limited_with_limits_on'] or 'none'}")
    fo = out.get("failover")
    if fo and "kill_to_replacement_running" in fo:
        k, r, p = fo["kill_to_replacement_running"], fo["detection_to_replacement_running"], \
            fo["plain_deploy_send_to_running"]
        lines.append(f"failover: kill->running p50 {k['p50_s']} s p99 {k['p99_s']} s; detection->running p50 "
                     f"{r['p50_s']} s p99 {r['p99_s']} s; plain deploy p50 {p['p50_s']} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
