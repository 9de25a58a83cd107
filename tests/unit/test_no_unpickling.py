"""Nothing kvflow receives is unpickled or evaluated, checked on the source.

Every socket decodes msgpack into the message types of `shared.protocol` (`shared.ipc.Decoder`),
which can only build those types. This test fails the build when product code (kvflow/,
services/, shared/) imports a module that unpickles (pickle and its kin), calls pyzmq's
pickling helpers (`recv_pyobj` and the like), or calls `eval`, `exec` or `__import__`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("kvflow", "services", "shared")
UNPICKLING_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "shelve", "marshal"}
# pyzmq's helpers that pickle (or take any serializer) on the wire.
PICKLING_CALLS = {"recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized"}
EVALUATING_BUILTINS = {"eval", "exec", "__import__"}


def offences(path: Path, root: Path = ROOT) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
        else:
            modules = []
        found += [f"imports {m}" for m in modules if m.split(".")[0] in UNPICKLING_MODULES]
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in EVALUATING_BUILTINS:
                found.append(f"calls {func.id}()")
            if isinstance(func, ast.Attribute) and func.attr in PICKLING_CALLS:
                found.append(f"calls .{func.attr}()")
    return [f"{path.relative_to(root)}: {what}" for what in found]


def test_no_product_code_unpickles_or_evaluates() -> None:
    files = sorted(f for package in PRODUCT for f in (ROOT / package).rglob("*.py"))
    assert len(files) > 50  # the packages were found
    assert [o for f in files for o in offences(f)] == []


def test_the_check_sees_what_it_forbids(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import pickle\nfrom cloudpickle import loads\n"
        "x = eval('1')\nsocket.recv_pyobj()\nmodel.eval()\n"
    )
    assert sorted(offences(sample, tmp_path)) == [
        "sample.py: calls .recv_pyobj()",
        "sample.py: calls eval()",
        "sample.py: imports cloudpickle",
        "sample.py: imports pickle",
    ]
