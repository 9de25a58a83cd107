"""The shape of the product code, checked on the source: no import circles, rooms whose imports
run one way, and size budgets for modules and functions.

- **No circles.** No product module reaches itself through its imports, counting every import
  statement: at the top, inside functions and under `TYPE_CHECKING` alike.
- **Rooms.** A service's subpackages (its rooms) and its top-level modules import one way,
  down the order `ROOMS` gives: a room may import the rooms below it, never one above.
- **Sizes.** No module over 500 lines (a Triton kernel file, `kernels/triton_*.py`, may be
  longer where splitting it would hurt reading) and no function over 60 lines (a Triton
  kernel, `@triton.jit`, is read whole).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("kvflow", "services", "shared", "kernels", "benchmarks")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60

# Each service's rooms, top first: a room imports only those after it.
ROOMS = {
    "executor": [
        "process",
        "rank_group",
        "runner",
        "speculative",
        "lora",
        "loading",
        "models",
        "quantization",
        "layers",
        "parallel",
    ],
    "frontend": ["process", "app", "routes", "engine", "api", "metrics"],
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in PRODUCT
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The product modules a file imports, with every import statement counted:
    `from a.b import c` names a.b, and a.b.c where c is a module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = product_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circles() -> None:
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"} - {"e"}}
    assert circles(graph) == [["a", "b", "c"]]


def room_of(module: str, service: str) -> str | None:
    """The room of a module of `services.<service>`: its subpackage, or itself at the top."""
    parts = module.split(".")
    if parts[:2] != ["services", service] or len(parts) < 3:
        return None
    return parts[2]


def room_violations(service: str) -> list[str]:
    order = ROOMS[service]
    graph = import_graph()
    found = []
    for module, targets in sorted(graph.items()):
        room = room_of(module, service)
        if room is None:
            continue
        for target in sorted(targets):
            target_room = room_of(target, service)
            if target_room is None or target_room == room:
                continue
            if order.index(target_room) < order.index(room):
                found.append(f"{module} ({room}) imports {target} ({target_room}), a room above")
    return found


def test_every_room_is_placed() -> None:
    for service, order in ROOMS.items():
        folder = ROOT / "services" / service
        rooms = {p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")}
        rooms |= {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}
        assert rooms == set(order), service


def test_rooms_import_downwards() -> None:
    for service in ROOMS:
        assert room_violations(service) == [], service


def functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def test_modules_fit_their_budget() -> None:
    long = [
        f"{path.relative_to(ROOT)}: {lines} lines"
        for path in product_modules().values()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
        and not (path.parent.name == "kernels" and path.name.startswith("triton_"))
    ]
    assert long == []


def test_functions_fit_their_budget() -> None:
    long = []
    for path in product_modules().values():
        for node in functions(ast.parse(path.read_text())):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_FUNCTION_LINES and not is_triton_kernel(node):
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert long == []
