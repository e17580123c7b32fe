"""The package's shape, as docs/architecture.md describes it: every Python module imports only its own layer and
the layers below it (imports inside functions included) and every C++ file under src/ includes only its own and
lower layers, both read from the two tables there; no import circles; nothing below the Context facade touching
its private state; every DDLFAST_* variable read in config.py; the public names that stayed where users find
them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ddlfast"
SOURCES = ROOT / "src"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
# The compiled modules (Cython) import only ddlfast.config and ddlfast.errors, which import no ddlfast module
# but each other: leaves here.
COMPILED = dict.fromkeys(_module_name(p) for p in PACKAGE.glob("*.pyx"))


def _imports(name: str, path: Path) -> set[str]:
    """ddlfast modules `name` imports anywhere in its body (module level, functions, classes). The parent
    packages every import runs first are left out: ddlfast's subpackage __init__s import nothing."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base
                                                                                                 else []))
            # `from a.b import c`: the module a.b.c, or a name in a.b's namespace (a.b itself)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES | COMPILED.keys() else base
                       for alias in node.names]
        else:
            continue
        found.update(t for t in targets if (t in MODULES or t in COMPILED) and t != name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()} | {name: set() for name in COMPILED}


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    return components


def test_the_import_graph_is_read() -> None:
    # guards the checks below against reading nothing
    assert "ddlfast.context" in GRAPH["ddlfast.api"]
    assert "ddlfast.engine.state" in GRAPH["ddlfast.engine.host"]
    assert "ddlfast.topology.cost_model" in GRAPH["ddlfast.plan"]


def test_no_import_circles() -> None:
    assert _cycles() == []


def _table(heading: str) -> list[tuple[str, list[str]]]:
    """(layer name, the paths its first-columns cell names) per row of the table under `heading`, top to
    bottom. Paths in parentheses are parts of the path before them, except in the C++ table's first column."""
    lines = ARCHITECTURE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows = []
    for line in lines[start + 1:]:
        if rows and not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if not line.startswith("|") or set(cells[0]) <= {"-"} or cells[0] in ("layer", "folder"):
            continue
        rows.append((cells[0], cells))
    return [(name, paths) for name, paths in ((name, _paths(cells)) for name, cells in rows)]


def _paths(cells: list[str]) -> list[str]:
    if len(cells) == 3:  # the Python table: layer | folder | owns; `plan.py` after `ddlfast/bench.py`: ddlfast/plan.py
        named = re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", cells[1]))
        return [path if path.startswith("ddlfast/") else f"ddlfast/{path}" for path in named]
    return re.findall(r"`([^`]+/)`", cells[0])  # the C++ table: folder | owns


def _python_layer(paths: list[str]) -> set[str]:
    return {_module_name(PACKAGE.parent / (path.rstrip("/") + ("/__init__.py" if path.endswith("/") else "")))
            .removesuffix(".pyx") for path in paths}


PY_LAYERS = [(name, _python_layer(paths)) for name, paths in _table("## Layers, top to bottom")]
CPP_LAYERS = [(" + ".join(paths), paths) for _, paths in _table("### The C++ core")]


def python_layer_of(module: str) -> int:
    """Index in PY_LAYERS (0: the top) of the layer that holds `module`, or of its package."""
    for index, (_, members) in enumerate(PY_LAYERS):
        if any(module == m or (m != "ddlfast" and module.startswith(m + ".")) for m in members):
            return index
    raise AssertionError(f"{module} is in no layer of the table in docs/architecture.md: add it there")


def cpp_layer_of(path: str) -> int:
    """Index in CPP_LAYERS of the longest folder that holds `path` (relative to src/)."""
    found = [(len(folder), index) for index, (_, folders) in enumerate(CPP_LAYERS) for folder in folders
             if path.startswith(folder)]
    assert found, f"src/{path} is in no folder of the C++ table in docs/architecture.md: add it there"
    return max(found)[1]


