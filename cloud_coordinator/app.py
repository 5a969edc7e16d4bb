"""A user's Flower App directory: checked before anything starts, then staged for ``flwr run``.

A Flower App is a directory with a ``pyproject.toml`` holding
``[tool.flwr.app]`` (publisher, ``components.serverapp`` and ``clientapp``,
``config``), as ``flwr new`` creates it. Fogline reads two optional keys of
its own::

    [tool.fogline]
    export = "package.module:to_onnx"   # global ArrayRecord -> ONNX (the release hook)
    release = "digits-cnn"              # release name (default: the project name)
    every = 1                           # release every K rounds
    input-shape = [1, 1, 8, 8]          # shape the exported model is checked with

``stage`` copies the app into the coordinator's work directory (the user's
directory is never written) with one more config key, ``fogline-settings``,
through which ``RobustStrategy`` finds the supervisor's settings.
"""
from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w
import tomllib

from runtime.errors import LocalViolation

from .settings import SETTINGS_KEY

__all__ = ["AppSpec", "load_app", "stage", "STAGED_DIR", "bundled_app"]

STAGED_DIR = "app"
_IGNORE = shutil.ignore_patterns(".git", "__pycache__", "*.pyc", ".venv", "venv", ".mypy_cache", ".pytest_cache",
                                 "*.pt", "*.onnx", "out", ".flwr", "build", "dist", "*.egg-info")
_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True, slots=True)
class AppSpec:
    dir: Path
    name: str
    serverapp: str
    clientapp: str
    config: Mapping[str, Any]
    export: str = ""
    release: str = ""
    every: int = 1
    input_shape: tuple[int, ...] | None = None
    client_evaluate: bool = True        # the ClientApp registers an evaluate function


def client_evaluates(module: Path | None) -> bool:
    """Does this ClientApp module register ``@app.evaluate()`` (or call ``app.evaluate(...)``)?

    Read, not imported (no user code runs in the coordinator for it). Unknown -> True:
    without evaluate every evaluate Message only comes back as an error, but guessing
    wrong the other way would silently drop the app's federated evaluation.
    """
    import ast

    if module is None:
        return True
    try:
        tree = ast.parse(module.read_text())
    except (OSError, SyntaxError, ValueError):
        return True
    for node in ast.walk(tree):
        fn = node.func if isinstance(node, ast.Call) else node
        if isinstance(fn, ast.Attribute) and fn.attr == "evaluate":
            return True
    return False


