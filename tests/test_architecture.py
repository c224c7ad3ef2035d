"""The wiring rules of docs/architecture.md, checked on the source: they stay true as folds are added.

- no import cycle between fivefold's modules (imports inside functions count too);
- the config package imports nothing from parallel/, comm/ or train/;
- only the mesh module creates process groups;
- no module outside parallel/ reads ZeRO's flat buffers;
- the training loop stays one short module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SOURCE = Path(__file__).parent.parent / "src"
PACKAGE = SOURCE / "fivefold"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(SOURCE).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert _cycles(_import_graph()) == []


def test_config_imports_no_runtime_package():
    graph = _import_graph()
    for module, targets in graph.items():
        if module.startswith("fivefold.config"):
            assert not [t for t in targets if t.startswith(("fivefold.parallel", "fivefold.comm", "fivefold.train"))], module


def test_only_the_mesh_creates_process_groups():
    creators = [p for p in PACKAGE.rglob("*.py") if "new_group(" in p.read_text()]
    assert creators == [PACKAGE / "parallel" / "mesh.py"]


def test_zero_flat_buffers_stay_inside_parallel():
    flat_fields = re.compile(r"\.(flat_grad|grad_shard|owned_range|master_parameters)\b")
    outside = [p for p in PACKAGE.rglob("*.py") if "parallel" not in p.relative_to(PACKAGE).parts
               and flat_fields.search(p.read_text())]
    assert outside == []


def test_training_loop_is_short():
    assert len((PACKAGE / "train" / "trainer.py").read_text().splitlines()) <= 300
