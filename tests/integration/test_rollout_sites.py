"""Staged rollouts across three real sites: `fogline broker` x 3 (TLS, ACL), enrolled agents, `fogline sites`.

* a release goes to the canary, is checked there (accepted, its ``release:`` workload redeployed,
  a held-out batch answered with the coordinator's own onnxruntime outputs, latency within the
  plan) and then to the other sites in order;
* a release whose outputs the canary cannot reproduce (a random-noise model) is rolled back
  (the previous model's bytes as a new version) and never reaches the other sites;
* a rollout killed (-9) while a site is down resumes where it stopped once the site is back;
* bad input (wrong role, unknown site, a fog key that does not match, a release the canary
  refuses) is one line, and nothing already done is lost.
Every wait is bounded; every process is killed in teardown.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime.broker import find_mosquitto

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

if find_mosquitto() is None:  # pragma: no cover - make test installs it
    pytest.skip("mosquitto not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
SITES = ("a", "b", "c")


def _wait(pred: Any, timeout: float, what: str, step: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except TimeoutError as exc:  # one status request unanswered on a busy machine: ask again
            last = exc
        if last and not isinstance(last, TimeoutError):
            return last
        time.sleep(step)
    raise AssertionError(f"timed out waiting for {what}: {last!r}")


def _mlp(seed: int, hidden: int) -> bytes:
    """A 64 -> hidden -> 10 MLP (input x, output logits): another hidden size is another placement profile."""
    from models import zoo

    r = np.random.default_rng(seed)
    w = [r.standard_normal((64, hidden)).astype(np.float32), r.standard_normal(hidden).astype(np.float32),
         r.standard_normal((hidden, 10)).astype(np.float32), r.standard_normal(10).astype(np.float32)]
    return zoo.mlp_from_weights(w, batch=1).SerializeToString()


def _noisy() -> bytes:
    """Same inputs and outputs, but logits + RandomUniformLike noise: no run reproduces another's outputs."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(5).standard_normal((64, 10)).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]),
             helper.make_node("RandomUniformLike", ["y"], ["noise"], low=0.0, high=1.0),
             helper.make_node("Add", ["y", "noise"], ["logits"])]
    g = helper.make_graph(nodes, "noisy", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m.SerializeToString()


def _ort(blob: bytes, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


class Fleet:
    """Three sites with two agents each, and the coordinator credentials each fog issued."""

    def __init__(self, tmp: Path) -> None:
        from simulations.local_site import LocalSite

        self.tmp = tmp
        self.sites: dict[str, Any] = {}
        self.agents: list[subprocess.Popen[bytes]] = []
        self.creds: dict[str, Path] = {}
        self.admins: dict[str, Any] = {}
        self.LocalSite = LocalSite
        self.args = ["--state-interval", "1", "--startup-wait", "2", "--summary-interval", "1"]
        for n in SITES:
            self.sites[n] = LocalSite(tmp / f"fog-{n}", site=f"site-{n}", log=tmp / f"fog-{n}.log",
                                      args=self.args).start()
        for n, s in self.sites.items():
            self.creds[n] = s.issue("cloud", role="coordinator")
            self.agents.append(s.spawn_agents(
                [{"id": f"{n}{i}", "memory": 50_000_000, "flops": 5e9, "labels": {"power-domain": f"pd{i}"}}
                 for i in range(2)], tmp / f"agents-{n}", tmp / f"agents-{n}.log"))
        for n, s in self.sites.items():
            self.admins[n] = s.client()
            _wait(lambda c=self.admins[n]: sum(d["alive"] for d in c.status()["devices"]) >= 2, 60,
                  f"two agents alive at {n}")

    def restart(self, n: str) -> None:
        old = self.sites[n]
        self.admins.pop(n).close()
        old.stop()
        self.sites[n] = self.LocalSite(old.data_dir, site=old.site, port=old.port, log=self.tmp / f"fog-{n}-2.log",
                                       args=self.args).start()
        self.admins[n] = self.sites[n].client()

    def site_args(self, *names: str) -> list[str]:
        return [a for n in names or SITES for a in ("--site", f"{n}={self.creds[n]}")]

    def release_of(self, site: str, name: str) -> dict[str, Any] | None:
        return (self.admins[site].status(limit=0).get("releases") or {}).get(name)

    def follow(self, site: str, workload: str, release: str) -> None:
        """An operator serves release:NAME at a site (it needs a release there first)."""
        c = self.admins[site]
        c.deploy({"name": workload, "model": f"release:{release}", "source": f"{site}0", "sink": f"{site}1"})
        c.wait_running(workload, 30)

    def close(self) -> None:
        for c in self.admins.values():
            c.close()
        for s in self.sites.values():
            s.kill()
        for p in self.agents:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait(5)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    try:
        yield f
    finally:
        f.close()


def sites_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "runtime.cli", "-v", "sites", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def sites_proc(*argv: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "runtime.cli", "-v", "sites", *argv], stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)


def test_staged_rollout_reaches_every_site_in_order(fleet: Fleet, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    (tmp_path / "v1.onnx").write_bytes(_mlp(1, 32))
    (tmp_path / "v2.onnx").write_bytes(_mlp(2, 48))
    r = sites_cli("release", str(tmp_path / "v1.onnx"), "--name", "okm", "--checkpoint-dir", str(ck),
                  *fleet.site_args("a", "b", "c"), "--canary", "b",
                  "--rollout-set", "allow_unchecked_canary=true")  # a first release: nothing to probe
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rollout okm v1: done on b, a, c" in r.stdout
    assert "canary b serves no workload from release:okm" in (ck / "rollouts.json").read_text()
    fleet.follow("b", "okw", "okm")   # the canary serves it, and so does a
    fleet.follow("a", "okw", "okm")
    t0 = time.monotonic()
    r = sites_cli("release", str(tmp_path / "v2.onnx"), "--name", "okm", "--checkpoint-dir", str(ck))  # saved sites
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rollout okm v2: done on b, a, c" in r.stdout
    log = r.stderr
    assert "okm v2: published to canary b (it runs v1; it serves okw from the release)" in log
    assert "okm v2: canary b passed: held-out batch: 8/8 answered, outputs equal; okw p50" in log
    # in order: the canary passed before anyone else got it, then a, then c
    assert log.index("canary b passed") < log.index("site a: sent okm v2") < log.index("okm v2: site a has it") \
        < log.index("site c: sent okm v2") < log.index("okm v2: site c has it")
    from cloud_coordinator.release import read_release

    v2 = read_release(ck / "releases" / "okm-v000000002.release")
    for n in SITES:
        rel = fleet.release_of(n, "okm")
        assert rel is not None and rel["version"] == 2 and rel["model"] == f"file:{v2.sha256}", (n, rel)
        assert rel["signer"] == "cloud"
    x = np.random.default_rng(9).random((1, 64), dtype=np.float32)
    for n in ("a", "b"):
        fleet.admins[n].wait_running("okw", 30)
        _wait(lambda c=fleet.admins[n]: np.allclose(c.infer("okw", {"x": x})["logits"], _ort(v2.artifact, x),
                                                    atol=1e-4), 20, f"v2 served at {n}")
    st = sites_cli("status", "--checkpoint-dir", str(ck), "--json")
    assert st.returncode == 0, st.stderr
    doc = json.loads(st.stdout)
    assert [s["name"] for s in doc["sites"]] == ["b", "a", "c"] and doc["canary"] == "b"
    assert not doc["coordinator_running"]
    for s in doc["sites"]:
        assert s["releases"] == {"okm": 2} and s["devices_live"] == 2 and s["devices_fit"] is not None
        assert s["summary_at"] is not None and time.time() - s["summary_at"] < 60
        assert s["rollouts"]["okm v2"] == "accepted"
    text = sites_cli("status", "--checkpoint-dir", str(ck))
    assert text.returncode == 0 and "rollout okm v2: done on b, a, c" in text.stdout
    published = json.loads((ck / "releases" / "published.json").read_text())
    assert published["okm-v000000002.release"]["sites"] == ["a", "b", "c"]
    print(f"\nstaged rollout of okm v2 over 3 sites (canary checked) in {took:.1f} s")


def test_failed_canary_check_is_rolled_back_and_goes_no_further(fleet: Fleet, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    toml = tmp_path / "sites.toml"
    toml.write_text("[rollout]\nprobe_requests = 4\nallow_unchecked_canary = true\n\n" + "".join(
        f'[sites.{n}]\ncredentials = "{fleet.creds[n]}"\n' + ("canary = true\n" if n == "c" else f"order = {i}\n")
        for i, n in enumerate(("b", "a", "c"))))
    good, bad = _mlp(3, 32), _noisy()
    (tmp_path / "good.onnx").write_bytes(good)
    (tmp_path / "bad.onnx").write_bytes(bad)
    r = sites_cli("release", str(tmp_path / "good.onnx"), "--name", "badm", "--checkpoint-dir", str(ck),
                  "--sites", str(toml))
    assert r.returncode == 0 and "rollout badm v1: done on c, b, a" in r.stdout, r.stderr[-3000:]
    fleet.follow("c", "badw", "badm")
    r = sites_cli("release", str(tmp_path / "bad.onnx"), "--name", "badm", "--checkpoint-dir", str(ck))
    assert r.returncode == 1, r.stderr[-3000:]
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and err[0].startswith(
        "error: rollout of badm v2 stopped (rolled back): canary c: 4/4 held-out outputs differ from the "
        "coordinator's run (badw: output 'logits' differs (max |err|"), err
    assert "rolled back: canary c runs v1's model again (as v3)" in err[0]
    # the other sites never got v2; the canary lists v3, which is v1's bytes, and serves them again
    from cloud_coordinator.release import read_release

    v1 = read_release(ck / "releases" / "badm-v000000001.release")
    v3 = read_release(ck / "releases" / "badm-v000000003.release")
    assert v3.artifact == v1.artifact and v3.metadata["rollback-of"] == "2" and v3.metadata["restores"] == "1"
    for n in ("a", "b"):
        assert fleet.release_of(n, "badm")["version"] == 1
    rel = fleet.release_of("c", "badm")
    assert rel["version"] == 3 and rel["model"] == f"file:{v1.sha256}"
    x = np.random.default_rng(4).random((1, 64), dtype=np.float32)
    _wait(lambda: np.allclose(fleet.admins["c"].infer("badw", {"x": x})["logits"], _ort(good, x), atol=1e-4), 30,
          "the canary serving v1's model again")
    book = json.loads((ck / "rollouts.json").read_text())
    last = book["rollouts"][-1]
    assert (last["version"], last["step"]) == (2, "rolled back") and last["rollback"] == {"restores": 1,
                                                                                         "as_version": 3}
    assert {s: st["state"] for s, st in last["sites"].items()} == {"c": "accepted", "b": "waiting", "a": "waiting"}
    assert book["good"] == {"badm": 1}
    st = json.loads(sites_cli("status", "--checkpoint-dir", str(ck), "--json").stdout)
    assert any(r["line"].startswith("rollout badm v2: rolled back: canary c:") for r in st["rollouts"])


def test_rollout_survives_kill9_and_a_site_that_is_down(fleet: Fleet, tmp_path: Path) -> None:
    """Site c is down: the rollout waits for it (bounded); a kill -9 of the coordinator side there; once c is
    back, `fogline sites resume` finishes it from the saved state without repeating the canary check."""
    ck = tmp_path / "ck"
    (tmp_path / "r1.onnx").write_bytes(_mlp(7, 32))
    fleet.sites["c"].stop()
    try:
        proc = sites_proc("release", str(tmp_path / "r1.onnx"), "--name", "resm", "--checkpoint-dir", str(ck),
                          *fleet.site_args("a", "b", "c"), "--rollout-set", "site_timeout_s=300",
                          "--rollout-set", "allow_unchecked_canary=true",
                          log=tmp_path / "release.log")

        def at_c() -> bool:
            try:
                r = json.loads((ck / "rollouts.json").read_text())["rollouts"][-1]
            except (OSError, ValueError, IndexError, KeyError):
                return False
            return r["step"] == "rolling" and r["sites"]["c"]["state"] == "published"

        _wait(at_c, 60, "the rollout waiting for site c")
        # status.json starts with every site "not connected yet": wait for the picture this test is about
        st = _wait(lambda: (lambda d: d if d["sites"]["c"].get("error") and d["sites"]["a"].get("reachable")
                            else None)(json.loads((ck / "sites" / "status.json").read_text())), 20,
                   "site c reported unreachable while a answers")
        assert st["sites"]["c"]["reachable"] is False and st["sites"]["a"]["reachable"] is True
        shown = sites_cli("status", "--checkpoint-dir", str(ck))
        assert "coordinator running" in shown.stdout and "resm v1 at rolling, waiting for site c to list v1" in \
            shown.stdout, shown.stdout
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        fleet.restart("c")
    assert fleet.release_of("c", "resm") is None
    r = sites_cli("resume", "--checkpoint-dir", str(ck), "--wait", "60")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rollout resm v1: done on a, b, c" in r.stdout
    assert "resm v1: resuming the rollout at step rolling" in r.stderr
    assert "published to canary" not in r.stderr   # the canary step is not repeated
    assert fleet.release_of("c", "resm")["version"] == 1


def test_bad_input_is_one_line_and_loses_nothing(fleet: Fleet, tmp_path: Path) -> None:
    import shutil

    ck = tmp_path / "ck"
    model = tmp_path / "m.onnx"
    model.write_bytes(_mlp(11, 32))
    # an operator's credentials are not a coordinator's
    admin = fleet.sites["a"].credentials("admin")
    r = sites_cli("release", str(model), "--name", "bim", "--checkpoint-dir", str(ck), "--site", f"a={admin}")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"error: site a: {admin} holds 'operator' credentials (admin); a coordinator needs its own: fogline "
        "operators add NAME --role coordinator --data-dir FOGDIR on that site's fog")
    # an unknown site
    r = sites_cli("release", str(model), "--name", "bim", "--checkpoint-dir", str(ck), *fleet.site_args("a", "b"),
                  "--canary", "zz")
    assert r.returncode == 2 and "error: unknown site 'zz' for --canary (sites: a, b)" in r.stderr
    assert not (ck / "releases").exists()
    # a site whose pinned fog key is another fog's: every answer is refused, the canary never checks in
    wrong = tmp_path / "b-wrong-key"
    shutil.copytree(fleet.creds["b"], wrong)
    fog = json.loads((wrong / "fog.json").read_text())
    fog["public_key"] = json.loads((fleet.creds["c"] / "fog.json").read_text())["public_key"]  # (a's: refused up front)
    (wrong / "fog.json").write_text(json.dumps(fog))
    r = sites_cli("release", str(model), "--name", "bim", "--checkpoint-dir", str(ck), "--site", f"b={wrong}",
                  "--site", f"a={fleet.creds['a']}", "--rollout-set", "baseline_timeout_s=8", "--wait", "60")
    assert r.returncode == 1, r.stderr[-3000:]
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("error:"))
    print(f"\n{line}")
    assert line.startswith("error: rollout of bim v1 stopped (failed): canary b did not answer within 8 s (last "
                           "error: "), line
    assert f"not sealed by the fog key pinned in {wrong}/fog.json" in line and "bim v1 was not released anywhere" \
        in line
    assert fleet.release_of("a", "bim") is None and fleet.release_of("b", "bim") is None
    assert (ck / "releases" / "bim-v000000001.release").exists()   # nothing lost: fix the site, release again
    assert json.loads((ck / "rollouts.json").read_text())["rollouts"][-1]["step"] == "failed"
    st = sites_cli("status", "--checkpoint-dir", str(ck), "zz")
    assert st.returncode == 2 and st.stderr.strip() == "error: unknown site 'zz' (sites: b, a)"
    # a release the canary refuses: okm-like names stay bound to the coordinator that released them first
    other = fleet.sites["a"].issue("cloud-2", role="coordinator")
    ck2 = tmp_path / "ck2"
    r = sites_cli("release", str(model), "--name", "bim", "--checkpoint-dir", str(ck2), "--site", f"a={other}",
                  "--rollout-set", "allow_unchecked_canary=true")
    assert r.returncode == 0, r.stderr[-3000:]   # bim is cloud-2's at site a now
    other_model = tmp_path / "m2.onnx"  # other bytes: the same ones would be "unchanged, not released" (issue 28)
    other_model.write_bytes(_mlp(12, 32))
    r = sites_cli("release", str(other_model), "--name", "bim", "--version", "5", "--checkpoint-dir", str(ck),
                  "--site", f"a={fleet.creds['a']}", "--site", f"b={fleet.creds['b']}")
    assert r.returncode == 1, r.stderr[-3000:]
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("error:"))
    assert line == "error: rollout of bim v5 stopped (failed): canary a refused bim v5: release 'bim' belongs " \
                   "to another coordinator", line
    assert fleet.release_of("b", "bim") is None


def test_retrained_same_architecture_release_passes_the_canary(fleet: Fleet, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    (tmp_path / "s1.onnx").write_bytes(_mlp(20, 32))
    (tmp_path / "s2.onnx").write_bytes(_mlp(21, 32))   # retrained weights, same graph
    r = sites_cli("release", str(tmp_path / "s1.onnx"), "--name", "samem", "--checkpoint-dir", str(ck),
                  *fleet.site_args("a", "b"), "--rollout-set", "serve_timeout_s=6",
                  "--rollout-set", "allow_unchecked_canary=true")
    assert r.returncode == 0, r.stderr[-3000:]
    fleet.follow("a", "samew", "samem")
    r = sites_cli("release", str(tmp_path / "s2.onnx"), "--name", "samem", "--checkpoint-dir", str(ck))
    assert r.returncode == 0, next((ln for ln in r.stderr.splitlines() if ln.startswith("error:")), r.stderr)