def python_violations(graph: dict[str, set[str]]) -> list[str]:
    return [f"{name} ({PY_LAYERS[python_layer_of(name)][0]}) imports {target} "
            f"({PY_LAYERS[python_layer_of(target)][0]}), a layer above it"
            for name, targets in sorted(graph.items()) for target in sorted(targets)
            if python_layer_of(target) < python_layer_of(name)]


def includes() -> dict[str, set[str]]:
    """The project headers each file under src/ includes, as paths relative to src/."""
    found = {}
    for path in sorted(SOURCES.rglob("*")):
        if path.suffix in (".h", ".cc", ".cu", ".cuh"):
            text = path.read_text()
            found[str(path.relative_to(SOURCES))] = set(re.findall(r'^#include "([^"]+)"', text, re.MULTILINE))
    return found


def cpp_violations(graph: dict[str, set[str]]) -> list[str]:
    return [f"src/{name} ({CPP_LAYERS[cpp_layer_of(name)][0]}) includes {target} "
            f"({CPP_LAYERS[cpp_layer_of(target)][0]}), a layer above it"
            for name, targets in sorted(graph.items()) for target in sorted(targets)
            if cpp_layer_of(target) < cpp_layer_of(name)]


def test_the_layer_tables_are_read() -> None:
    names = [name for name, _ in PY_LAYERS]
    assert names[0] == "CLIs" and "engine" in names and names[-1] == "test entry points", names
    assert python_layer_of("ddlfast.engine.host") < python_layer_of("ddlfast.compression.codecs")
    assert [name for name, _ in CPP_LAYERS][-1] == "common/ + common/cuda/"
    assert cpp_layer_of("engine/cuda/fence.h") < cpp_layer_of("engine/ring_phases.h") < cpp_layer_of("algo/torus.h")
    assert sum(len(targets) for targets in includes().values()) > 50


def test_every_module_imports_only_its_own_layer_and_below() -> None:
    assert python_violations(GRAPH) == []


def test_the_library_never_imports_the_test_entry_points() -> None:
    testing = PY_LAYERS[-1][1]
    assert [name for name, targets in GRAPH.items() if targets & testing] == []


def test_every_cpp_file_includes_only_its_own_layer_and_below() -> None:
    assert cpp_violations(includes()) == []


def test_an_import_or_include_from_above_is_caught() -> None:
    # The checks above can fail: a compression module importing the engine, a common header including a kernel.
    assert python_violations({"ddlfast.compression.codecs": {"ddlfast.engine.control"}}) == [
        "ddlfast.compression.codecs (compression) imports ddlfast.engine.control (engine), a layer above it"]
    assert len(cpp_violations({"common/cuda/cuda_device.h": {"kernels/cuda/cuda_kernels.h"}})) == 1


def test_nothing_outside_the_facade_touches_its_private_state() -> None:
    private = re.compile(r"(\bcontext\(?\)?|_context|default_context\(\))\._[a-z]\w*")
    offenders = [f"{name}: {match.group(0)}" for name, path in MODULES.items() if name != "ddlfast.context"
                 for match in private.finditer(path.read_text())]
    assert offenders == []


def test_ddlfast_variables_are_read_in_config_only() -> None:
    reads = re.compile(r"(environ|getenv)\b.*DDLFAST_|DDLFAST_\w*\"?\s*(in|not in)\s+\w*environ")
    offenders = [name for name, path in MODULES.items() if name != "ddlfast.config"
                 and any(reads.search(line) for line in path.read_text().splitlines())]
    assert offenders == []


def test_public_names_stay_where_users_find_them() -> None:
    import ddlfast
    import ddlfast.integrations.torch
    import ddlfast.torch
    from ddlfast import compression

    assert ddlfast.torch is ddlfast.integrations.torch
    assert callable(ddlfast.topology) and ddlfast.topology.__module__ == "ddlfast.api"
    assert ddlfast.FusedBuffer.__module__ == "ddlfast.fused_buffer"
    assert {"Codec", "TopKCodec", "ErrorFeedback", "HookContext"} <= set(dir(compression))
    for name in ddlfast.__all__:
        assert hasattr(ddlfast, name), name
