"""Pure cores do no I/O: one list of cores, one forbidden list, checked through every import.

A core is pure when nothing it runs can touch a socket, a process, a thread, a clock, a file, global
randomness, the log or a runtime (MQTT, Flower, onnxruntime). The check reads source, never imports
it: every ``import`` anywhere in the module (inside functions too: a lazy import still runs), then
the same for every project module it imports, and the package ``__init__`` files that importing it
executes (their module level only: a lazy ``__getattr__`` runs only when asked). ``if
TYPE_CHECKING:`` blocks never run and are skipped. Besides modules, a few members are forbidden:
``open()``, ``os.system`` / ``os.environ`` and the like, and the global ``random`` and
``numpy.random`` functions (a seeded ``random.Random`` or ``default_rng`` passed in is fine).

A core that says it is pure but is not is an ``xfail(strict=True)`` with the reason: the gate
tightens by itself once the source is fixed.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("runtime", "models", "edge_agent", "fog_broker", "cloud_coordinator", "simulations")

# Modules no pure core may import, anywhere (STYLE.md rule 1, plus what the old per-package copies
# forbade): network, processes, threads, clocks, files and stores, the log, runtimes, heavy loaders.
FORBIDDEN = frozenset({
    "socket", "ssl", "selectors", "asyncio", "http", "urllib", "requests", "httpx", "aiohttp",
    "subprocess", "multiprocessing", "signal", "threading", "concurrent", "time", "sched",
    "sqlite3", "shutil", "tempfile", "glob", "fcntl", "logging",
    "paho", "flwr", "onnxruntime", "zeroconf", "psutil", "sklearn", "torch",
})
# Members that do I/O or read hidden global state, from modules a core may otherwise use
# (``os.PathLike``/``os.fspath`` and ``random.Random`` are fine).
FORBIDDEN_MEMBERS = frozenset({
    "open", "input", "print", "exec", "eval", "__import__",
    "os.system", "os.popen", "os.fork", "os.kill", "os.environ", "os.getenv", "os.putenv",
    "os.open", "os.fsync", "os.remove", "os.unlink", "os.rename", "os.replace", "os.mkdir",
    "os.makedirs", "os.listdir", "os.scandir", "os.walk", "os.urandom",
    # the file system through os and os.path (string-only helpers such as os.path.join are fine)
    "os.stat", "os.lstat", "os.access", "os.getcwd", "os.chdir", "os.chmod", "os.chown",
    "os.truncate", "os.readlink", "os.symlink", "os.link", "os.rmdir", "os.removedirs",
    "os.utime", "os.statvfs", "os.path.exists", "os.path.lexists", "os.path.isfile",
    "os.path.isdir", "os.path.islink", "os.path.ismount", "os.path.getsize", "os.path.getmtime",
    "os.path.getatime", "os.path.getctime", "os.path.realpath", "os.path.abspath",
    "os.path.samefile", "os.path.expanduser", "os.path.expandvars",
})
# pathlib's I/O methods, found as method calls on any object (a core handed a Path needs no import
# of pathlib to read it): ``x.read_text()`` is reported as ``Path.read_text``. Names that plain
# values share (``str.replace``, ``ast.walk``, ``re.Match.group``) are left out.
PATH_IO = frozenset({
    "read_text", "read_bytes", "write_text", "write_bytes", "iterdir", "glob", "rglob", "mkdir",
    "rmdir", "unlink", "touch", "exists", "is_file", "is_dir", "is_symlink", "is_mount", "stat",
    "lstat", "symlink_to", "hardlink_to", "readlink", "expanduser", "absolute", "resolve",
    "samefile", "chmod", "lchmod", "open", "cwd", "home",
})
SEEDED = frozenset({"random.Random", "numpy.random.default_rng", "numpy.random.Generator",
                    "numpy.random.SeedSequence", "numpy.random.PCG64", "numpy.random.BitGenerator"})
GLOBAL_RANDOM = ("random.", "numpy.random.")

# The pure cores: ONE list, the import contract's in pyproject.toml ([[tool.importlinter.contracts]]
# id "pure-cores"), so lint-imports and this test can never disagree about what is pure.
def _pure_modules() -> list[str]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    (pure,) = [c for c in contracts if c["id"] == "pure-cores"]
    return list(pure["source_modules"])


PURE = _pure_modules()

# Sanctioned uses, each with its reason: (module, forbidden name) -> why.
ALLOWED = {
    ("cloud_coordinator.aggregation._parallel", "concurrent"):
        "column blocks on a thread pool; results do not depend on the thread count "
        "(tests/cloud_coordinator/test_aggregation_parallel.py)",
    ("cloud_coordinator.aggregation._parallel", "os.environ"):
        "FOGLINE_AGG_THREADS / OMP_NUM_THREADS size that pool",
    ("edge_agent.probes._sysfs", "open"):
        "the one reader, under a root path the caller passes (tests pass a fake /proc, /sys)",
    ("edge_agent.probes._sysfs", "Path.glob"):
        "lists entries under the same caller-given root (hwmon, thermal zones)",
}

# Cores that say they are pure and are not (yet). Fix the source, then delete the line.
NOT_YET: dict[str, str] = {
    "cloud_coordinator.registration": "in the import contract (no runtime libraries) but logs, reads "
                                      "the clock, runs a thread pool and writes files (runtime.files)",
}


@dataclass(frozen=True)
class Use:
    module: str
    line: int
    name: str  # the forbidden module or member

    def __str__(self) -> str:
        return f"{self.module}:{self.line} uses {self.name}"


def _path(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for p in (base / "__init__.py", base.with_suffix(".py")):
        if p.exists():
            return p
    return None


def _skipped(tree: ast.Module, module_level_only: bool) -> set[int]:
    """Node ids that never run on import: ``if TYPE_CHECKING:`` bodies (and functions, if asked)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        type_checking = isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        if type_checking or (module_level_only and function):
            body: list[ast.stmt] = node.body  # type: ignore[attr-defined]
            out |= {id(x) for stmt in body for x in ast.walk(stmt)}
    return out


