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
})
SEEDED = frozenset({"random.Random", "numpy.random.default_rng", "numpy.random.Generator",
                    "numpy.random.SeedSequence", "numpy.random.PCG64", "numpy.random.BitGenerator"})
GLOBAL_RANDOM = ("random.", "numpy.random.")

# The pure cores: the ones ARCHITECTURE.md names (scheduler, registry state machine, aggregators,
# cut finder, checkpoint policy) and every module whose docstring says "pure".
PURE = [
    # fog broker: placement (scheduler, chain solver, cost model), registry, controller, router, ...
    "fog_broker.placement", "fog_broker.placement.chain", "fog_broker.placement.cost",
    "fog_broker.placement.explain", "fog_broker.placement.metrics", "fog_broker.placement.model",
    "fog_broker.placement.plugins", "fog_broker.placement.scheduler",
    "fog_broker.placement.validate",
    "fog_broker.registry", "fog_broker.registry._core", "fog_broker.controller",
    "fog_broker.controller._core", "fog_broker.router", "fog_broker.oip", "fog_broker.api_auth",
    "fog_broker.trust", "fog_broker.calibration", "fog_broker.ratelimit", "fog_broker.site_core",
    "fog_broker.slow_stages",
    # cloud coordinator: aggregators, attacks, checkpoint policy, rollout (and its clock), selection
    "cloud_coordinator.aggregation", "cloud_coordinator.aggregation._errors",
    "cloud_coordinator.aggregation._kernels", "cloud_coordinator.aggregation._parallel",
    "cloud_coordinator.aggregation._result", "cloud_coordinator.aggregation._rows",
    "cloud_coordinator.aggregation._validate", "cloud_coordinator.aggregation.clipping",
    "cloud_coordinator.aggregation.distances", "cloud_coordinator.aggregation.preagg",
    "cloud_coordinator.aggregation.registry", "cloud_coordinator.aggregation.rules",
    "cloud_coordinator.attacks", "cloud_coordinator.layout", "cloud_coordinator.policy",
    "cloud_coordinator.rollout", "cloud_coordinator.rounds", "cloud_coordinator.selection",
    "cloud_coordinator.supervision",
    # models: graph analysis, profile, the cut finder, partitions, the zoo, numpy trainers
    "models.errors", "models.graph", "models.profile", "models.cuts", "models.partition",
    "models.zoo", "models.train", "models.feeds",
    # edge agent: advert builders, command checks, statistics, readings, simulated device, probes
    "edge_agent.advertiser", "edge_agent.commands", "edge_agent.stats", "edge_agent.readings",
    "edge_agent.simulated", "edge_agent.probes.cpu", "edge_agent.probes.thermal",
    "edge_agent.probes.battery", "edge_agent.probes.jetson", "edge_agent.probes.pi",
    "edge_agent.probes._sysfs", "edge_agent.probes.network", "edge_agent.probes.rapl",
    "edge_agent.probes.energy", "edge_agent.profiles",
    # runtime: the values every process shares, and the relay checks
    "runtime.errors", "runtime._schema", "runtime.messages", "runtime.codec", "runtime.topics",
    "runtime.relay", "runtime.verify", "runtime.devices", "runtime.attacks", "runtime.ratelimit",
    # simulations: churn and WAN models, the goodput model
    "simulations.churn", "simulations.wan", "simulations.goodput",
]

# Sanctioned uses, each with its reason: (module, forbidden name) -> why.
ALLOWED = {
    ("cloud_coordinator.aggregation._parallel", "concurrent"):
        "column blocks on a thread pool; results do not depend on the thread count "
        "(tests/cloud_coordinator/test_aggregation_parallel.py)",
    ("cloud_coordinator.aggregation._parallel", "os.environ"):
        "FOGLINE_AGG_THREADS / OMP_NUM_THREADS size that pool",
    ("edge_agent.probes._sysfs", "open"):
        "the one reader, under a root path the caller passes (tests pass a fake /proc, /sys)",
}

# Cores that say they are pure and are not (yet). Fix the source, then delete the line.
NOT_YET: dict[str, str] = {}


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
        elif isinstance(node, ast.Attribute):
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
