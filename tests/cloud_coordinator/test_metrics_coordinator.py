"""The coordinator's Prometheus metrics: real checkpoint, rollout, status, summary and outbox files -> metrics,
and the exporter scraped over HTTP(S) with prometheus_client's own parser."""
from __future__ import annotations

import json
import re
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_sites_config import creds_dir

from cloud_coordinator.metrics import METRICS, PREFIX, CoordinatorWatch, Source, families, serve
from cloud_coordinator.policy import CheckpointPolicy
from cloud_coordinator.release import build_release, write_release
from cloud_coordinator.rollout import (
    NewRelease,
    ProbeDone,
    ProbeSample,
    RolloutPolicy,
    Seen,
    SiteView,
    WorkloadView,
    model_ref,
)
from cloud_coordinator.settings import RELEASES_DIR
from cloud_coordinator.sites import SiteSpec, resolve, save_table, summaries_dir_of
from cloud_coordinator.siteservice import SiteService
from cloud_coordinator.store import Checkpoint, CheckpointStore
from cloud_coordinator.summaries import store_summary
from edge_agent.testing import FogSigner
from runtime import codec
from runtime.errors import LocalViolation
from runtime.messages import DeviceSummary, FleetSummary
from runtime.pki import SiteCA
from runtime.security import Identity

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(fams: Any) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value for fam in fams for s in fam.samples}


def value(got: Samples, name: str, **labels: str) -> float:
    return got[(f"{PREFIX}_{name}", frozenset(labels.items()))]


def _entry(rnd: int, accepted: list[str], rejected: dict[str, str], *, acc: float) -> dict[str, Any]:
    """A history entry as ``RobustStrategy._train_round`` and ``_run`` record it."""
    clients = sorted([*accepted, *rejected, "late"])
    return {"round": rnd, "clients": clients, "accepted": accepted, "rejected": rejected, "attempt": 1,
            "refused_nodes": {}, "no_reply": ["late"], "server": {"accuracy": acc, "loss": 1.0 - acc},
            "accuracy": acc}


def _view(version: int | None, sha: str, *wls: WorkloadView) -> SiteView:
    return SiteView({"m": (version, model_ref(sha))} if version is not None else {}, tuple(wls), {})


