"""The agent's install holds to Python 3.10 (JetPack 6) and needs no onnx.

No 3.10 interpreter is on the build machines (Debian bookworm ships 3.11), so the check is
static: ``vermin`` over every first-party module an agent process loads, and a 3.10 parse of
the command modules it imports to build ``fogline``'s parser. At run time, an agent process
is started with what a device lacks blocked from import (onnx, flwr, and 3.11's tomllib):
it must build its commands and probe a recorded board.
"""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PY310 = ("--target=3.10-", "--violations", "--no-tips", "--eval-annotations")

# Imported by the agent process only to register other packages' commands with `fogline`'s
# parser; their handlers (and the 3.11 modules they import lazily) never run on a device.
_PARSER_ONLY = ("fog_broker.", "cloud_coordinator.", "models.cli", "simulations.cli")

# What a device's install does not have, or a 3.10 interpreter does not: blocked from import.
BLOCKED = ("onnx", "flwr", "tomllib", "scipy", "sklearn", "aiohttp", "ray", "torch")

_PROBE = r"""
import importlib.abc, json, sys
BLOCKED = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not on a device)", name=name)
        return None

sys.meta_path.insert(0, Block())
from runtime.cli import build_parser
build_parser().parse_args(["agent", "--broker", "127.0.0.1:8883", "--id", "pi"])
import edge_agent.agent, edge_agent.executor, edge_agent.runner  # not flower_client: the fl extra
from edge_agent.probes.live import LiveProbe
probe = LiveProbe(sys.argv[2], vcgencmd="", nmcli="")
probe.capabilities(); r = probe.read(0.0)
first = ("runtime", "edge_agent", "models", "simulations", "fog_broker", "cloud_coordinator")
mods = sorted(m for m in sys.modules if m.split(".")[0] in first)
print(json.dumps({"modules": {m: getattr(sys.modules[m], "__file__", None) for m in mods},
                  "onnx": "onnx" in sys.modules, "model": probe.kind, "power_w": r.power_w}))
"""


def _agent_process() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", _PROBE, ",".join(BLOCKED),
                        str(ROOT / "tests/edge_agent/fixtures/orin")],
                       capture_output=True, text=True, timeout=120, env=env, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_agent_runs_without_onnx_flwr_or_tomllib() -> None:
    out = _agent_process()
    assert not out["onnx"]
    assert out["model"] == "orin-nano" and out["power_w"] == pytest.approx(6.512, abs=1e-3)


def test_agent_modules_hold_to_python_310() -> None:
    vermin = shutil.which("vermin") or str(Path(sys.executable).parent / "vermin")
    if not Path(vermin).exists():
        pytest.skip("vermin not installed (pip install vermin; it is in the dev extra)")
    files = {m: f for m, f in _agent_process()["modules"].items() if f}
    runs = [f for m, f in files.items() if not m.startswith(_PARSER_ONLY)]
    assert any(f.endswith("edge_agent/agent.py") for f in runs)
    r = subprocess.run([vermin, *PY310, *runs], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0 and "not met" not in r.stdout, r.stdout[-3000:]
    for f in files.values():  # parsed on 3.10 at import even where only a parser is built
        ast.parse(Path(f).read_text(), f, feature_version=(3, 10))


def test_requires_python_and_extras() -> None:
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["requires-python"] == ">=3.10"
    assert not any(d.startswith(("onnx>", "onnx ")) for d in meta["dependencies"])
    assert any(d.startswith("onnxruntime") for d in meta["dependencies"])
    extras = meta["optional-dependencies"]
    assert "fogline[models]" in extras["fog"] and "onnx>=1.16" in extras["models"]
    assert all("python_version >= '3.11'" in d for d in extras["fl"] if d.startswith("flwr"))
