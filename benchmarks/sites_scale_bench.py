"""Sites at scale, real processes: 3 secure sites x 300 agents, one coordinator, a staged release across faults.

Run: ``python -m benchmarks.sites_scale_bench [--quick]`` (or ``fogline bench sites_scale``). Prints JSON on
stdout, writes ``out/bench/sites_scale.json``, progress and a human summary on stderr.

Everything is a real process on this machine:

* per site: ``fogline broker`` (its own mosquitto with TLS, client certificates and the ACL, started by
  ``simulations.local_site.LocalSite``) and its agents, in a few ``simulations.agent_group`` processes,
  each agent enrolled over HTTPS with a bootstrap token and connected over TLS;
* the coordinator: a process running ``SiteService`` (what ``fogline coordinator`` and ``fogline sites
  release`` run for their sites) with one connection per site identity, each through its own WAN relay
  (``simulations.wan_relay.WanLink``, as in the site-autonomy test: a cut drops everything, closes nothing).
  Releases are put in its outbox the way its ServerApp does.

Each site serves ``svc`` (``release:okm``, 2 replicas) under a small load generator (a ``FogClient`` of
its own identity, straight to the site, every answer checked against onnxruntime's outputs of the
version it is on) and a few plain workloads. After ``okm v1`` is out and followed, two staged releases
are rolled out canary first (canary ``a``, then ``b``, then ``c``):

* baseline, ``okm v2``: no faults;
* faulted, ``okm v3``: the WAN link of site ``c`` (not the canary) is cut as the release is queued and
  healed ~20 s later; a couple of seconds in, an agent-group process at site ``b`` (a third of its
  agents, hosting a replica of ``svc``) is killed with -9.

Reported: time until every agent is live (per site and overall), per-site timelines of both rollouts
(the canary's check, when each site listed the version and when its ``svc`` served the new model on
every replica), the rollouts' total time and the faulted/baseline ratio, requests answered / failed /
wrong at each site during each rollout, the kill's repair time, summaries the coordinator received per
site (and how soon after the heal a fresh one from ``c`` arrived), peak RSS of the fog processes,
the agent processes and the coordinator. Every wait is bounded; every process started is killed in a
``finally``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._emit import emit, run_header
from simulations.wan_relay import WanLink

ROOT = Path(__file__).resolve().parents[1]
SITES = ("a", "b", "c")            # a: canary; b: the device kill; c: the WAN cut
CANARY, KILL_SITE, CUT_SITE = "a", "b", "c"
RELEASE = "okm"
FOG_ARGS = ["--state-interval", "2", "--startup-wait", "2", "--summary-interval", "2"]


def _log(msg: str) -> None:
    print(f"[sites_scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def _wait(pred: Callable[[], Any], timeout: float, what: str, step: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except Exception as exc:  # noqa: BLE001 - a process still starting answers with errors
            last = exc
        else:
            if last:
                return last
        time.sleep(step)
    raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}; last: {last!r}"[:2000])


# ---------------------------------------------------------------- the WAN relay


# ---------------------------------------------------------------- processes and memory


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def _tree(pid: int) -> list[int]:
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        todo += _children(p)
    return seen


def _hwm_mb(pid: int) -> float:
    """Peak resident set (VmHWM) of one live process, MB (0 if gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _killpg(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        pass


# ---------------------------------------------------------------- models


def _mlp(seed: int, hidden: int) -> bytes:
    """A 64 -> hidden -> 10 MLP (input x, output logits); each release a new hidden size (a new profile)."""
    import numpy as np

    from models import zoo

    r = np.random.default_rng(seed)
    w = [r.standard_normal((64, hidden)).astype(np.float32), r.standard_normal(hidden).astype(np.float32),
         r.standard_normal((hidden, 10)).astype(np.float32), r.standard_normal(10).astype(np.float32)]
    return bytes(zoo.mlp_from_weights(w, batch=1).SerializeToString())


def _ort(blob: bytes, x: Any) -> Any:
    import onnxruntime as ort

    return ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


# ---------------------------------------------------------------- one site


class BenchSite:
    """A secure fog site: ``fogline broker`` + mosquitto, agent-group processes, the coordinator's relay."""

    def __init__(self, name: str, tmp: Path, groups: int, per_group: int, interval: float) -> None:
        self.name, self.tmp = name, tmp
        self.groups, self.per_group, self.interval = groups, per_group, interval
        self.fog: Any = None
        self.relay: WanLink | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ids: dict[str, list[str]] = {}
        self.admin: Any = None
        self.cloud: Path | None = None
        self.load_creds: Path | None = None
        self.hwm: dict[str, float] = {}          # peak RSS of processes that were killed, taken before the kill

    @property
    def n_agents(self) -> int:
        return self.groups * self.per_group

    def start_fog(self) -> None:
        from simulations.local_site import LocalSite

        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.fog = LocalSite(self.tmp / f"fog-{self.name}", site=f"site-{self.name}", env=env,
                             log=self.tmp / f"fog-{self.name}.log", args=FOG_ARGS).start(120)
        self.cloud = self.fog.issue("cloud", role="coordinator")
        self.load_creds = self.fog.issue("load", role="operator")
        self.admin = self.fog.client()
        self.relay = WanLink(self.fog.port)

    def agents_of(self, g: int) -> list[dict[str, Any]]:
        out = []
        for j in range(self.per_group):
            if g == 0 and j == 0:
                aid, role = f"{self.name}-io", "io"              # source and sink of every workload
            else:
                aid = f"{self.name}g{g}-{j:03d}"
                role = "serve" if j in (1, 2) else "worker"
            out.append({"id": aid, "memory": 200_000_000, "flops": 5e9,
                        "labels": {"role": role, "power-domain": f"{self.name}-pd{g}"}})
        return out

    def start_agents(self) -> None:
        (self.tmp / "agents").mkdir(exist_ok=True)
        for g in range(self.groups):
            agents = self.agents_of(g)
            key = f"g{g}"
            self.ids[key] = [a["id"] for a in agents]
            self.procs[key] = self.fog.spawn_agents(agents, self.tmp / "agents" / self.name,
                                                    self.tmp / f"agents-{self.name}-{key}.log", interval=self.interval)

    def alive(self) -> int:
        want = {i for ids in self.ids.values() for i in ids}
        st = self.admin.status(timeout=10.0, limit=5000)
        return len({d["id"] for d in st["devices"] if d["alive"]} & want)

    def kill9(self, key: str) -> None:
        p = self.procs[key]
        self.hwm[key] = max((_hwm_mb(q) for q in _tree(p.pid)), default=0.0)
        _killpg(p)

    def memory(self) -> dict[str, Any]:
        fog = 0.0
        fog_procs = 0
        if self.fog is not None and self.fog.proc is not None and self.fog.proc.poll() is None:
            pids = _tree(self.fog.proc.pid)
            mq = self.fog._mosquitto_pid()
            if mq is not None and mq not in pids:
                pids.append(mq)
            vals = [_hwm_mb(p) for p in pids]
            fog, fog_procs = sum(vals), sum(v > 0 for v in vals)
        groups = dict(self.hwm)
        for key, p in self.procs.items():
            if p.poll() is None:
                groups[key] = max(groups.get(key, 0.0), _hwm_mb(p.pid))
        return {"fog_peak_rss_mb_sum": _r(fog, 1), "fog_processes": fog_procs,
                "agent_group_peak_rss_mb": {k: _r(v, 1) for k, v in sorted(groups.items())}}

    def close(self) -> None:
        if self.admin is not None:
            try:
                self.admin.close()
            except Exception as exc:  # noqa: BLE001 - teardown goes on
                _log(f"closing {self.name}'s admin client: {exc!r}")
        for p in self.procs.values():
            _killpg(p)
        if self.relay is not None:
            self.relay.close()
        if self.fog is not None:
            self.fog.kill()


# ---------------------------------------------------------------- load


class Load:
    """Closed-loop inference on ``svc`` from its own identity, straight to the site; every answer checked."""

    def __init__(self, site: BenchSite, x: Any, refs: dict[int, Any], period: float = 0.1) -> None:
        from fog_broker.client import FogClient

        self.site = site
        self.client = FogClient("127.0.0.1", site.fog.port, credentials=site.load_creds)
        self.x, self.refs, self.period = x, refs, period
        self.lock = threading.Lock()
        self.ok = self.failed = self.wrong = 0
        self.by_version: dict[int, int] = {}
        self.first_seen: dict[int, float] = {}     # version -> monotonic time of its first answer
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"load-{site.name}", daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {"ok": self.ok, "failed": self.failed, "wrong": self.wrong}

    def _run(self) -> None:
        import numpy as np

        while not self._stop.is_set():
            try:
                out = self.client.infer("svc", {"x": self.x}, timeout=5)["logits"]
                ver = next((v for v, ref in self.refs.items() if np.allclose(out, ref, rtol=1e-4, atol=1e-4)), None)
                with self.lock:
                    if ver is None:
                        self.wrong += 1
                    else:
                        self.ok += 1
                        self.by_version[ver] = self.by_version.get(ver, 0) + 1
                        self.first_seen.setdefault(ver, time.monotonic())
            except Exception as exc:  # noqa: BLE001 - counted and reported
                with self.lock:
                    self.failed += 1
                    if len(self.failures) < 20:
                        self.failures.append(f"{time.strftime('%H:%M:%S')} {type(exc).__name__}: {str(exc)[:160]}")
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)
        try:
            self.client.close()
        except Exception as exc:  # noqa: BLE001 - teardown goes on
            _log(f"closing the load client of {self.site.name}: {exc!r}")


# ---------------------------------------------------------------- the coordinator process


def coordinator_main(ck: Path) -> int:
    """The coordinator's site service as its own process (``fogline coordinator``'s sites half), until SIGTERM."""
    from cloud_coordinator.rollout import RolloutPolicy
    from cloud_coordinator.settings import key_path
    from cloud_coordinator.sites import load_table, resolve
    from cloud_coordinator.siteservice import SiteService
    from runtime.security import Identity

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    specs, canary, settings, insecure, _ = load_table(ck)
    table = resolve(specs, canary, RolloutPolicy.from_mapping(settings))
    signer = Identity.load_or_create("coordinator", key_path(ck, "coordinator.key"))
    service = SiteService(ck, table, signer, insecure=insecure).start()
    print("coordinator-started", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        service.stop()
    return 0


# ---------------------------------------------------------------- the bench


class Bench:
    def __init__(self, tmp: Path, groups: int, per_group: int, interval: float, cut_s: float, kill_at_s: float,
                 aux: int) -> None:
        self.tmp = tmp
        self.ck = tmp / "ck"
        self.sites = {n: BenchSite(n, tmp, groups, per_group, interval) for n in SITES}
        self.cut_s, self.kill_at_s, self.aux = cut_s, kill_at_s, aux
        self.coord: subprocess.Popen[bytes] | None = None
        self.loads: dict[str, Load] = {}
        self.blobs: dict[int, bytes] = {}
        self.signer: Any = None
        self.coord_hwm = 0.0

    # ------------------------------------------------------------ setup

    def start_coordinator(self) -> None:
        from cloud_coordinator.rollout import RolloutPolicy
        from cloud_coordinator.settings import key_path
        from cloud_coordinator.sites import SiteSpec, resolve, save_table
        from runtime.security import Identity

        specs = [SiteSpec(n, str(s.cloud), f"127.0.0.1:{s.relay.port}") for n, s in self.sites.items()]  # type: ignore
        # v1 is released before any workload serves it (they follow release:okm once it is there): the
        # canary cannot check it, by this explicit setting; v2 and v3 are checked there as ever
        table = resolve(specs, CANARY, RolloutPolicy.from_mapping({"allow_unchecked_canary": True}))
        save_table(self.ck, table)
        self.signer = Identity.load_or_create("coordinator", key_path(self.ck, "coordinator.key"))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        with open(self.tmp / "coordinator.log", "ab") as log:
            self.coord = subprocess.Popen([sys.executable, "-m", "benchmarks.sites_scale_bench", "--coordinator",
                                           str(self.ck)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)

    def coord_log(self, n: int = 3000) -> str:
        try:
            return (self.tmp / "coordinator.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def release(self, version: int, hidden: int) -> float:
        from cloud_coordinator.release import build_release, write_release
        from cloud_coordinator.settings import RELEASES_DIR

        self.blobs[version] = _mlp(version, hidden)
        write_release(self.ck / RELEASES_DIR, build_release(self.blobs[version], self.signer, RELEASE, version,
                                                            {"source": f"sites_scale_bench v{version}"}))
        return time.monotonic()

    def book_entry(self, version: int) -> dict[str, Any] | None:
        try:
            book = json.loads((self.ck / "rollouts.json").read_text())
        except (OSError, ValueError):
            return None
        return next((r for r in book.get("rollouts", []) if r["name"] == RELEASE and r["version"] == version), None)

    def status_json(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.ck / "sites" / "status.json").read_text()))
        except (OSError, ValueError):
            return {}

    def deploy_workloads(self) -> None:
        for n, s in self.sites.items():
            io = f"{n}-io"
            specs = [{"name": "svc", "model": f"release:{RELEASE}", "replicas": 2, "source": io, "sink": io,
                      "selectors": {"role": "serve"}, "max_partitions": 1}]
            specs += [{"name": f"aux{k}", "model": "zoo:mlp", "replicas": 2, "source": io, "sink": io,
                       "selectors": {"role": "worker"}} for k in range(self.aux)]
            s.admin.deploy({"workloads": specs}, timeout=60.0)
        for s in self.sites.values():
            for w in ["svc"] + [f"aux{k}" for k in range(self.aux)]:
                s.admin.wait_running(w, 90)

    # ------------------------------------------------------------ one rollout, watched

    def rollout(self, version: int, hidden: int, *, faults: bool, timeout: float) -> dict[str, Any]:
        from cloud_coordinator.rollout import site_view

        prev = self.blobs.get(version - 1)
        before = {n: dict(ld.counts()) for n, ld in self.loads.items()}
        load0 = os.getloadavg()[0]
        t0 = self.release(version, hidden)
        wall0 = time.time()
        kill: dict[str, Any] = {}
        cut: dict[str, Any] = {}
        steps: dict[str, float] = {}
        site_states: dict[str, dict[str, float]] = {n: {} for n in SITES}
        listed: dict[str, float] = {}
        switched: dict[str, float] = {}
        ref: str | None = None
        kill_thread: threading.Thread | None = None
        if faults:
            self.sites[CUT_SITE].relay.cut()  # type: ignore[union-attr]
            cut["at_s"] = _r(time.monotonic() - t0)
            kill_thread = threading.Thread(target=self._kill_and_repair, args=(t0, kill), name="kill", daemon=True)
            kill_thread.start()
        healed_at: float | None = None
        summary_after_heal: float | None = None
        published_during_cut = False
        done_at: float | None = None
        last_line = 0.0
        while time.monotonic() - t0 < timeout:
            now = time.monotonic()
            if faults and healed_at is None and now - t0 >= self.cut_s:
                self.sites[CUT_SITE].relay.heal()  # type: ignore[union-attr]
                healed_at = time.monotonic()
                cut["healed_at_s"] = _r(healed_at - t0)
                cut["wall_heal"] = time.time()
            r = self.book_entry(version)
            if r is not None:
                steps.setdefault(r["step"], now - t0)
                for n, st in r["sites"].items():
                    site_states[n].setdefault(st["state"], now - t0)
                if faults and healed_at is None and r["sites"].get(CUT_SITE, {}).get("state") == "published":
                    published_during_cut = True
            if faults and healed_at is None and "coordinator_saw_cut_s" not in cut:
                row = (self.status_json().get("sites") or {}).get(CUT_SITE) or {}
                if row.get("reachable") is False and str(row.get("error") or "").startswith("cut off"):
                    cut["coordinator_saw_cut_s"] = _r(now - t0)
            for n, s in self.sites.items():
                if n in listed and n in switched:
                    continue
                try:
                    view = site_view(s.admin.status(timeout=5.0, limit=0))
                except Exception:  # noqa: BLE001 - the kill's site may be slow to answer for a moment
                    continue
                rel = view.releases.get(RELEASE)
                if rel is not None and rel[0] >= version:
                    listed.setdefault(n, time.monotonic() - t0)
                    ref = rel[1]
                    w = view.workload("svc")
                    if (w is not None and w.model == rel[1] and w.status == "running" and w.healthy >= w.replicas
                            and not w.switching):
                        switched.setdefault(n, time.monotonic() - t0)
            if (faults and healed_at is not None and summary_after_heal is None
                    and self._summary_since(CUT_SITE, cut["wall_heal"])):
                summary_after_heal = time.monotonic()
            if r is not None and r["step"] in ("done", "rolled back", "failed") and done_at is None:
                done_at = time.monotonic()
            finished = (done_at is not None and len(switched) == len(SITES)
                        and (not faults or (healed_at is not None and summary_after_heal is not None
                                            and "repaired_s" in kill)))
            if finished or (done_at is not None and r is not None and r["step"] != "done"):
                break
            if now - last_line > 10:
                _log(f"  v{version}: {now - t0:.0f} s: step {r and r['step']}, listed {sorted(listed)}, "
                     f"switched {sorted(switched)}")
                last_line = now
            time.sleep(0.2)
        if kill_thread is not None:
            kill_thread.join(60)
        if faults and healed_at is None:
            self.sites[CUT_SITE].relay.heal()  # type: ignore[union-attr]
        r = self.book_entry(version) or {}
        after = {n: dict(ld.counts()) for n, ld in self.loads.items()}
        load: dict[str, dict[str, Any]] = {n: {k: after[n][k] - before[n][k] for k in ("ok", "failed", "wrong")}
                                           for n in self.loads}
        for n, ld in self.loads.items():
            fs = ld.first_seen.get(version)
            load[n]["first_new_answer_s"] = _r(fs - t0) if fs is not None and fs >= t0 else None
        out: dict[str, Any] = {
            "version": version, "faults": faults, "step": r.get("step"), "reason": r.get("reason") or None,
            "total_s": _r((done_at or time.monotonic()) - t0),
            "all_switched_s": _r(max(switched.values())) if len(switched) == len(SITES) else None,
            "steps_at_s": {k: _r(v) for k, v in steps.items()},
            "checks": r.get("checks"),
            # the canary passed its check when the rollout went on to the other sites
            "canary_check_s": _r(min([steps[k] for k in ("rolling", "done") if k in steps]
                                     + [t for n in SITES if n != CANARY for st, t in site_states[n].items()
                                        if st != "waiting"], default=None)),
            "sites": {n: {"coordinator_states_at_s": {k: _r(v) for k, v in site_states[n].items()},
                          "coordinator_state": (r.get("sites") or {}).get(n, {}).get("state"),
                          "listed_s": _r(listed.get(n)), "svc_switched_s": _r(switched.get(n)),
                          "load": load[n]} for n in SITES},
            "wall_start": wall0, "loadavg_at_start": round(load0, 2), "loadavg_at_end": round(os.getloadavg()[0], 2),
        }
        if faults:
            c = self.sites[CUT_SITE]
            cut.pop("wall_heal", None)
            cut.update({"site": CUT_SITE, "cut_s": _r((healed_at or time.monotonic()) - t0 - (cut["at_s"] or 0)),
                        "coordinator_published_during_cut": published_during_cut,
                        "listed_after_heal_s": _r(listed[CUT_SITE] - (healed_at - t0))
                        if healed_at is not None and CUT_SITE in listed else None,
                        "svc_switched_after_heal_s": _r(switched[CUT_SITE] - (healed_at - t0))
                        if healed_at is not None and CUT_SITE in switched else None,
                        "summary_after_heal_s": _r(summary_after_heal - healed_at)
                        if summary_after_heal is not None and healed_at is not None else None,
                        "relay_connections": c.relay.connections if c.relay else None})
            out["cut"] = cut
            out["kill"] = kill
        _ = prev, ref
        return out

    def _summary_since(self, site: str, wall: float) -> bool:
        from cloud_coordinator.sites import summaries_dir_of
        from cloud_coordinator.summaries import SiteKey, latest_summary
        from runtime.credentials import load_credentials

        fogk = load_credentials(self.sites[site].cloud).fog
        key = SiteKey(str(summaries_dir_of(self.ck, site)), fogk.fog_id, fogk.public_key.hex(), fogk.site)
        s = latest_summary(key)
        return s is not None and s.timestamp > wall

    def _kill_and_repair(self, t0: float, res: dict[str, Any]) -> None:
        """kill -9 an agent-group process at the kill site (one hosting an svc replica), time the repair."""
        s = self.sites[KILL_SITE]
        try:
            time.sleep(max(0.0, t0 + self.kill_at_s - time.monotonic()))
            st = s.admin.status(timeout=10.0, limit=0)
            hosts = {w["name"]: {p["device"] for rp in w["placement"] for p in rp["partitions"]}
                     for w in st["workloads"]}
            group_of = {i: g for g, ids in s.ids.items() for i in ids}
            score = {g: 0 for g in s.procs if g != "g0"}   # g0 holds the source/sink device
            svc_groups = {group_of.get(d) for d in hosts.get("svc", ())}
            for devs in hosts.values():
                for d in devs:
                    if group_of.get(d) in score:
                        score[group_of[d]] += 1
            victim = max(score, key=lambda g: (g in svc_groups, score[g], g))
            gone = set(s.ids[victim])
            hit = sorted(w for w, devs in hosts.items() if devs & gone)
            res.update({"site": KILL_SITE, "process": victim, "devices": len(gone), "workloads_hit": hit,
                        "partitions_hit": sum(len(devs & gone) for devs in hosts.values()),
                        "hosted_svc_replica": victim in svc_groups})
            tk = time.monotonic()
            res["at_s"] = _r(tk - t0)
            s.kill9(victim)
            _log(f"  kill -9 {KILL_SITE}/{victim} ({len(gone)} agents, workloads hit: {', '.join(hit) or '-'})")
            names = set(hosts)
            detected = None
            while time.monotonic() - tk < 120:
                st = s.admin.status(timeout=10.0, limit=5000)
                now = time.monotonic()
                alive = {d["id"] for d in st["devices"] if d["alive"]}
                if detected is None and not (alive & gone):
                    detected = now
                    res["detected_s"] = _r(now - tk)
                by = {w["name"]: w for w in st["workloads"]}
                if detected is not None and all(
                        n in by and by[n]["healthy_replicas"] >= by[n]["replicas"] and not any(
                            p["device"] in gone for rp in by[n]["placement"] for p in rp["partitions"])
                        for n in names):
                    res["repaired_s"] = _r(now - tk)
                    res["recoveries_s"] = [_r(x, 3) for x in (st.get("recoveries_s") or [])[-len(hit):]] if hit else []
                    return
                time.sleep(0.1)
            res["error"] = "not repaired within 120 s"
        except Exception as exc:  # noqa: BLE001 - reported in the JSON
            res["error"] = f"{type(exc).__name__}: {exc}"[:300]

    # ------------------------------------------------------------ teardown

    def close(self) -> None:
        for ld in self.loads.values():
            ld.stop()
        if self.coord is not None:
            self.coord_hwm = max((_hwm_mb(p) for p in _tree(self.coord.pid)), default=0.0) or self.coord_hwm
            if self.coord.poll() is None:
                try:
                    os.killpg(self.coord.pid, signal.SIGTERM)
                    self.coord.wait(15)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
            _killpg(self.coord)
        for s in self.sites.values():
            s.close()


def run(quick: bool, groups: int, per_group: int, cut_s: float, tmp: Path) -> dict[str, Any]:
    import numpy as np

    b = Bench(tmp, groups, per_group, interval=5.0, cut_s=cut_s, kill_at_s=2.0, aux=2 if quick else 4)
    res: dict[str, Any] = {"sites": len(SITES), "agents_per_site": groups * per_group,
                           "agent_processes_per_site": groups, "agents": len(SITES) * groups * per_group,
                           "canary": CANARY, "kill_site": KILL_SITE, "cut_site": CUT_SITE}
    try:
        t = time.monotonic()
        for s in b.sites.values():
            s.start_fog()
        res["fogs_start_s"] = _r(time.monotonic() - t)
        b.start_coordinator()
        _log(f"3 secure fogs up in {res['fogs_start_s']} s; starting {res['agents']} agents in "
             f"{len(SITES) * groups} processes")
        t_ramp = time.monotonic()
        for s in b.sites.values():
            s.start_agents()
        live: dict[str, float] = {}
        last = 0.0
        while len(live) < len(SITES):
            if time.monotonic() - t_ramp > 300:
                raise RuntimeError(f"agents not all live after 300 s: {live}")
            counts = {}
            for n, s in b.sites.items():
                if n in live:
                    continue
                try:
                    counts[n] = s.alive()
                except Exception:  # noqa: BLE001 - the fog is busy enrolling
                    continue
                if counts[n] >= s.n_agents:
                    live[n] = time.monotonic() - t_ramp
            if time.monotonic() - last > 10:
                _log(f"ramp {time.monotonic() - t_ramp:.0f} s: {counts} (live: {sorted(live)})")
                last = time.monotonic()
            time.sleep(0.5)
        res["all_agents_live_s"] = _r(max(live.values()))
        res["agents_live_per_site_s"] = {n: _r(v) for n, v in sorted(live.items())}
        _log(f"all {res['agents']} agents live after {res['all_agents_live_s']} s")

        # v1: the first release (nothing follows it yet), then every site serves release:okm
        t = time.monotonic()
        b.release(1, 32)
        _wait(lambda: (b.book_entry(1) or {}).get("step") == "done", 120, "okm v1 rolled out",
              step=0.3)
        for n, s in b.sites.items():
            _wait(lambda s=s: (s.admin.status(limit=0).get("releases") or {}).get(RELEASE),  # type: ignore[misc]
                  30, f"v1 at {n}")
        res["first_release_s"] = _r(time.monotonic() - t)
        _wait(lambda: b.coord is not None and b.coord.poll() is None, 1, "the coordinator running")
        t = time.monotonic()
        b.deploy_workloads()
        res["deploy_s"] = _r(time.monotonic() - t)
        x = np.random.default_rng(3).random((1, 64), dtype=np.float32)
        refs = {v: _ort(_mlp(v, h), x) for v, h in ((1, 32), (2, 48), (3, 64))}
        for n, s in b.sites.items():
            b.loads[n] = Load(s, x, refs).start()
        _wait(lambda: all(ld.counts()["ok"] >= 3 for ld in b.loads.values()), 30, "svc answering at every site")
        _log(f"v1 out in {res['first_release_s']} s; svc + {b.aux} workloads per site running; load on")

        _log("baseline: okm v2, no faults")
        base = b.rollout(2, 48, faults=False, timeout=180)
        res["baseline_rollout"] = base
        _log(f"baseline: {base['step']} in {base['total_s']} s (all svc switched {base['all_switched_s']} s)")
        if base["step"] != "done":
            raise RuntimeError(f"the baseline rollout did not finish: {base['step']} ({base['reason']}); "
                               f"load average {os.getloadavg()[0]:.1f}")
        time.sleep(2.0)
        _log(f"faulted: okm v3; link of {CUT_SITE} cut for {cut_s:g} s, kill -9 at {KILL_SITE} after 2 s")
        fault = b.rollout(3, 64, faults=True, timeout=240)
        _log(f"faulted: {fault['step']} in {fault['total_s']} s (all svc switched {fault['all_switched_s']} s)")
        time.sleep(1.0)
        res["faulted_rollout"] = fault
        if base["total_s"] and fault["total_s"]:
            res["rollout_time_ratio_faulted_vs_baseline"] = _r(fault["total_s"] / base["total_s"], 2)
        res["site_switch_ratio_faulted_vs_baseline"] = {
            n: _r(fault["sites"][n]["svc_switched_s"] / base["sites"][n]["svc_switched_s"], 2)
            if fault["sites"][n]["svc_switched_s"] and base["sites"][n]["svc_switched_s"] else None for n in SITES}
        if base["all_switched_s"] and fault["all_switched_s"]:
            res["all_switched_ratio_faulted_vs_baseline"] = _r(fault["all_switched_s"] / base["all_switched_s"], 2)
        st = b.status_json()
        res["summaries_received"] = {n: ((st.get("sites") or {}).get(n) or {}).get("summaries") for n in SITES}
        res["load_totals"] = {n: {**ld.counts(), "by_version": dict(sorted(ld.by_version.items())),
                                  "failures": ld.failures[:5]} for n, ld in b.loads.items()}
        mem = {n: s.memory() for n, s in b.sites.items()}
        fog_all = [m["fog_peak_rss_mb_sum"] or 0.0 for m in mem.values()]
        groups_all = [v for m in mem.values() for v in m["agent_group_peak_rss_mb"].values() if v]
        b.coord_hwm = max((_hwm_mb(p) for p in _tree(b.coord.pid)), default=0.0) if b.coord else 0.0
        res["memory"] = {"per_site": mem, "fog_peak_rss_mb_per_site_max": _r(max(fog_all), 1),
                         "agent_process_peak_rss_mb_max": _r(max(groups_all), 1) if groups_all else None,
                         "agent_processes_peak_rss_mb_sum": _r(sum(groups_all), 1),
                         "per_agent_mb": _r(max(groups_all) / per_group, 2) if groups_all else None,
                         "coordinator_peak_rss_mb": _r(b.coord_hwm, 1)}
        res["coordinator_alive"] = b.coord is not None and b.coord.poll() is None
        text = b.coord_log(10_000_000)
        res["coordinator_tracebacks"] = text.count("Traceback (most recent call last)")
        if res["coordinator_tracebacks"]:
            i = text.index("Traceback (most recent call last)")
            res["coordinator_first_traceback"] = text[max(0, i - 200):i + 1500]
        return res
    except Exception as exc:  # noqa: BLE001 - reported in the JSON, after the teardown
        _log("coordinator log tail:\n" + b.coord_log())
        res["error"] = f"{type(exc).__name__}: {exc}"[:1000]
        res["load_totals"] = {n: {**ld.counts(), "failures": ld.failures[:5]} for n, ld in b.loads.items()}
        return res
    finally:
        b.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sites_scale_bench", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 sites x 30 agents, a 25 s cut (a smoke test)")
    ap.add_argument("--agents", type=int, default=None, help="agents per site (default 300; quick 30)")
    ap.add_argument("--groups", type=int, default=3, help="agent-group processes per site (3)")
    ap.add_argument("--cut", type=float, default=None, help="seconds the WAN link of site c is cut (20; quick 25)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here (default out/bench/sites_scale.json)")
    ap.add_argument("--coordinator", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.coordinator is not None:
        return coordinator_main(args.coordinator)
    logging.basicConfig(level=logging.ERROR)
    q = args.quick
    per_site = args.agents or (30 if q else 300)
    groups = max(1, args.groups)
    per_group = max(3, -(-per_site // groups))
    # quick: the rollout reaches c within a few seconds, so a longer cut makes its republish find the link
    # known dead (paho detects it after 1.5 keepalives), as the full run's slower canary step does
    cut_s = args.cut if args.cut is not None else (25.0 if q else 20.0)
    out = run_header("sites_scale", q)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sites-scale-") as d:
        out.update(run(q, groups, per_group, cut_s, Path(d)))
    out["loadavg_at_end"] = round(os.getloadavg()[0], 2)
    out["bench_wall_s"] = round(time.monotonic() - t0, 1)
    emit("sites_scale", out, path=args.out)
    if out.get("error"):
        print(f"error: {out['error']}", file=sys.stderr)
        return 1
    print(_human(out), file=sys.stderr)
    return 0


def _human(out: dict[str, Any]) -> str:
    b, f = out["baseline_rollout"], out["faulted_rollout"]
    lines = [(f"{out['sites']} sites x {out['agents_per_site']} agents ({out['agent_processes_per_site']} "
              f"processes each): all {out['agents']} live in {out['all_agents_live_s']} s "
              f"{out['agents_live_per_site_s']}")]
    for key, r in (("baseline", b), ("faulted", f)):
        per = ", ".join(f"{n}: listed {s['listed_s']} s, svc switched {s['svc_switched_s']} s, "
                        f"{s['load']['ok']} ok / {s['load']['failed']} failed / {s['load']['wrong']} wrong"
                        for n, s in r["sites"].items())
        lines.append(f"{key} okm v{r['version']}: {r['step']} in {r['total_s']} s (canary check "
                     f"{r['canary_check_s']} s, all switched {r['all_switched_s']} s); {per}")
    k, c = f.get("kill") or {}, f.get("cut") or {}
    lines.append(f"kill -9 {k.get('site')}/{k.get('process')} ({k.get('devices')} agents, "
                 f"{k.get('partitions_hit')} partitions): detected {k.get('detected_s')} s, repaired "
                 f"{k.get('repaired_s')} s")
    lines.append(f"cut of {c.get('site')} for {c.get('cut_s')} s: listed {c.get('listed_after_heal_s')} s after the "
                 f"heal, svc switched {c.get('svc_switched_after_heal_s')} s after, fresh summary "
                 f"{c.get('summary_after_heal_s')} s after")
    lines.append(f"ratio faulted/baseline: total {out.get('rollout_time_ratio_faulted_vs_baseline')}, all switched "
                 f"{out.get('all_switched_ratio_faulted_vs_baseline')}; summaries {out['summaries_received']}")
    m = out["memory"]
    lines.append(f"peak RSS: fog (broker + verify workers + mosquitto) <= {m['fog_peak_rss_mb_per_site_max']} MB per "
                 f"site; agent process <= {m['agent_process_peak_rss_mb_max']} MB ({m['per_agent_mb']} MB per agent); "
                 f"coordinator {m['coordinator_peak_rss_mb']} MB")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