@pytest.fixture
def coordinator(tmp_path: Path) -> dict[str, Any]:
    """A checkpoint dir as a running ``fogline coordinator`` leaves it, written by the coordinator's own code."""
    work = tmp_path / "ckpt"
    dirs = (work, tmp_path / "replica-b", tmp_path / "replica-c")
    ident = Identity.generate("coordinator")
    store = CheckpointStore(dirs, CheckpointPolicy(keep=3), identity=ident)
    history: list[dict[str, Any]] = []
    rounds = [(["d1", "d2", "d3"], {"evil": "not selected"}),
              (["d1", "d2"], {"evil": "not selected", "d3": "bad array: shape (3,) != (4,)"}),
              (["d1", "d2", "d3"], {"evil": "non-finite values"}),
              (["d1", "d2", "d3"], {"evil": "not selected"})]
    # round 1 ran before a crash (run 0); rounds 2-4 in the resumed run (one resume): its elapsed time restarts
    extra = {1: (0, 10.0), 2: (1, 2.0), 3: (1, 5.0), 4: (1, 9.0)}
    for rnd, (acc, rej) in enumerate(rounds, 1):
        history.append(_entry(rnd, acc, rej, acc=0.5 + rnd / 10))
        restarts, elapsed = extra[rnd]
        store.save(Checkpoint(rnd, (np.ones(4, np.float32),), "cfg", {}, {}, tuple(history),
                              {"restarts": restarts, "elapsed_s": elapsed}, ("w",)))
    # replica c's newest payload rots: it no longer verifies there (the others still hold round 4)
    rotten = dirs[2] / "ckpt-00000004.bin"
    data = bytearray(rotten.read_bytes())
    data[-1] ^= 0xFF
    rotten.write_bytes(bytes(data))

    # two sites, a canary "a" and "b"; each with the coordinator credentials its fog issued
    fogs = {"a": FogSigner("fog-a", "a"), "b": FogSigner("fog-b", "b")}
    specs = [SiteSpec(n, str(creds_dir(tmp_path / "creds", n, fog, mqtt=f"127.0.0.1:{1883 + i}")))
             for i, (n, fog) in enumerate(fogs.items())]
    table = resolve(specs, "a", RolloutPolicy(allow_unchecked_canary=True))  # v1: nothing serves it yet
    save_table(work, table)
    svc = SiteService(work, table, ident)  # not started: driven by hand, it writes its files as it does live
    out = work / RELEASES_DIR
    rels = {v: build_release(b"onnx-bytes-%d" % v, ident, "m", v, {"round": str(v)}) for v in (1, 2)}
    files = {v: write_release(out, rel).name for v, rel in rels.items()}
    sha1, sha2 = rels[1].sha256, rels[2].sha256
    wl_old = WorkloadView("w", model_ref(sha1), 3, "running", 1, 1, 0.01, "", (3,))
    wl_new = WorkloadView("w", model_ref(sha2), 4, "running", 1, 1, 0.01, "", (4,))
    for ev in (NewRelease("m", 1, sha1, files[1]), Seen("a", _view(None, sha1)), Seen("a", _view(1, sha1)),
               Seen("b", _view(1, sha1)),                                     # v1: done on a and b
               NewRelease("m", 2, sha2, files[2]), Seen("a", _view(1, sha1, wl_old)),
               Seen("a", _view(2, sha2, wl_new))):                            # v2: accepted and switched at a
        svc.book.handle(ev, 1.0)
    assert svc.book.find("m", 1).step.value == "done"  # type: ignore[union-attr]
    assert svc.book.find("m", 2).step.value == "probe"  # type: ignore[union-attr]
    svc._save()
    now = time.time()
    svc.links["a"].info = {"reachable": True, "error": None, "last_contact_at": now - 3.0,
                           "summaries": {"accepted": 5, "refused": {"summary names another site": 1}}}
    svc.links["b"].info = {"reachable": False, "error": "no status answer", "last_contact_at": now - 100.0}
    svc._write_status()
    summary = FleetSummary("fog-a", "a", now - 7.0, (DeviceSummary("d1", True, 0.9, fit_for_training=True),
                                                     DeviceSummary("d2", True, 0.1, fit_for_training=False),
                                                     DeviceSummary("d3", False, 0.9, fit_for_training=True)))
    env = codec.decode_envelope(fogs["a"].signer.seal_bytes(summary, now))
    store_summary(summaries_dir_of(work, "a"), env, summary)
    sup = SimpleNamespace(restarts=2, generation=3, owned=True)
    source = Source(work, dirs, ident.public_key_bytes, rule="nnm+krum", release="m", checkpoint_mode="every-round",
                    rounds_target=5, started_at=now - 60.0)
    return {"work": work, "dirs": dirs, "watch": CoordinatorWatch(source, supervisor=sup, service=svc),
            "now": now, "svc": svc, "tmp": tmp_path, "table": table}


def test_the_coordinators_files_become_metrics(coordinator: dict[str, Any]) -> None:
    watch, now, dirs = coordinator["watch"], coordinator["now"], coordinator["dirs"]
    got = samples(families(watch.snapshot(now)))
    # rounds: four done (the newest verified checkpoint), the fifth under way
    assert value(got, "rounds_completed_total") == 4 and value(got, "round") == 5
    assert value(got, "rounds_target") == 5 and value(got, "run_done") == 0
    # round 4 took 4 s: two checkpoints of the same run, their elapsed time apart (not the crash before round 2)
    assert value(got, "round_duration_seconds") == pytest.approx(4.0)
    assert value(got, "round_clients", outcome="sent") == 5 and value(got, "round_clients", outcome="accepted") == 3
    assert value(got, "round_clients", outcome="no_reply") == 1
    assert value(got, "model_metric", metric="accuracy") == pytest.approx(0.9)
    # every rejection of the run, by rule and reason (the detail of 'bad array: ...' cut off)
    assert value(got, "rejections_total", rule="nnm+krum", reason="not selected") == 3
    assert value(got, "rejections_total", rule="nnm+krum", reason="bad array") == 1
    assert value(got, "rejections_total", rule="nnm+krum", reason="non-finite values") == 1
    # checkpoints: the rotten replica holds round 3 as its newest good one, and its bad file is counted once
    assert value(got, "checkpoint_round", replica=str(dirs[0])) == 4
    assert value(got, "checkpoint_round", replica=str(dirs[2])) == 3
    assert value(got, "checkpoints_invalid", replica=str(dirs[2])) == 1
    assert value(got, "checkpoints_invalid", replica=str(dirs[0])) == 0
    assert value(got, "checkpoint_verification_failures_total", reason="checksum mismatch") == 1
    assert value(got, "checkpoints_written_total") == 3  # rounds 2-4 (keep=3 pruned round 1 before we looked)
    assert value(got, "checkpoint_resumes_total") == 1
    assert 0 <= value(got, "checkpoint_age_seconds") < 60
    # releases: two in the outbox; v1 confirmed by both sites, v2 accepted by the canary and being checked there
    assert value(got, "releases_published_total", release="m") == 2
    assert value(got, "release_version", release="m") == 2
    assert value(got, "release_confirmations_total", release="m", site="a") == 2
    assert value(got, "release_confirmations_total", release="m", site="b") == 1
    assert value(got, "rollout_version", release="m") == 2
    assert value(got, "rollout_step", release="m", step="probe") == 1
    assert value(got, "rollout_state", release="m", site="a", state="checking") == 1
    assert value(got, "rollout_state", release="m", site="a", state="canary") == 0
    assert value(got, "rollout_state", release="m", site="b", state="waiting") == 1
    assert value(got, "rollouts", step="done") == 1 and value(got, "rollouts", step="probe") == 1
    # sites: a answers, b does not; a's verified summary: 2 live of 3, 1 fit
    assert value(got, "site_reachable", site="a") == 1 and value(got, "site_reachable", site="b") == 0
    assert value(got, "site_last_seen_age_seconds", site="b") == pytest.approx(100.0, abs=1.0)
    assert value(got, "site_devices", site="a", state="live") == 2
    assert value(got, "site_devices", site="a", state="fit") == 1
    assert value(got, "site_devices", site="a", state="total") == 3
    assert value(got, "site_summary_age_seconds", site="a") == pytest.approx(7.0, abs=1.0)
    assert (f"{PREFIX}_site_devices", frozenset({("site", "b"), ("state", "live")})) not in got  # no summary
    assert value(got, "site_summaries_total", site="a", outcome="summary names another site") == 1
    assert value(got, "site_info", site="a", role="canary", address="127.0.0.1:1883", fog_id="fog-a") == 1
    # what only this process sees
    assert value(got, "supervisor_restarts_total", component="run") == 2
    assert value(got, "supervisor_restarts_total", component="superlink") == 2
    assert value(got, "site_service_errors_total") == 0


