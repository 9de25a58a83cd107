"""Lists of integers onto the device in one copy from pinned memory.

A speculative proposer stages its catch-up's host inputs after every step (step_proposer.py):
some rows' worth of positions, block counts and drafts. One asynchronous copy moves them all,
from two pinned mirrors in turn: a copy is queued after its step's forward pass, and the next
step's lists are written while that copy may still run. On the CPU the mirror is the buffer.
"""

from __future__ import annotations

import torch

# Each list starts on 16 bytes (an even int64 index). Triton specialises a kernel on whether a
# pointer is 16-byte aligned; a list's offset follows the step's rows, so an unaligned start
# would compile a new variant inside a running server.
_ALIGN = 2


class ListUpload:
    """Holds room for `size` values in all (each list's alignment padding included)."""

    def __init__(self, size: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = [torch.zeros(size, dtype=torch.int64, pin_memory=pin) for _ in "ab"]
        self.device = self.host[0].to(device) if pin else self.host[0]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._uploads = 0

    @staticmethod
    def room(*sizes: int) -> int:
        """The values lists of at most these sizes take."""
        return sum(size + _ALIGN - 1 for size in sizes)

    def send(self, *lists: list[int]) -> list[torch.Tensor]:
        """The lists on the device, as int64 views of one buffer, each 16-byte aligned."""
        mirror = self._uploads % 2
        self._uploads += 1
        copied = self._copied[mirror]
        if copied is not None:  # two uploads ago: its step is collected, so long done
            copied.synchronize()
        sizes = [len(values) for values in lists]
        padded = [-(-size // _ALIGN) * _ALIGN for size in sizes]
        flat: list[int] = []
        for values, room in zip(lists, padded, strict=True):
            flat += values + [0] * (room - len(values))
        host = self.host[mirror][: len(flat)]
        host.copy_(torch.tensor(flat, dtype=torch.int64))
        device = self.device[: len(flat)]
        if device.device.type == "cuda":
            device.copy_(host, non_blocking=True)
            self._copied[mirror] = torch.cuda.Event()
            self._copied[mirror].record()
        else:
            device = host
        return [part[:size] for part, size in zip(device.split(padded), sizes, strict=True)]