@cache
def _scan(module: str, module_level_only: bool) -> tuple[tuple[str, ...], tuple[Use, ...]]:
    """(project modules it imports, forbidden things it uses) for one module's own source."""
    path = _path(module)
    assert path is not None, module
    tree = ast.parse(path.read_text(), str(path))
    skip = _skipped(tree, module_level_only)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    aliases: dict[str, str] = {}  # local name -> dotted module or member it stands for
    imported: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                imported.append((a.name, node.lineno))
                top = a.name.split(".")[0]
                aliases[a.asname or top] = a.name if a.asname else top
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            parts = parts[: len(parts) - node.level + 1] if node.level else []
            base = ".".join(parts + ([node.module] if node.module else []))
            imported.append((base, node.lineno))
            for a in node.names:
                imported.append((f"{base}.{a.name}", node.lineno))
                aliases[a.asname or a.name] = f"{base}.{a.name}"
    project: list[str] = []
    uses: list[Use] = []
    for name, line in imported:
        top = name.split(".")[0]
        if top in PROJECT:
            if _path(name) is not None:
                project.append(name)
        elif top in FORBIDDEN:
            uses.append(Use(module, line, top))
        elif name in FORBIDDEN_MEMBERS or _global_random(name):
            uses.append(Use(module, line, name))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):  # a builtin: open(...)
            if node.func.id in FORBIDDEN_MEMBERS and node.func.id not in aliases:
                uses.append(Use(module, node.lineno, node.func.id))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in PATH_IO
              and (_dotted(node.func, aliases) or "pathlib.").startswith("pathlib.")):
            uses.append(Use(module, node.lineno, f"Path.{node.func.attr}"))
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node, aliases)
            if dotted and (dotted in FORBIDDEN_MEMBERS or _global_random(dotted)):
                uses.append(Use(module, node.lineno, dotted))
    return tuple(dict.fromkeys(project)), tuple(dict.fromkeys(uses))