def test_rollback_done_and_final_report(coordinator: dict[str, Any]) -> None:
    """The canary check fails: rolled back at the canary, never released to b; then the run's report lands."""
    svc, watch, now, work = coordinator["svc"], coordinator["watch"], coordinator["now"], coordinator["work"]
    bad = tuple(ProbeSample("w", True, "", "output 'y' differs (max |err| 0.9)", 0.01) for _ in range(4))
    cmds = svc.book.handle(ProbeDone("m", 2, bad), 2.0)
    svc._execute(cmds)  # writes the rollback release (v1's bytes as v3) to the outbox, as it does live
    r = svc.book.find("m", 2)
    assert r is not None and r.rollback == {"restores": 1, "as_version": 3}
    sha1 = svc.book.find("m", 1).sha256  # type: ignore[union-attr]
    svc.book.handle(Seen("a", _view(3, sha1)), 3.0)
    assert r.step.value == "rolled back"
    svc._save()
    report = {"config_hash": "cfg", "rounds": 5, "rounds_done": 5, "resumed_from": 3, "history": [
        _entry(i, ["d1", "d2"], {"evil": "not selected"}, acc=0.9) for i in range(1, 6)],
        "round_s": [1.0, 1.5, 2.5], "finished_at": now, "done": True}
    (work / "report.json").write_text(json.dumps(report))
    got = samples(families(watch.snapshot(now)))
    assert value(got, "rollout_state", release="m", site="a", state="rolled back") == 1
    assert value(got, "rollout_state", release="m", site="b", state="not released") == 1
    assert value(got, "rollout_step", release="m", step="rolled back") == 1
    assert value(got, "rollbacks_total", release="m") == 1
    assert value(got, "releases_published_total", release="m") == 2  # the rollback file is not a new release
    assert value(got, "release_version", release="m") == 3
    assert value(got, "release_confirmations_total", release="m", site="a") == 2  # v3 restores v1: not counted
    assert value(got, "run_done") == 1 and value(got, "rounds_completed_total") == 5 and value(got, "round") == 5
    assert value(got, "round_duration_seconds") == 2.5
    assert value(got, "rejections_total", rule="nnm+krum", reason="not selected") == 5
    # a report of an earlier run (before this coordinator started) is not this run's
    report["finished_at"] = now - 3600
    (work / "report.json").write_text(json.dumps(report))
    got = samples(families(watch.snapshot(now)))
    assert value(got, "run_done") == 0 and value(got, "rounds_completed_total") == 4


