"""The site core owns its read side (issue 31): who may name the cores, and the import graph's size."""
from __future__ import annotations

import ast

from import_graph import ROOT, edges, modules

# The core: the site core and the three cores it composes. Everything else reads the site through
# the port's snapshot (front ends) or drives it through SiteCore (the fog's shell, the simulations).
CORE = ("fog_broker.site_core", "fog_broker.controller", "fog_broker.registry", "fog_broker.router")
CORE_CLASSES = {"Controller", "Registry", "Router"}
# shipped packages (benchmarks and tests of a core may build one on its own)
PACKAGES = ("runtime", "models", "edge_agent", "fog_broker", "cloud_coordinator", "simulations")


def _in_core(mod: str) -> bool:
    return any(mod == c or mod.startswith(c + ".") for c in CORE)


def test_no_module_outside_the_core_imports_controller_registry_or_router() -> None:
    found = []
    for pkg in PACKAGES:
        for mod, path in modules(pkg).items():
            if _in_core(mod):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom):
                    names = {a.name for a in node.names} & CORE_CLASSES
                    if names:
                        found.append(f"{mod}: {', '.join(sorted(names))}")
    assert found == []


def test_the_counter_sees_relative_function_level_imports_and_skips_type_checking() -> None:
    es = edges("fog_broker", ROOT)
    assert ("fog_broker.service", "fog_broker.site_core") in es       # from .site_core import (...)
    assert ("fog_broker.service_deploy", "fog_broker.wires") in es    # from . import wires
    assert ("fog_broker.status", "fog_broker.port") not in es          # under if TYPE_CHECKING only
    assert not any(a == b for a, b in es)