def _module_file(root: Path, ref: str) -> Path | None:
    mod = ref.split(":", 1)[0]
    base = root.joinpath(*mod.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def load_app(app_dir: str | Path) -> AppSpec:
    """Check a Flower App directory; every problem is one ``LocalViolation`` line."""
    root = Path(app_dir).resolve()
    where = f"{root}"
    if not root.is_dir():
        raise LocalViolation(f"app directory {where} does not exist")
    try:
        doc = tomllib.loads((root / "pyproject.toml").read_text())
    except FileNotFoundError:
        raise LocalViolation(f"{where} is not a Flower App: no pyproject.toml") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise LocalViolation(f"{where}/pyproject.toml is unreadable ({exc})") from None
    flwr_app = doc.get("tool", {}).get("flwr", {}).get("app")
    if not isinstance(flwr_app, dict):
        raise LocalViolation(f"{where} is not a Flower App: pyproject.toml has no [tool.flwr.app] section")
    comps = flwr_app.get("components", {})
    server = str(comps.get("serverapp", "") or "")
    client = str(comps.get("clientapp", "") or "")
    if not server:
        raise LocalViolation(f"{where} has no ServerApp: [tool.flwr.app.components] lacks serverapp")
    if not client:
        raise LocalViolation(f"{where} has no ClientApp: [tool.flwr.app.components] lacks clientapp")
    for kind, ref in (("ServerApp", server), ("ClientApp", client)):
        if not _REF.match(ref):
            raise LocalViolation(f"{where}: {kind} reference {ref!r} must look like 'package.module:app'")
        if _module_file(root, ref) is None:
            raise LocalViolation(f"{where} has no {kind}: module {ref.split(':')[0]} not found in the app directory")
    config = flwr_app.get("config", {})
    if not isinstance(config, dict):
        raise LocalViolation(f"{where}: [tool.flwr.app.config] must be a table")
    fl = doc.get("tool", {}).get("fogline", {})
    export = str(fl.get("export", "") or "")
    if export and not _REF.match(export):
        raise LocalViolation(f"{where}: [tool.fogline] export {export!r} must look like 'package.module:function'")
    shape = fl.get("input-shape")
    try:
        every = int(fl.get("every", 1))
        input_shape = tuple(int(x) for x in shape) if shape is not None else None
    except (TypeError, ValueError):
        raise LocalViolation(f"{where}: [tool.fogline] every must be an integer and input-shape a list of them"
                             ) from None
    name = str(doc.get("project", {}).get("name", root.name))
    return AppSpec(root, name, server, client, dict(config), export, str(fl.get("release", "") or ""), every,
                   input_shape, client_evaluates(_module_file(root, client)))


def stage(spec: AppSpec, dest: Path, overrides: Mapping[str, Any],
          components: Mapping[str, str] | None = None) -> Path:
    """Copy the app to ``dest`` (replacing an older copy) with ``fogline-settings`` and ``overrides`` in its config.

    ``overrides`` keys must be keys of the app's config (as ``flwr run --run-config`` requires).
    ``components`` replaces the app's ``serverapp`` and/or ``clientapp`` with Fogline's own
    (``"package.module:attr"``), through a one-line module in the staged copy: the FAB that
    Flower ships carries it, and the user's other half and config stay as they are (two-level
    rounds: the site bridge as the cloud's ClientApp, the site server on a fog's SuperLink).
    """
    unknown = sorted(set(overrides) - set(spec.config) - {SETTINGS_KEY})
    if unknown:
        raise LocalViolation(f"the app's [tool.flwr.app.config] has no {', '.join(unknown)}; "
                             f"it has {', '.join(sorted(spec.config)) or 'no keys'}")
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(spec.dir, dest, ignore=_IGNORE)
    path = dest / "pyproject.toml"
    doc = tomllib.loads(path.read_text())
    cfg = doc["tool"]["flwr"]["app"].setdefault("config", {})
    for k, v in overrides.items():
        if k in spec.config and type(spec.config[k]) is not type(v) and not (
                isinstance(spec.config[k], float) and isinstance(v, int)):
            raise LocalViolation(f"run config {k}: expected {type(spec.config[k]).__name__}, got {v!r}")
        cfg[k] = float(v) if isinstance(spec.config.get(k), float) else v
    cfg.setdefault(SETTINGS_KEY, "")
    comps = doc["tool"]["flwr"]["app"].setdefault("components", {})
    for kind, ref in (components or {}).items():
        if kind not in ("serverapp", "clientapp") or not _REF.match(ref):
            raise LocalViolation(f"cannot replace component {kind!r} with {ref!r}")
        mod, attr = ref.split(":")
        shim = f"fogline_{kind}"
        (dest / f"{shim}.py").write_text(f'"""Fogline\'s {kind} for this run (staged by fogline)."""\n'
                                         f"from {mod} import {attr} as _app\n\n"
                                         "app = _app  # an assignment: Flower finds the attribute statically\n")
        comps[kind] = f"{shim}:app"
    path.write_text(tomli_w.dumps(doc))
    return dest


def bundled_app(name: str = "digits") -> Path:
    """An example app of this source tree (``examples/NAME``), for ``fogline coordinator`` without ``--app``."""
    here = Path(__file__).resolve().parents[1] / "examples" / name
    if not (here / "pyproject.toml").is_file():
        raise LocalViolation(f"no bundled example app at {here}; pass --app DIR")
    return here
