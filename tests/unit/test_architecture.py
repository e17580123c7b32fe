"""The package's shape, as docs/architecture.md describes it: no import circles (imports inside functions
included), nothing below the Context facade touching its private state, every DDLFAST_* variable read in
config.py, and the public names that stayed where users find them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ddlfast"


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


@pytest.mark.parametrize("layer", ["ddlfast.engine", "ddlfast.fusion", "ddlfast.buffers", "ddlfast.topology",
                                   "ddlfast.compression"])
def test_layers_below_the_facade_do_not_import_it(layer: str) -> None:
    above = {"ddlfast", "ddlfast.api", "ddlfast.context", "ddlfast.fused_buffer", "ddlfast.torch", "ddlfast.plan",
             "ddlfast.bench", "ddlfast.demo", "ddlfast.overlap"}
    for name, targets in GRAPH.items():
        if name == layer or name.startswith(layer + "."):
            assert not targets & above, f"{name} imports {sorted(targets & above)}"
            assert not any(t.startswith("ddlfast.integrations") for t in targets), name


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
