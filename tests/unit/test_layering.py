"""The house rules of the layout, checked on the source: they fail the build when broken.

- A service never imports another service; only the launcher (the CLI and the supervisor
  that starts every component) and the `kvflow` package (the offline engine, which composes
  the services' cores in one process) reach into several.
- `shared/` imports no service, `kvflow`, `kernels` or `benchmarks`.
- Only the executor imports `kernels`; only the launcher (the `kvflow bench` entry) imports
  `benchmarks`, and benchmarks reach the engine through `kvflow` (and its messages, config and
  kernels), never through a service's internals.
- Nothing installed (`kvflow`, the services, `shared`, `kernels`, `benchmarks`) imports
  `sweeps`, the research scripts that live beside the package in a checkout.
- The scheduler and the frontend never load torch, however indirectly.
- Tests reach their helpers as modules of the `tests` package.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("kvflow", "services", "shared")
# What the import rules read: the product and the two packages that serve it (all installed).
LAYERED = (*PRODUCT, "kernels", "benchmarks")
SERVICES = sorted(p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").is_file())
COMPOSITION_ROOTS = ("services/launcher", "kvflow")


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name a file imports (`from a.b import c` counts as `a.b`)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def product_files(packages: tuple[str, ...] = PRODUCT) -> list[Path]:
    return sorted(f for package in packages for f in (ROOT / package).rglob("*.py"))


def owner(path: Path) -> str:
    """`services/<name>` for a service's file, else the top-level package."""
    parts = path.relative_to(ROOT).parts
    return "/".join(parts[:2]) if parts[0] == "services" and len(parts) > 2 else parts[0]


def violations(rule: str) -> list[str]:
    found = []
    for path in product_files(LAYERED):
        where = owner(path)
        for module in imported_modules(path):
            top, _, rest = module.partition(".")
            target = f"services/{rest.split('.')[0]}" if top == "services" and rest else top
            if _breaks(rule, where, target):
                found.append(f"{path.relative_to(ROOT)} imports {module}")
    return found


def _breaks(rule: str, where: str, target: str) -> bool:
    if rule == "services":
        return (
            where.startswith("services/")
            and target.startswith("services/")
            and target != where
            and where not in COMPOSITION_ROOTS
        )
    if rule == "shared":
        return where == "shared" and target in ("services", "kvflow", "kernels", "benchmarks")
    if rule == "kernels":
        return target == "kernels" and where not in ("services/executor", "kernels", "benchmarks")
    if rule == "benchmarks":
        return target == "benchmarks" and where not in ("services/launcher", "benchmarks")
    if rule == "sweeps":
        return target == "sweeps"
    raise ValueError(rule)


@pytest.mark.parametrize("rule", ["services", "shared", "kernels", "benchmarks", "sweeps"])
def test_imports_follow_the_layering(rule: str) -> None:
    assert violations(rule) == []


def test_benchmarks_use_the_public_api() -> None:
    reaching_in = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted((ROOT / "benchmarks").rglob("*.py"))
        for module in imported_modules(path)
        if module.partition(".")[0] == "services"
    ]
    assert reaching_in == []


def test_the_rules_see_every_service() -> None:
    assert SERVICES == ["executor", "frontend", "launcher", "scheduler", "tokenizer"]
    assert len(product_files()) > 30
    assert {owner(p) for p in product_files(LAYERED)} >= {"kernels", "benchmarks"}


def test_the_sweeps_rule_would_catch_an_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from sweeps.linear_sweep import time_layer\nimport sweeps\n")
    assert imported_modules(probe) == {"sweeps.linear_sweep", "sweeps"}
    assert _breaks("sweeps", "benchmarks", "sweeps")
    assert not _breaks("sweeps", "benchmarks", "kernels")


@pytest.mark.parametrize("service", ["scheduler", "frontend"])
def test_service_never_loads_torch(service: str) -> None:
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in (ROOT / "services" / service).rglob("*.py")
        if p.name != "__main__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "heavy = sorted(m for m in ('torch', 'triton', 'kernels', 'transformers') "
        "if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert loaded == "", f"importing services.{service} loads {loaded}"


def test_tests_import_their_helpers_through_the_tests_package() -> None:
    """`from tests.kernels.paged_cache import ...`, never a bare `from paged_cache import ...`,
    which works only by the accident of pytest's sys.path."""
    test_files = sorted((ROOT / "tests").rglob("*.py"))
    stems = {p.stem for p in test_files} - {"__init__", "conftest"}
    bare = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in test_files
        for module in imported_modules(path)
        if module.partition(".")[0] in stems
    ]
    assert bare == []
