"""Prefill/decode disaggregation in the scheduler (--prefill-replicas).

A prefill engine's request that hands over (KVTransfer.export) ends with its first token; the
plan whose step completes its prompt exports the prompt's full blocks (KVExport), which the
executor copies out after that step's forward pass, while the blocks are still the request's.

A decode engine's request fetches the prompt blocks it lacks from the prefill engine that
computed them; what becomes of them once the executor reports the fetch:

A request handed over (KVTransfer.source) arrives with its prompt and the prefill engine's
first token. At its first admission, the prompt's full blocks that neither this engine's
prefix cache nor its host tier holds are imported: new blocks, counted as computed, that the
executor fills from the prefill engine's executors before the plan's forward pass (KVImport).
Until the step is reported, the request's blocks are not cached (another request could find
them) and it runs no further step. A fetch that failed voids that step's token: the request
starts over and computes its prompt here. Either way it imports at most once.
"""

from __future__ import annotations

from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request
from shared.protocol import KVExport, KVImport, KVTransferStats, SchedulerOutput


class Handovers:
    def __init__(self, kv: KVCacheManager, block_bytes: int) -> None:
        self.kv = kv
        self._imports: list[KVImport] = []
        self._exports: list[KVExport] = []
        self.stats = KVTransferStats(block_bytes=block_bytes)

    def num_to_import(self, request: Request, num_hits: int) -> int:
        """The blocks after the `num_hits` found here that the request's prefill engine holds
        (the prompt's full blocks, all but those holding its last token)."""
        if request.kv_source < 0:
            return 0
        num_full = min(request.num_prompt_tokens, request.num_tokens - 1) // self.kv.block_size
        return max(num_full - num_hits, 0)

    def imported(self, request: Request, first: int, count: int) -> None:
        """The request was admitted with blocks `first` .. `first + count - 1` to import."""
        blocks = self.kv.block_ids[request.request_id][first : first + count]
        self._imports.append(KVImport(request.request_id, request.kv_source, first, blocks))
        request.kv_source = -1

    def take_imports(self) -> list[KVImport]:
        imports, self._imports = self._imports, []
        return imports

    def computed(self, request: Request) -> None:
        """A row of the plan being made takes the request to its prompt's end: if it hands
        over, its prompt's full blocks go out after the step."""
        if request.hands_over and request.num_computed_tokens == request.num_prompt_tokens:
            num_full = request.num_prompt_tokens // self.kv.block_size
            blocks = self.kv.block_ids[request.request_id][:num_full]
            if blocks:
                self._exports.append(KVExport(request.request_id, blocks))

    def take_exports(self) -> list[KVExport]:
        exports, self._exports = self._exports, []
        self.stats.blocks_exported += sum(len(export.block_ids) for export in exports)
        return exports

    def reported(self, plan: SchedulerOutput, failed: set[str], seconds: float) -> None:
        """The plan's imports are done (in `seconds`): those not `failed` are good, and may
        be cached."""
        self.stats.import_seconds += seconds
        for entry in plan.kv_imports:
            if entry.request_id in failed:
                self.stats.failed_imports += 1
            else:
                self.stats.blocks_imported += len(entry.block_ids)
            self.kv.unconfirmed.discard(entry.request_id)

    def waits(self, request: Request) -> bool:
        """Whether the request waits for its import to be reported before its next step."""
        return request.request_id in self.kv.unconfirmed
