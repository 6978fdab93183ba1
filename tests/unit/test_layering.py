"""The package's layers, checked from the source: every import statement (top level and
inside functions) of jaxserve/, kernels_cpu/ and kernels_pallas/ is parsed with `ast`, no
module is imported. A function-level import still couples two modules (a refactor of
either can break the other, and a cycle only works while the import stays deferred), so
it counts like a top-level one. Importing a.b.c runs a/b/__init__.py first, so an import
also couples the importer to every package above its target (but its own packages,
already running when it runs).

Imports under `if TYPE_CHECKING:` are left out of the cycle check (they never run), but
still obey the layer directions and the private-name rule.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jaxserve", "kernels_cpu", "kernels_pallas")

# (importer prefix, prefixes it must not import). Lower layers never reach up: the model
# computes, the worker runs it, the core schedules, the frontend and server talk to users;
# the kernels are standalone and receive what they need as arguments.
FORBIDDEN = (
    ("jaxserve.model", ("jaxserve.parallel", "jaxserve.worker", "jaxserve.core",
                        "jaxserve.frontend", "jaxserve.server")),
    ("kernels_cpu", ("jaxserve",)),
    ("kernels_pallas", ("jaxserve",)),
    ("jaxserve.sampling", ("jaxserve.worker", "jaxserve.core", "jaxserve.frontend")),
    ("jaxserve.core.kv", ("jaxserve.model",)),
    ("jaxserve.core", ("jaxserve.frontend", "jaxserve.server")),
    ("jaxserve.worker", ("jaxserve.frontend", "jaxserve.server")),
)

# Cycles tolerated for now, each as the set of its modules. To be emptied by the owners
# of core/, worker/ and sampling/ (none left at present).
ALLOWED_CYCLES: tuple[frozenset[str], ...] = ()

# `from module import _private` across modules that are tolerated, as (importer, module,
# name): none. A name another module needs is part of its module's public surface.
ALLOWED_PRIVATE: set[tuple[str, str, str]] = set()


@dataclass(frozen=True)
class Edge:
    importer: str
    target: str
    line: int
    type_only: bool


@dataclass(frozen=True)
class PrivateUse:
    importer: str
    module: str
    name: str
    line: int


def find_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, a package named by its __init__.py."""
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _owner(name: str, mods: dict[str, Path]) -> str | None:
    """The module of ours that `name` (a module or a name in one) lives in, if any."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _packages_above(module: str, mods: dict[str, Path]) -> list[str]:
    """The packages of ours that contain `module` (a.b for a.b.c, then a)."""
    out = []
    while "." in module:
        module = module.rpartition(".")[0]
        if module in mods:
            out.append(module)
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Line numbers of statements under `if TYPE_CHECKING:` (or typing.TYPE_CHECKING)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                for sub in ast.walk(stmt):
                    if hasattr(sub, "lineno"):
                        lines.add(sub.lineno)
    return lines


def _from_base(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` reads from (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = module if is_pkg else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def scan(mods: dict[str, Path]) -> tuple[list[Edge], list[PrivateUse]]:
    """Every import edge between our modules, and every private name imported across."""
    edges, private = [], []
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = _type_checking_lines(tree)
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [(_owner(a.name, mods), None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _from_base(module, is_pkg, node)
                targets = [(_owner(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base,
                                   mods), a.name) for a in node.names]
            else:
                continue
            for target, name in targets:
                if target is None or target == module:
                    continue
                edges.append(Edge(module, target, node.lineno, node.lineno in typing_only))
                # importing a.b.c runs a/b/__init__.py first: an edge to each package
                # above the target, except the importer's own (already running)
                for pkg in _packages_above(target, mods):
                    if not _under(module, pkg):
                        edges.append(Edge(module, pkg, node.lineno,
                                          node.lineno in typing_only))
                if (name and name.startswith("_") and not name.startswith("__")
                        and f"{target}.{name}" not in mods):
                    private.append(PrivateUse(module, target, name, node.lineno))
    return edges, private


def find_cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if not e.type_only:
            graph.setdefault(e.importer, set()).add(e.target)
            graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on_stack.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on_stack.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
    return out


def describe_cycle(comp: list[str], edges: list[Edge]) -> str:
    """The component's internal edges, `a:line -> b`, so the fix can start at one."""
    inside = set(comp)
    first: dict[tuple[str, str], int] = {}
    for e in edges:
        if e.importer in inside and e.target in inside and not e.type_only:
            key = (e.importer, e.target)
            first[key] = min(first.get(key, e.line), e.line)
    lines = [f"  {a}:{line} -> {b}" for (a, b), line in sorted(first.items())]
    return "cycle among " + ", ".join(comp) + "\n" + "\n".join(lines)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def forbidden_edges(edges: list[Edge]) -> list[str]:
    found = set()
    for e in edges:
        for importer, banned in FORBIDDEN:
            if _under(e.importer, importer) and any(_under(e.target, b) for b in banned):
                found.add(f"{e.importer}:{e.line} imports {e.target}")
    return sorted(found)


