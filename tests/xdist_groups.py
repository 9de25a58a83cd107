"""Which tests run together on one pytest-xdist worker (`--dist loadgroup`, pyproject.toml).

A fixture wider than a test but narrower than the session (a `kvflow serve`, a loaded reference
model, a fuzzed component) is built in each worker that runs a test needing it; so tests that
share one (the same fixture, with the same parameter) form a group that one worker runs: a
package-scoped fixture's (tests/e2e/conftest.py's shared servers) wherever they are, a module-
or class-scoped one's within its module. Docker tests share one engine and compose project: one
worker runs them, one at a time. Session fixtures are built once per worker. A test may name
its group itself (`@pytest.mark.xdist_group("name")`).

pytest-xdist 3.8 tells the controller a test's group by appending it to the test's node id,
which pytest 9.2 no longer reads back (`item._nodeid`); so here the workers write each test's
group to a file, and the controller's scheduler (xdist's own loadgroup scheduler, fed from the
file) reads it. tests/conftest.py imports the hooks.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

_OPTION = "kvflow_xdist_groups"  # workerinput key: the folder the groups are written to


# -- on every process: the groups


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    groups = _Groups()
    keyed = [(item, _shared_fixtures(item)) for item in items]
    for _, keys in keyed:
        for key in keys[1:]:
            groups.join(keys[0], key)
    for item, keys in keyed:
        if keys and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(groups.name(keys[0])))


def _shared_fixtures(item: pytest.Item) -> list[str]:
    """What the test shares with others: the wider-than-a-test fixtures it uses (by module and
    parameter), or Docker."""
    if item.get_closest_marker("docker") is not None:
        return ["docker"]
    info = getattr(item, "_fixtureinfo", None)  # a Function's; other items have no fixtures
    if info is None:
        return []
    callspec = getattr(item, "callspec", None)
    indices = callspec.indices if callspec is not None else {}
    module = item.nodeid.split("::")[0]
    keys = []
    for name, defs in sorted(info.name2fixturedefs.items()):
        scope = defs[-1].scope
        if scope in ("module", "class", "package"):
            where = "" if scope == "package" else f"{module}::"
            param = f"[{indices[name]}]" if name in indices else ""
            keys.append(f"{where}{name}{param}")
    return keys


class _Groups:
    """Union-find over fixture keys: tests joined through any shared fixture form one group,
    named by its widest fixture (package-scoped first), then in sorted order."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, key: str) -> str:
        self.parent.setdefault(key, key)
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]
            key = self.parent[key]
        return key

    def join(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            first, second = sorted((ra, rb), key=lambda key: ("::" in key, key))
            self.parent[second] = first

    def name(self, key: str) -> str:
        return self.find(key)


# -- on a worker: tell the controller


class _Report:
    """Registered on a worker: writes each test's group (by the node id the worker reports it
    under) where the controller reads it, before the worker reports its collection."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    @pytest.hookimpl(trylast=True)  # after xdist's own hook, which may change the node ids
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        groups = {}
        for item in items:
            names = sorted({_mark_name(mark) for mark in item.iter_markers("xdist_group")})
            if names:
                groups[item.nodeid] = "_".join(names)
        path = self.folder / f"{os.getpid()}.json"
        path.with_suffix(".tmp").write_text(json.dumps(groups))
        path.with_suffix(".tmp").rename(path)


def _mark_name(mark: pytest.Mark) -> str:
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


# -- on the controller


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # a worker
        if _OPTION in workerinput:
            config.pluginmanager.register(_Report(workerinput[_OPTION]))
    elif config.getoption("dist", "no") == "loadgroup":
        config.stash[_FOLDER] = tempfile.mkdtemp(prefix="kvflow-xdist-groups-")


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_FOLDER, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    folder = node.config.stash.get(_FOLDER, None)
    if folder is not None:
        node.workerinput[_OPTION] = folder


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    folder = config.stash.get(_FOLDER, None)
    if folder is None:
        return None  # xdist picks the scheduler --dist names
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's loadgroup: a group's tests go to one worker, other tests one by one."""

        def __init__(self) -> None:
            super().__init__(config, log)
            self.groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # the workers have all collected by the first call
                self.groups = {}
                for path in sorted(Path(folder).glob("*.json")):
                    self.groups.update(json.loads(path.read_text()))
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling()


_FOLDER = pytest.StashKey[str]()