def _global_random(name: str) -> bool:
    return name.startswith(GLOBAL_RANDOM) and name not in SEEDED and name.count(".") == (
        1 if name.startswith("random.") else 2)


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """``np.random.rand`` -> ``numpy.random.rand`` through the module's import names."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    head = aliases.get(node.id)
    return ".".join([head, *reversed(names)]) if head else None


def violations(module: str) -> list[str]:
    """Forbidden uses reachable from ``module``, each with the import chain that reaches it."""
    via: dict[tuple[str, bool], str | None] = {(module, False): None}
    todo = [(module, False)]
    found: list[str] = []
    while todo:
        mod, level_only = todo.pop()
        parts = mod.split(".")
        imports, uses = _scan(mod, level_only)
        nexts = [(".".join(parts[:i]), True) for i in range(1, len(parts))]
        nexts += [(m, False) for m in imports]
        for nxt in nexts:
            if nxt not in via and (nxt[0], False) not in via and _path(nxt[0]) is not None:
                via[nxt] = mod
                todo.append(nxt)
        for use in uses:
            if (use.module, use.name) in ALLOWED:
                continue
            chain, at = [mod], via[(mod, level_only)]
            while at is not None:
                chain.append(at)
                at = via.get((at, False), via.get((at, True)))
            found.append(f"{use}" + (f" (via {' <- '.join(chain[1:])})" if len(chain) > 1 else ""))
    return sorted(found)


def _case(module: str) -> object:
    if module in NOT_YET:
        return pytest.param(module, marks=pytest.mark.xfail(reason=NOT_YET[module], strict=True))
    return module


@pytest.mark.parametrize("module", [_case(m) for m in PURE])
def test_pure_core_does_no_io(module: str) -> None:
    found = violations(module)
    assert not found, f"{module} is not pure:\n  " + "\n  ".join(found)


def test_lists_name_real_modules() -> None:
    assert [m for m in PURE if _path(m) is None] == []
    assert set(NOT_YET) <= set(PURE)
    assert {m for m, _ in ALLOWED} <= set(PURE)


def test_the_check_sees_lazy_imports_members_and_chains() -> None:
    """The rules, on modules that break them: the gate must not pass by seeing nothing."""
    cli = violations("models.cli")  # models.probe, imported inside a function of models.cli
    assert any(v.startswith("models.probe:") and "uses onnxruntime (via models.cli)" in v for v in cli)
    assert any(v.startswith("edge_agent.executor:") and "uses threading" in v
               for v in violations("edge_agent.executor"))
    assert any("uses os.environ" in v for v in violations("cloud_coordinator.settings"))
    assert any("uses open" in v for v in violations("runtime.security"))
    assert any("uses os.path.realpath" in v for v in violations("models.graph_files"))


def test_a_planted_path_read_in_a_pure_core_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                  ) -> None:
    """File I/O through a Path object (no import of pathlib needed), os.stat and os.path fail."""
    for name, body in {
        "planted_read": "def f(p):\n    return p.read_text()\n",
        "planted_stat": "import os\ndef f(p):\n    return os.stat(p).st_size\n",
        "planted_ospath": "from os import path\ndef f(p):\n    return path.exists(p)\n",
        "planted_cwd": "from pathlib import Path\nX = Path.cwd()\n",
    }.items():
        (tmp_path / "runtime").mkdir(exist_ok=True)
        (tmp_path / "runtime" / f"{name}.py").write_text(body)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    _scan.cache_clear()
    try:
        assert violations("runtime.planted_read") == ["runtime.planted_read:2 uses Path.read_text"]
        assert violations("runtime.planted_stat") == ["runtime.planted_stat:3 uses os.stat"]
        assert violations("runtime.planted_ospath") == ["runtime.planted_ospath:3 uses os.path.exists"]
        assert violations("runtime.planted_cwd") == ["runtime.planted_cwd:2 uses Path.cwd"]
    finally:
        _scan.cache_clear()