def test_checkpoints_seen_between_scrapes_are_counted_and_pruning_is_no_failure(tmp_path: Path) -> None:
    ident = Identity.generate("coordinator")
    store = CheckpointStore([tmp_path / "a"], CheckpointPolicy(keep=1), identity=ident)
    watch = CoordinatorWatch(Source(tmp_path / "a", (tmp_path / "a",), ident.public_key_bytes))
    for rnd in range(1, 4):
        store.save(Checkpoint(rnd, (np.zeros(2),), "cfg", history=({"round": rnd},)))
        watch.observe(float(rnd) * 10)   # the supervisor's poll
    # a checkpoint signed by another key is a failure; pruned ones are not
    other = CheckpointStore([tmp_path / "a"], CheckpointPolicy(keep=5), identity=Identity.generate("intruder"))
    other.save(Checkpoint(9, (np.zeros(2),), "cfg"))
    got = samples(families(watch.snapshot()))
    assert value(got, "checkpoints_written_total") == 3
    assert value(got, "checkpoint_round", replica=str(tmp_path / "a")) == 3
    assert value(got, "checkpoint_verification_failures_total", reason="bad signature") == 1
    assert len([k for k in got if k[0].endswith("verification_failures_total")]) == 1
    assert value(got, "rounds_completed_total") == 3


def _scrape(url: str, ctx: ssl.SSLContext | None = None) -> Samples:
    with urllib.request.urlopen(url, timeout=10, context=ctx) as resp:
        assert resp.status == 200
        return samples(text_string_to_metric_families(resp.read().decode()))


@pytest.mark.integration
def test_the_exporter_serves_them_over_http(coordinator: dict[str, Any]) -> None:
    server = serve(coordinator["watch"], 0)  # loopback: plain HTTP
    try:
        host, port = server.address
        assert host == "127.0.0.1" and not server.tls
        got = _scrape(f"http://{host}:{port}/metrics")
        assert value(got, "rounds_completed_total") == 4
        assert value(got, "rollout_state", release="m", site="a", state="checking") == 1
        assert value(got, "site_reachable", site="b") == 0
        assert value(got, "checkpoint_verification_failures_total", reason="checksum mismatch") == 1
        assert value(got, "info", rule="nnm+krum", release="m", checkpoint_mode="every-round") == 1
        assert (f"{PREFIX}_scrape_duration_seconds", frozenset()) in got
        assert not any(name.startswith(("python_", "process_")) for name, _ in got)  # its own registry
    finally:
        server.close()


@pytest.mark.integration
def test_off_loopback_it_takes_only_site_certificates_with_the_status_right(coordinator: dict[str, Any]) -> None:
    work, table, tmp = coordinator["work"], coordinator["table"], coordinator["tmp"]
    with pytest.raises(LocalViolation, match="TLS with client certificates"):
        serve(coordinator["watch"], 0, "0.0.0.0")
    cas = [s.creds.dir / "ca.pem" for s in table.sites]
    server = serve(coordinator["watch"], 0, "0.0.0.0", client_cas=cas, work_dir=work)
    try:
        assert server.tls
        url = f"https://127.0.0.1:{server.address[1]}/metrics"
        site_ca = SiteCA.load_or_create(tmp / "creds" / "a-ca", "a")   # the CA of site a's fog

        def client(role: str) -> ssl.SSLContext:
            bundle = site_ca.issue_bundle(tmp / f"client-{role}", f"prom-{role}", role)
            ctx = ssl.create_default_context(cafile=str(work / "superlink-tls" / "ca.pem"))
            ctx.load_cert_chain(bundle.cert_file, bundle.key_file)
            return ctx

        assert value(_scrape(url, client("monitor")), "rounds_completed_total") == 4
        with pytest.raises(urllib.error.HTTPError) as err:
            _scrape(url, client("app"))
        assert err.value.code == 403
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            _scrape(url, ssl.create_default_context(cafile=str(work / "superlink-tls" / "ca.pem")))
    finally:
        server.close()


def test_grafana_dashboard_queries_only_metrics_the_coordinator_exports() -> None:
    dash = json.loads((DEPLOY / "grafana" / "fogline-coordinator.json").read_text())
    assert dash["uid"] == "fogline-coordinator" and dash["panels"]
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", ())]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    exported = set()
    for short, (kind, _, _) in METRICS.items():
        base = f"{PREFIX}_{short}"
        exported |= {f"{base}_total"} if kind == "counter" else {base}
    used = {n for e in exprs for n in re.findall(rf"\b{PREFIX}_[a-z_]+\b", e)}
    assert used and used <= exported, used - exported
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"] if p["type"] != "row")
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    yaml = pytest.importorskip("yaml")
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "fogline-coordinator")
    assert job["metrics_path"] == "/metrics" and job["scheme"] == "https" and "cert_file" in job["tls_config"]
