"""--lora-modules: the LoRA adapters a server loads at start, as vLLM's flag takes them.

Each entry is `name=path`, or a JSON object `{"name": ..., "path": ..., "base_model_name": ...}`
(the base model name is what /v1/models shows as the adapter's parent; default: the served
model). They get ids 1, 2, ... in the order given: the scheduler, the executor and the frontends
read the same flag and agree on them before any message says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from shared.protocol import LoraAdapterInfo


class LoraModuleError(ValueError):
    pass


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(entries: tuple[str, ...]) -> list[LoraModule]:
    """The modules in order; LoraModuleError naming the first entry that cannot be one."""
    modules: list[LoraModule] = []
    for entry in entries:
        module = _parse(entry.strip())
        if any(m.name == module.name for m in modules):
            raise LoraModuleError(f"--lora-modules: the name {module.name!r} is given twice")
        modules.append(module)
    return modules


def static_adapters(modules: list[LoraModule]) -> dict[str, LoraAdapterInfo]:
    """The adapters of --lora-modules by name, with their ids (parent "": the served model)."""
    return {
        m.name: LoraAdapterInfo(name=m.name, lora_id=i, path=m.path, parent=m.base_model_name or "")
        for i, m in enumerate(modules, 1)
    }


def _parse(entry: str) -> LoraModule:
    if entry.startswith("{"):
        try:
            fields = json.loads(entry)
        except json.JSONDecodeError as exc:
            raise LoraModuleError(f"--lora-modules: {entry!r} is not valid JSON ({exc})") from None
        unknown = sorted(set(fields) - {"name", "path", "base_model_name"})
        if unknown:
            raise LoraModuleError(f"--lora-modules: unknown keys {unknown} in {entry!r}")
        name, path = fields.get("name"), fields.get("path")
        base = fields.get("base_model_name")
        if not isinstance(base, str | None):
            raise LoraModuleError(f"--lora-modules: base_model_name must be text in {entry!r}")
    else:
        name, _, path = entry.partition("=")
        base = None
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise LoraModuleError(
            f"--lora-modules: {entry!r} is neither name=path nor a JSON object with a name and "
            "a path"
        )
    return LoraModule(name, path, base)
