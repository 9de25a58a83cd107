"""Whether the decode path's Triton kernels launch with programmatic dependent launch
(kernels/triton_pdl.py, on Hopper and later). The executor sets it from `--disable-pdl`; it
lives apart from the Triton module so that processes on the CPU set it without importing Triton.
"""

from __future__ import annotations

_enabled = True


def set_pdl(enabled: bool) -> None:
    """Launch with PDL where the GPU has it (True, the default), or never (False)."""
    global _enabled
    _enabled = enabled


def pdl_enabled() -> bool:
    return _enabled
