"""The models package's shape: every module is core or shell, the CLI and onnxruntime load lazily.

Whether the cores are pure is tests/test_purity.py's job (with imports inside functions)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import models

ROOT = Path(models.__file__).resolve().parent
CORE = ["errors", "external", "feeds", "graph", "profile", "cuts", "partition", "zoo", "train"]
# Adapters: onnxruntime runs (imported lazily), pip downloads, the command line, sklearn's digits.
SHELL = ["probe", "graph_files", "timing", "thirdparty", "cli", "digits"]
# What ``fogline`` must not load before it knows the command (start-up time).
DEFERRED = {"paho", "flwr", "onnxruntime", "onnx", "numpy", "sklearn", "models"}


def _top_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in tree.body:  # module level only; imports inside functions are lazy
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_cli_defers_heavy_imports() -> None:
    assert not _top_level_imports(ROOT / "cli.py") & DEFERRED


def test_all_is_resolvable() -> None:
    for name in models.__all__:
        assert getattr(models, name) is not None
    with pytest.raises(AttributeError):
        models.nope  # noqa: B018


def test_every_module_is_core_or_shell() -> None:
    found = {p.stem for p in ROOT.glob("*.py")} - {"__init__"}
    assert found == set(CORE) | set(SHELL)


@pytest.mark.parametrize("mod", ["probe", "timing"])
def test_onnxruntime_is_imported_lazily(mod: str) -> None:
    assert "onnxruntime" not in _top_level_imports(ROOT / f"{mod}.py")
