"""Prefill/decode disaggregation in the executor (--prefill-replicas; the scheduler's half is
services/scheduler/handover.py): each rank's part, the exports of a prefill replica
(runner/kv_exports.py) or the imports of a decode replica (runner/kv_imports.py), run at the
points of a step where they belong.

A prefill rank copies a prompt's blocks out right after the forward pass of the step that
completes it (the request's first token is not sampled yet, so the copy is on its way before
any decode replica can ask). A decode rank fetches a plan's imports as it takes the plan; one
that fails (the prefill executor gone or silent, the export dropped) is reported with the
step's tokens (ModelRunnerOutput.kv_import_failed). With tensor parallelism every rank fetches
its own heads from the same rank of the prefill engine, and the ranks agree on each fetch's
fate.

NOTE: the fetch runs on the executor's thread as it takes the plan: the plan before it is
then on the device, but a slow fetch delays the steps after it.
"""

from __future__ import annotations

import logging
import time

import torch

from services.executor.parallel.tensor_parallel import TensorParallel
from services.executor.runner.host_kv import HostKVPool, copy_host_kv
from services.executor.runner.kv_exports import (
    KVExports,
    buffer_slots,
    exports_on_device,
    shared_slots_file,
)
from services.executor.runner.kv_imports import KVImports
from shared.config import Config
from shared.protocol import KVExport, KVImport, ModelRunnerOutput, SchedulerOutput
from shared.wire_security import WireSecurity

logger = logging.getLogger(__name__)


def move_kv(host: HostKVPool | None, handover: Handover, plan: SchedulerOutput) -> None:
    """The plan's copies to and from the host tier and its handovers' imports, queued before
    its forward pass."""
    copy_host_kv(host, plan)
    handover.run(plan)


def report_kv(
    host: HostKVPool | None, handover: Handover, output: ModelRunnerOutput, idle: bool
) -> None:
    """What the step's imports and the disk reads came to, into its output (`idle`: the step
    ran no rows)."""
    handover.report(output)
    if host is not None:
        host.report(output, idle)


def reset_kv(host: HostKVPool | None, handover: Handover) -> None:
    """The executor dropped every step: so do the handovers, and the disk tier's jobs end
    (a new scheduler's books start from what its directory holds)."""
    handover.reset()
    if host is not None and host.disk is not None:
        host.disk.drain()


def rank_address(address: str, rank: int) -> str:
    """Tensor-parallel rank `rank`'s address of a replica's --kv-transfer-address entry."""
    if rank == 0:
        return address
    if address.startswith("tcp://"):
        host, port = address.rsplit(":", 1)
        return f"{host}:{int(port) + rank}"
    return f"{address}-{rank}"


class Handover:
    """An executor rank's part in handovers: exports (a prefill replica), imports (a decode
    replica), or neither (the server is not disaggregated)."""

    def __init__(
        self,
        exports: KVExports | None,
        imports: KVImports | None,
        tp: TensorParallel,
        device: torch.device,
    ) -> None:
        self.exports = exports
        self.imports = imports
        self.tp = tp
        self.device = device
        self.failed: dict[int, list[str]] = {}  # plan step -> its requests' failed imports
        self.to_export: dict[int, list[KVExport]] = {}  # plan step -> after its forward pass
        self.seconds: dict[int, float] = {}  # plan step -> the time its imports took

    @classmethod
    def start(cls, config: Config, kv_caches: list[torch.Tensor], tp: TensorParallel) -> Handover:
        """This rank's part (none where the server is not disaggregated)."""
        device = kv_caches[0].device
        if not config.prefill_replicas:
            return cls(None, None, tp, device)
        security = WireSecurity.of(config)
        addresses = [rank_address(a, tp.rank) for a in config.addresses("kv_transfer_address")]
        if len(addresses) != config.data_parallel_size:
            raise ValueError("--prefill-replicas needs --kv-transfer-address, one per replica")
        if config.replica >= config.prefill_replicas:
            name = f"r{config.replica}-executor-{tp.rank}"
            imports = KVImports(HostKVPool(kv_caches, 0), addresses, security, name)
            return cls(None, imports, tp, device)
        block_bytes = HostKVPool(kv_caches, 0).block_bytes
        num_slots = min(buffer_slots(config, block_bytes), kv_caches[0].shape[1])
        on_device = exports_on_device(config, device)
        shared_file = None if on_device else shared_slots_file(tp.rank, num_slots * block_bytes)
        pool = HostKVPool(kv_caches, num_slots, shared_file, on_device)
        where = f"shared at {shared_file}" if shared_file else "not shared"
        logger.info(
            "handing over KV from %s: up to %d blocks held (%.2f GiB, %s)",
            addresses[config.replica], num_slots, num_slots * block_bytes / 2**30,
            "on the GPU, shared by CUDA IPC" if on_device else where,
        )  # fmt: skip
        exports = KVExports(pool, addresses[config.replica], security, shared_file)
        return cls(exports, None, tp, device)

    def run(self, plan: SchedulerOutput) -> None:
        """The plan's imports, as the executor takes it; its exports wait for its step."""
        if self.exports is not None and plan.kv_exports:
            self.to_export.setdefault(plan.step, []).extend(plan.kv_exports)
        if not plan.kv_imports:
            return
        started = time.perf_counter()
        for entry in plan.kv_imports:
            error = self._load(entry)
            ok = self.tp.smallest(int(error is None), self.device)
            if not ok:
                logger.warning("request_id=%s: KV fetch failed: %s", entry.request_id, error)
                self.failed.setdefault(plan.step, []).append(entry.request_id)
        elapsed = time.perf_counter() - started
        self.seconds[plan.step] = self.seconds.get(plan.step, 0.0) + elapsed

    def _load(self, entry: KVImport) -> str | None:
        """One import: an error, or None once its copies are queued."""
        if self.imports is None:
            return "this replica fetches no KV (not a decode replica)"
        try:
            return self.imports.load(entry)
        except Exception as exc:  # a bad answer must fail this request, not the executor
            logger.exception("request_id=%s: KV fetch broke", entry.request_id)
            return f"{type(exc).__name__}: {exc}"

    def after_forward(self, step: int) -> None:
        """Step `step`'s forward pass is queued: copy out the prompts it completed."""
        exports = self.to_export.pop(step, None)
        if exports and self.exports is not None:
            self.exports.add(exports)

    def reset(self) -> None:
        """The executor dropped every step (a new scheduler): their handovers go too."""
        self.to_export.clear()
        self.failed.clear()
        self.seconds.clear()

    def report(self, output: ModelRunnerOutput) -> None:
        """What the step's imports came to, into its output."""
        output.kv_import_failed = self.failed.pop(output.step, [])
        output.kv_import_seconds = self.seconds.pop(output.step, 0.0)
