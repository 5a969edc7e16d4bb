"""Count a package's modules and the import edges between them (issue 31's acceptance figures).

``python tests/import_graph.py [PACKAGE ...]`` prints, per package, the number of modules (each
``.py`` file, a package's ``__init__`` counted as the package) and of distinct module -> module
imports inside it, the way the import contracts see them: imports inside functions count,
``if TYPE_CHECKING:`` imports do not; ``from . import x`` names the submodule ``x`` when one
exists. ``--edges`` lists them. Used by tests/test_import_graph.py.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules(package: str, root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> its file, for every module of ``package``."""
    base = root / package.replace(".", "/")
    out: dict[str, Path] = {}
    for path in sorted(base.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    walk(sub)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            walk(child)
    walk(tree)
    return found


def _owner(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` is, or is inside (``a.b.c`` -> ``a.b`` when only that is a module)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def edges(package: str, root: Path = ROOT) -> set[tuple[str, str]]:
    """Distinct (importer, imported) pairs between modules of ``package``."""
    known = modules(package, root)
    out: set[tuple[str, str]] = set()
    for mod, path in known.items():
        is_pkg = path.name == "__init__.py"
        here = mod if is_pkg else mod.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = here
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in known else base)
            for t in targets:
                owner = _owner(t, known)
                if owner is not None and owner != mod:
                    out.add((mod, owner))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("packages", nargs="*", default=["fog_broker"])
    ap.add_argument("--edges", action="store_true", help="list the edges too")
    args = ap.parse_args(argv)
    for pkg in args.packages:
        es = edges(pkg)
        print(f"{pkg}: {len(modules(pkg))} modules, {len(es)} import edges")
        if args.edges:
            for a, b in sorted(es):
                print(f"  {a} -> {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
