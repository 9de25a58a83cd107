"""Pipeline stages that fit the GPU's shared memory.

Tiles are picked on an H100, whose blocks may take 227 KB of shared memory. Triton keeps
`num_stages - 1` (or `num_stages`) tiles of the loop in flight there, so a pick can need more
than GPUs with 99 KB a block have (L40S, A10, RTX 30xx/40xx; compute capability 8.6 and 8.9):
the skinny GEMV's K steps of 512 over 16 rows take 144 KB in four stages. Such a launch fails
before it runs (Triton's OutOfResources), so it is retried with one stage fewer until it fits,
and the count that fits is kept per launch variant: the GPU runs the same tile, less deeply
pipelined, instead of failing every decode step. tests/kernels/test_shared_memory_fit.py
compiles the default launches for those GPUs to show that the retries reach a fit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

from triton.runtime.errors import OutOfResources

logger = logging.getLogger(__name__)

SHARED_MEMORY = "shared memory"  # OutOfResources.name of the one resource fewer stages free
_stages_that_fit: dict[Hashable, int] = {}  # launch variant -> stages, where fewer than picked
_retrying = [True]  # off inside exact_stages()


def launch_fitting(variant: Hashable, num_stages: int, launch: Callable[[int], None]) -> None:
    """launch(num_stages), or with fewer stages where the GPU lacks the shared memory for it.

    `variant` names what decides the shared memory (kernel, constants, dtypes, device): a
    variant that needed fewer stages once starts from that count."""
    stages = _stages_that_fit.get(variant, num_stages) if _stages_that_fit else num_stages
    while True:
        try:
            launch(stages)
            return
        except OutOfResources as error:
            if error.name != SHARED_MEMORY or stages <= 1 or not _retrying[0]:
                raise
            stages -= 1
            _stages_that_fit[variant] = stages
            logger.info(
                "%s needs %s bytes of %s, the GPU gives a block %s: %d pipeline stages instead",
                variant[0] if isinstance(variant, tuple) else variant,
                error.required, error.name, error.limit, stages,
            )  # fmt: skip


@contextmanager
def exact_stages() -> Iterator[None]:
    """Launches run at the stages asked or fail: for tile sweeps, whose candidates must run
    as labelled."""
    _retrying[0] = False
    try:
        yield
    finally:
        _retrying[0] = True