@pytest.fixture(scope="module")
def graph() -> tuple[list[Edge], list[PrivateUse]]:
    return scan(find_modules())


def test_no_import_cycles(graph):
    edges, _ = graph
    cycles = [c for c in find_cycles(edges) if frozenset(c) not in ALLOWED_CYCLES]
    assert not cycles, "\n".join(describe_cycle(c, edges) for c in cycles)


def test_allowed_cycles_still_exist(graph):
    """An allow-list entry whose cycle is gone must go too (the list only shrinks)."""
    edges, _ = graph
    present = {frozenset(c) for c in find_cycles(edges)}
    assert not [sorted(c) for c in ALLOWED_CYCLES if c not in present]


def test_layer_directions(graph):
    edges, _ = graph
    bad = forbidden_edges(edges)
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_private_imports_across_modules(graph):
    _, private = graph
    bad = sorted(f"{p.importer}:{p.line} imports {p.name} from {p.module}" for p in private
                 if (p.importer, p.module, p.name) not in ALLOWED_PRIVATE)
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)
    stale = ALLOWED_PRIVATE - {(p.importer, p.module, p.name) for p in private}
    assert not stale, f"allow-listed private imports that are gone: {sorted(stale)}"


def test_the_scan_sees_function_level_imports(tmp_path):
    """A cycle closed only by an import inside a function is still found, and one closed
    under TYPE_CHECKING is not."""
    pkg = tmp_path / "jaxserve"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from jaxserve.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from jaxserve import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from jaxserve.a import x\n")
    for other in PACKAGES[1:]:
        (tmp_path / other).mkdir()
    edges, _ = scan(find_modules(tmp_path))
    assert find_cycles(edges) == [["jaxserve.a", "jaxserve.b"]]
    assert any(e.importer == "jaxserve.c" and e.type_only for e in edges)


def test_kernel_cache_folder_follows_jaxserve(monkeypatch, tmp_path):
    """kernels_cpu keeps its own copy of jaxserve.paths' rule; the two must agree."""
    from jaxserve import paths
    from kernels_cpu import cache
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    assert cache.cache_root() == paths.cache_root() == tmp_path
    monkeypatch.delenv(paths.CACHE_ENV)
    assert cache.cache_root() == paths.cache_root()


def test_the_scan_sees_package_inits(tmp_path):
    """Importing a.p.m runs a/p/__init__.py first: a cycle closed through a package's
    __init__ is found (m1 -> p.errors runs p/__init__, which imports p.load, which
    imports m1), while a module importing a sibling of its own package is not one."""
    pkg = tmp_path / "jaxserve"
    (pkg / "p").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "p" / "__init__.py").write_text("from jaxserve.p.load import f\n")
    (pkg / "p" / "errors.py").write_text("")
    (pkg / "p" / "load.py").write_text("from jaxserve.m1 import g\nfrom jaxserve.p import errors\n")
    (pkg / "m1.py").write_text("from jaxserve.p.errors import E\n")
    for other in PACKAGES[1:]:
        (tmp_path / other).mkdir()
    edges, _ = scan(find_modules(tmp_path))
    assert find_cycles(edges) == [["jaxserve.m1", "jaxserve.p", "jaxserve.p.load"]]
    (pkg / "p" / "__init__.py").write_text("")
    assert find_cycles(scan(find_modules(tmp_path))[0]) == []
