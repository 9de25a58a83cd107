"""Triton's compiler reads only constexpr globals in a kernel; its CPU interpreter reads any.
A plain int global passes every interpreted test and fails on the first GPU compile, so the
kernels are checked for them here."""

from __future__ import annotations

import importlib
import pkgutil

import triton
import triton.language as tl

import kernels


def _plain_number_globals() -> list[str]:
    found = []
    for info in pkgutil.iter_modules(kernels.__path__):
        if not info.name.startswith("triton_"):
            continue
        module = importlib.import_module(f"kernels.{info.name}")
        for name, obj in vars(module).items():
            if not isinstance(obj, triton.runtime.jit.JITFunction):
                continue
            function = obj.fn
            for used in function.__code__.co_names:
                value = function.__globals__.get(used)
                if isinstance(value, int | float) and not isinstance(value, tl.constexpr):
                    found.append(f"{info.name}.{name} reads {used}")
    return found


def test_kernels_read_only_constexpr_globals() -> None:
    assert _plain_number_globals() == []
