"""The package's shape cannot drift: imports run down the layers, no circles, small files.

Layers, top to bottom. A module may import from its own package and from lower layers;
packages that share a layer are independent of each other. ``TYPE_CHECKING`` and
function-local imports count: they are still dependencies a reader must follow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "smcsd_ppl"
LAYERS = [
    {"cli"},
    {"distill"},
    {"bench"},
    {"batch"},
    {"llamppl", "serving"},
    {"api"},
    {"methods"},
    {"engine"},
    {"inference"},
    {"models", "potentials", "proposals"},
    {"backends"},
    {"smc", "verification"},
    {"results", "text", "ends", "plots"},
    {"config", "names", "keys"},
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_PARAMETERS = 400, 60, 8


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` (at ``path``) imports, resolved to module names."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule; `from mod import name` the module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known}
    return found - {name}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imported(name, path, set(mods)) for name, path in mods.items()}


def component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports into a higher layer, or between two packages of the same layer."""
    bad = []
    for src, targets in graph.items():
        a = component(src)
        if a in ("", "__main__"):  # the lazy facade and `python -m` may reach anything
            continue
        for dst in targets:
            b = component(dst)
            if b and b != a and RANK[b] <= RANK[a]:
                bad.append(f"{src} -> {dst}")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_every_package_has_a_layer():
    parts = {component(m) for m in modules()} - {"", "__main__"}
    assert parts <= set(RANK), parts - set(RANK)


def test_imports_only_run_down_the_layers():
    assert upward_imports(import_graph()) == []


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_the_checks_catch_what_they_forbid():
    graph = {
        "smcsd_ppl.methods.sd": {"smcsd_ppl.inference.cycle"},  # down: fine
        "smcsd_ppl.inference.cycle": {"smcsd_ppl.verification.smcsd"},
        "smcsd_ppl.verification.smcsd": {"smcsd_ppl.inference.cycle"},  # up, and a circle
        "smcsd_ppl.models.loading": {"smcsd_ppl.potentials.constraints"},  # sideways
    }
    assert upward_imports(graph) == [
        "smcsd_ppl.models.loading -> smcsd_ppl.potentials.constraints",
        "smcsd_ppl.verification.smcsd -> smcsd_ppl.inference.cycle",
    ]
    assert cycles(graph) == [["smcsd_ppl.inference.cycle", "smcsd_ppl.verification.smcsd"]]


def test_relative_imports_resolve():
    # `from . import x` of a submodule and `from ..pkg import name` of a module both count.
    graph = import_graph()
    assert "smcsd_ppl.methods.registry" in graph["smcsd_ppl.methods.sd"]
    assert "smcsd_ppl.smc" in graph["smcsd_ppl.inference.outcome"]


@pytest.mark.parametrize("name", sorted(modules()))
def test_files_and_functions_stay_small(name):
    path = modules()[name]
    text = path.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_FILE_LINES, f"{path.name}: over {MAX_FILE_LINES} lines"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []
    assert many_parameters(text) == []


def many_parameters(source: str) -> list[str]:
    """Functions taking more than ``MAX_PARAMETERS`` (``self`` and ``cls`` aside): two ideas, or a record."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
            if len(names) > MAX_PARAMETERS:
                out.append(f"{node.name} ({len(names)} parameters)")
    return out


def test_the_parameter_count_catches_a_long_signature():
    assert many_parameters("def f(self, a, b, c, d, e, f, g, h): pass") == []
    assert many_parameters("def f(a, b, c, d, e, f, g, *, h, i): pass") == ["f (9 parameters)"]
