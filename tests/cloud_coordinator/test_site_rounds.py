"""Two-level rounds in one process: the spool, the site server and the bridge between real strategies.

Each site is a ``RobustStrategy`` on an in-process Flower Grid (``_grid``,
real ``Message`` objects) served by ``site_server.serve``; the cloud's
nodes answer through ``bridge.site_reply``, exactly the code the fog's
SuperNode runs. The real-process version is
``tests/integration/test_hierarchical_rounds.py``.
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, RecordDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cloud_coordinator"))

from cloud_coordinator.app import load_app, stage
from cloud_coordinator.site_aggregator import spool as spool_mod
from cloud_coordinator.site_aggregator.bridge import site_reply
from cloud_coordinator.site_aggregator.cli import BRIDGE_COMPONENT
from cloud_coordinator.site_aggregator.site_server import serve
from cloud_coordinator.site_aggregator.spool import MAX_JOBS, Job, Outcome, Spool, SpoolFull
from cloud_coordinator.strategy import RobustStrategy, RoundConfig

from _grid import LocalGrid, pull_client

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _job(i: int = 0, deadline: float | None = None) -> Job:
    return Job(f"j{i}", 3, ("w", "b"), (np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 2], np.int64)),
               {"server-round": 3, "lr": 0.5, "name": "x", "flag": True, "blob": b"\x00\x01", "list": [1, 2]},
               time.time() + 30 if deadline is None else deadline)


def test_spool_round_trip_keeps_names_dtypes_shapes_and_config(tmp_path: Path) -> None:
    sp = Spool(tmp_path / "spool")
    sp.submit(_job())
    got = sp.take()
    assert got is not None and sp.take() is None  # taken once
    assert got.names == ("w", "b") and got.server_round == 3
    assert got.arrays[0].dtype == np.float32 and got.arrays[0].shape == (2, 3)
    assert np.array_equal(got.arrays[1], [1, 2]) and got.arrays[1].dtype == np.int64
    assert dict(got.config) == {"server-round": 3, "lr": 0.5, "name": "x", "flag": True, "blob": b"\x00\x01",
                                "list": [1, 2]}
    sp.finish(Outcome(got.job_id, got.names, got.arrays, 12.0, ("d0", "d1"), ("d0",), {"d1": "bad array: nan"}))
    out = sp.wait(got)
    assert out is not None and out.examples == 12.0 and out.rejected == {"d1": "bad array: nan"}
    assert np.array_equal(out.arrays[0], got.arrays[0])
    assert not any(sp.done.iterdir())  # read once, then gone


def test_spool_drops_expired_and_broken_jobs_and_is_bounded(tmp_path: Path) -> None:
    sp = Spool(tmp_path / "spool")
    sp.submit(_job(1, deadline=time.time() + 0.2))
    (sp.jobs / "000000000000999-garbage.job").write_bytes(b"\xc1not msgpack")
    time.sleep(0.3)
    assert sp.take() is None
    assert not any(sp.jobs.iterdir())
    for i in range(MAX_JOBS):
        sp.submit(_job(i))
    with pytest.raises(SpoolFull, match="is the site server running"):
        sp.submit(_job(99))


def test_spool_rejects_arrays_whose_bytes_do_not_match_their_shape(tmp_path: Path) -> None:
    import msgpack

    sp = Spool(tmp_path / "spool")
    doc = {"id": "x", "round": 1, "config": {}, "deadline": time.time() + 30, "created": time.time(),
           "arrays": [["w", "float32", [1000, 1000], b"\x00" * 16]]}
    (sp.jobs / f"{int((time.time() + 30) * 1000):015d}-x.job").write_bytes(msgpack.packb(doc))
    assert sp.take() is None  # dropped with a warning, never a 4 MB allocation from a 16-byte file


def test_wait_withdraws_the_job_at_its_deadline(tmp_path: Path) -> None:
    sp = Spool(tmp_path / "spool")
    job = _job(deadline=time.time() + 0.3)
    sp.submit(job)
    assert sp.wait(job, poll_s=0.05) is None
    assert not any(sp.jobs.iterdir())


def _site(target: float, attacks: dict[int, str], n: int, sp: Spool, rounds: int) -> threading.Thread:
    grid = LocalGrid()
    for i in range(n):
        grid.add(pull_client(np.float32(target), attack=attacks.get(i, ""), noise_seed=i))
    strategy = RobustStrategy("trimmed_mean", f=1,
                              rounds=RoundConfig(min_train_nodes=3, round_timeout=5, grace=0.1, max_attempts=1,
                                                 fraction_evaluate=0.0))
    t = threading.Thread(target=serve, args=(grid, strategy, sp), kwargs={"max_jobs": rounds}, daemon=True)
    t.start()
    return t


def _bridge_client(sp: Spool, attack: str = ""):  # type: ignore[no-untyped-def]
    def fn(msg: Message) -> RecordDict | Error:
        reply = site_reply(msg, sp)
        if reply.has_error():
            return reply.error
        if attack == "sign-flip":  # a Byzantine fog: its aggregate reversed and amplified
            rec = reply.content["arrays"]
            base = msg.content["arrays"]
            flipped = {k: Array(base[k].numpy() - 10 * (rec[k].numpy() - base[k].numpy())) for k in rec}
            return RecordDict({"arrays": ArrayRecord(flipped), "metrics": reply.content["metrics"]})
        return reply.content
    return fn


def test_two_level_round_outvotes_a_byzantine_device_and_a_byzantine_site(tmp_path: Path) -> None:
    rounds = 3
    cloud = LocalGrid()  # sets Flower's task identity for the Messages every thread creates
    spools = {s: Spool(tmp_path / s) for s in ("a", "b", "c")}
    threads = [_site(1.0, {3: "nan"}, 4, spools["a"], rounds),      # a NaN device: rejected at its site
               _site(1.0, {0: "sign-flip"}, 3, spools["b"], rounds),  # a sign-flipper: trimmed at its site
               _site(1.0, {}, 3, spools["c"], rounds)]
    keys = {}
    for s, attack in (("a", ""), ("b", ""), ("c", "sign-flip")):
        key = f"key-{s}".encode()
        keys[s] = key
        cloud.add(_bridge_client(spools[s], attack), public_key=key)
    strategy = RobustStrategy("median", f=1, node_devices={},
                              rounds=RoundConfig(min_train_nodes=3, round_timeout=20, grace=0.1, fraction_evaluate=0.0))
    strategy.node_devices = None
    initial = ArrayRecord({"w": Array(np.zeros((4, 3), np.float32)), "b": Array(np.zeros(3, np.float32))})
    entries = []
    arrays = initial
    for rnd in range(1, rounds + 1):
        new, _, entry = strategy.train_round(cloud, rnd, arrays, ConfigRecord({"lr": 0.5}))
        assert new is not None, entry
        arrays = new
        entries.append(entry)
    for t in threads:
        t.join(10)
    final = np.concatenate([a.numpy().ravel() for a in arrays.values()])
    assert np.allclose(final, 1.0 - 0.5 ** rounds, atol=0.05), final  # honest pull towards 1.0, unharmed
    for e in entries:
        sites = e["sites"]
        assert len(sites) == 3
        by_clients = sorted(int(v["site-clients"]) for v in sites.values())
        assert by_clients == [3, 3, 4]
        a = next(v for v in sites.values() if v["site-clients"] == 4)
        assert a["site-rejected"] == 1 and a["site-accepted"] == 3
        assert [k for k in a if k.startswith("site-rejected-") and a[k] == 1], a  # the reason, by name


def test_a_site_that_cannot_aggregate_is_an_error_reply_not_a_hang(tmp_path: Path) -> None:
    cloud = LocalGrid()
    sp = Spool(tmp_path / "a")
    _site(1.0, {}, 2, sp, 1)  # two devices: trimmed mean with f=1 needs three
    cloud.add(_bridge_client(sp))
    strategy = RobustStrategy("mean", f=0,
                              rounds=RoundConfig(min_train_nodes=1, round_timeout=20, grace=0.1,
                                                 fraction_evaluate=0.0, max_attempts=1, min_available_nodes=1))
    initial = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    t0 = time.monotonic()
    new, _, entry = strategy.train_round(cloud, 1, initial, ConfigRecord({}))
    assert new is None and time.monotonic() - t0 < 15  # the site's 5 s wait, not the cloud's deadline
    assert list(entry["rejected"].values()) == ["client error (flower 3001: the site's round failed: trimmed_mean "
                                                "with f=1 needs 3 clients, 2 eligible of 2 connected)"]


def test_stage_replaces_a_component_with_a_shim_flower_can_find(tmp_path: Path) -> None:
    from flwr.supercore.object_ref import validate

    spec = load_app(REPO / "examples" / "digits")
    dest = stage(spec, tmp_path / "app", {}, components={"clientapp": BRIDGE_COMPONENT})
    import tomllib

    doc = tomllib.loads((dest / "pyproject.toml").read_text())
    comps = doc["tool"]["flwr"]["app"]["components"]
    assert comps["clientapp"] == "fogline_clientapp:app"
    assert comps["serverapp"] == spec.serverapp  # the user's other half stays
    ok, why = validate(comps["clientapp"], check_module=True, project_dir=dest)
    assert ok, why
    with pytest.raises(Exception, match="cannot replace component"):
        stage(spec, tmp_path / "app2", {}, components={"superexec": "x:y"})


def test_spool_module_has_no_flower_import() -> None:
    src = Path(spool_mod.__file__).read_text()
    assert "flwr" not in src  # the fog host's hand-off needs no Flower


@pytest.mark.parametrize("extra,message", [
    (["--cloud", "127.0.0.1:9"], "--cloud needs --cloud-ca"),
    (["--cloud", "127.0.0.1:9", "--cloud-ca", "/nonexistent/ca.pem", "--cloud-key", "/nonexistent/k"],
     "--cloud-ca: /nonexistent/ca.pem does not exist"),
    (["--rule", "nope"], "unknown aggregation rule 'nope'"),
    (["--listen", "0.0.0.0:9", "--no-supernode-auth"], "refused for SuperLink address 0.0.0.0"),
    (["--site", "a b"], "site name 'a b'"),
])
def test_site_aggregator_bad_input_is_one_line(extra: list[str], message: str, tmp_path: Path) -> None:
    import subprocess

    argv = [str(Path(sys.executable).parent / "fogline"), "site-aggregator", "--app", str(REPO / "examples" / "digits"),
            "--work-dir", str(tmp_path / "w"), "--site", "s1", *extra]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
