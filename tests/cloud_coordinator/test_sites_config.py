"""Sites from flags and sites.toml: every problem one line naming the site (no network)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from cloud_coordinator.sites import (
    SiteSpec,
    load_sites_toml,
    load_table,
    parse_site_arg,
    resolve,
    save_table,
    specs_from_toml,
    summaries_dir_of,
)
from cloud_coordinator.summaries import SiteKey, latest_summary, read_site_summaries, store_summary
from edge_agent.testing import FogSigner
from runtime.credentials import FogInfo
from runtime.errors import LocalViolation
from runtime.messages import DeviceSummary, FleetSummary
from runtime.pki import SiteCA
from runtime.security import Identity


def creds_dir(root: Path, name: str, fog: FogSigner, *, role: str = "coordinator", mqtt: str = "127.0.0.1:1883",
              ident: str = "cloud") -> Path:
    """A credentials directory as ``fogline operators add`` writes it, pinning ``fog``."""
    d = root / name
    d.mkdir(parents=True)
    SiteCA.load_or_create(root / f"{name}-ca", fog.site).issue_bundle(d, ident, role)
    Identity.generate(ident).save(d / "signing.key")
    (d / "identity.json").write_text(json.dumps({"name": ident, "role": role}))
    (d / "fog.json").write_text(json.dumps(FogInfo(fog.fog_id, fog.site, fog.public_key, mqtt).to_json()))
    for secret in ("key.pem", "signing.key"):
        os.chmod(d / secret, 0o600)
    return d


@pytest.fixture
def three(tmp_path: Path) -> dict[str, Path]:
    return {n: creds_dir(tmp_path, n, FogSigner(f"fog-{n}", n), mqtt=f"127.0.0.1:{1883 + i}")
            for i, n in enumerate(("a", "b", "c"))}


def test_site_arg_forms(tmp_path: Path) -> None:
    s = parse_site_arg(f"a={tmp_path}")
    assert (s.name, s.credentials, s.mqtt) == ("a", str(tmp_path), "")
    s = parse_site_arg(f"b={tmp_path}@10.0.0.2:8883")
    assert (s.credentials, s.mqtt) == (str(tmp_path), "10.0.0.2:8883")
    assert parse_site_arg("c=/srv/x@y/creds").credentials == "/srv/x@y/creds"   # an '@' in the path
    for bad, msg in (("a", "expected NAME=CREDENTIALS_DIR"), ("=x", "expected NAME"), ("../a=x", "invalid site name"),
                     ("a=x@host:notaport", "is not HOST:PORT")):
        with pytest.raises(LocalViolation, match=msg):
            parse_site_arg(bad)


def test_order_and_canary(three: dict[str, Path]) -> None:
    specs = [SiteSpec("a", str(three["a"]), order=3), SiteSpec("b", str(three["b"]), canary=True),
             SiteSpec("c", str(three["c"]), order=1)]
    t = resolve(specs)
    assert t.names == ["b", "c", "a"] and t.canary == "b"
    assert resolve(specs, canary="a").names == ["a", "c", "b"]
    plain = resolve([SiteSpec(n, str(three[n])) for n in ("c", "a", "b")])
    assert plain.names == ["c", "a", "b"] and plain.canary == "c"
    assert t.get("c").address == "127.0.0.1:1885"
    with pytest.raises(LocalViolation, match=r"unknown site 'x' \(sites: b, c, a\)"):
        t.get("x")


@pytest.mark.parametrize("case,msg", [
    ("unknown canary", "unknown site 'zz' for --canary (sites: a, b)"),
    ("two canaries", "one canary site, not 2 (a, b are marked canary = true)"),
    ("twice", "site a is given twice"),
    ("wrong role", "site b: {b} holds 'operator' credentials (cloud); a coordinator needs its own"),
    ("same credentials", "sites a and b use the same credentials"),
    ("same fog key", "sites a and b pin the same fog key (fog-a): one fog cannot be two sites"),
    ("no address", "site b: {b}/fog.json names no MQTT address; give b=DIR@HOST:PORT"),
    ("missing", "site b: no credentials directory at /nonexistent"),
    ("no sites", "no sites"),
])
def test_bad_site_tables(tmp_path: Path, case: str, msg: str) -> None:
    fa = FogSigner("fog-a", "a")
    a = creds_dir(tmp_path, "a", fa)
    b_args: dict = {}
    b_fog = FogSigner("fog-b", "b")
    if case == "wrong role":
        b_args = {"role": "operator"}
    if case == "same fog key":
        b_fog = fa
    if case == "no address":
        b_args = {"mqtt": ""}
    b = creds_dir(tmp_path, "b", b_fog, **b_args)
    specs = [SiteSpec("a", str(a)), SiteSpec("b", str(b))]
    canary = None
    if case == "unknown canary":
        canary = "zz"
    elif case == "two canaries":
        specs = [SiteSpec("a", str(a), canary=True), SiteSpec("b", str(b), canary=True)]
    elif case == "twice":
        specs = [SiteSpec("a", str(a)), SiteSpec("a", str(b))]
    elif case == "same credentials":
        specs = [SiteSpec("a", str(a)), SiteSpec("b", str(a))]
    elif case == "missing":
        specs = [SiteSpec("a", str(a)), SiteSpec("b", "/nonexistent")]
    elif case == "no sites":
        specs = []
    with pytest.raises(LocalViolation) as err:
        resolve(specs, canary)
    text = str(err.value)
    assert msg.format(b=b) in text and "\n" not in text


def test_sites_toml(tmp_path: Path, three: dict[str, Path]) -> None:
    f = tmp_path / "conf" / "sites.toml"
    f.parent.mkdir()
    f.write_text('[rollout]\nserve_timeout_s = 9\n\n'
                 '[sites.north]\ncredentials = "../a"\ncanary = true\n\n'
                 f'[sites.south]\ncredentials = "{three["b"]}"\nmqtt = "127.0.0.1:9999"\norder = 2\n')
    specs, rollout = load_sites_toml(f)
    assert [(s.name, s.credentials, s.mqtt, s.canary, s.order) for s in specs] == [
        ("north", str(three["a"]), "", True, None), ("south", str(three["b"]), "127.0.0.1:9999", False, 2)]
    assert rollout == {"serve_timeout_s": 9}
    t = resolve(specs)
    save_table(tmp_path / "ck", t)
    specs2, canary, pol, insecure, rows = load_table(tmp_path / "ck")
    assert specs2 == specs and canary == "north" and pol["serve_timeout_s"] == 120.0 and not insecure
    assert rows[1]["address"] == "127.0.0.1:9999" and rows[0]["fog_id"] == "fog-a"


@pytest.mark.parametrize("text,msg", [
    ("[sites]\n", "no [sites.NAME] table"),
    ("[site.a]\ncredentials='x'\n", "unknown table 'site'"),
    ("[sites.a]\ncred='x'\n", "sites.a: unknown key 'cred'"),
    ("[sites.a]\ncanary='yes'\ncredentials='x'\n", "canary must be true/false"),
    ("[sites.a]\norder=1\n", "sites.a needs credentials"),
    ("[sites.a\n", "not TOML"),
])
def test_bad_sites_toml(tmp_path: Path, text: str, msg: str) -> None:
    f = tmp_path / "sites.toml"
    f.write_text(text)
    with pytest.raises(LocalViolation, match=msg.replace("[", "\\[").replace("]", "\\]")):
        load_sites_toml(f)
    with pytest.raises(LocalViolation, match="cannot read"):
        load_sites_toml(tmp_path / "none.toml")
    assert specs_from_toml({"sites": {"a": {"credentials": "x"}}}, tmp_path)[0][0].credentials == str(tmp_path / "x")


def test_no_saved_table(tmp_path: Path) -> None:
    with pytest.raises(LocalViolation, match="no sites recorded in"):
        load_table(tmp_path)


def test_summaries_are_per_site_and_verified_with_that_sites_key(tmp_path: Path) -> None:
    """A's sealed summary stored as B's is never read back as B's: each site has its own directory and key."""
    fa, fb = FogSigner("fog-a", "a"), FogSigner("fog-b", "b")
    ka = SiteKey(str(summaries_dir_of(tmp_path, "A")), "fog-a", fa.public_key.hex(), "a")
    kb = SiteKey(str(summaries_dir_of(tmp_path, "B")), "fog-b", fb.public_key.hex(), "b")
    from runtime import codec

    def sealed(fog: FogSigner, fog_id: str, site: str, dev: str) -> tuple:  # type: ignore[type-arg]
        s = FleetSummary(fog_id, site, time.time(), (DeviceSummary(dev, True, 0.9, fit_for_training=True),))
        return codec.decode_envelope(fog.signer.seal_bytes(s, time.time())), s

    store_summary(Path(ka.summaries_dir), *sealed(fa, "fog-a", "a", "dev-a"))
    # site A's fog seals a summary claiming to be fog-b: stored where B's would be, it must not verify
    store_summary(Path(kb.summaries_dir), *sealed(fa, "fog-b", "b", "intruder"))
    assert latest_summary(kb) is None
    assert [d.device_id for s in read_site_summaries({"A": ka, "B": kb}) for d in s.devices] == ["dev-a"]
    store_summary(Path(kb.summaries_dir), *sealed(fb, "fog-b", "b", "dev-b"))
    assert sorted(d.device_id for s in read_site_summaries({"A": ka, "B": kb}) for d in s.devices) == \
        ["dev-a", "dev-b"]
