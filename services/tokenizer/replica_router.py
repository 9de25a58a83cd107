"""Which engine replica (--data-parallel-size) a request goes to: prefix affinity, then load.

Every tokenizer worker hears every engine's KvEventBatch (services/scheduler/kv_events.py),
so each knows which block keys each engine's prefix cache holds and how busy each is. A
prompt's keys (shared/block_hashes.py) give, per engine, how many of its leading blocks are
cached there. The request goes to the engine holding the most, unless that engine is busier
than the least busy by more than the slack (`BALANCE_SLACK + BALANCE_RATIO` x the least busy's
load): then to the least busy, so a hot prefix does not starve the other engines. With no
prefix held anywhere, the least busy takes it, ties in turn. An engine that last reported its
waiting queue full is passed over while another is not.

An engine's load is its running and waiting requests: this worker's own, counted exactly (sent
and not yet ended), plus the other workers', from its last report (each report counts the
requests of every worker: its total less this worker's), moved on since by as much as this
worker's own count there moved, for each other worker (they route alike). A report lags: the
requests sent while it was made, sent and read are not in it, so an engine that reported less
often looked emptier than it was: taking the report's total less this worker's count at reading
time split a burst of 1,000 requests 534:466, and the other workers' share as reported, without
its growth since, 556:445.
The view is a hint: a lost batch (its seq skips) leaves keys that may be gone, which costs a
miss, never a wrong answer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.block_hashes import prefix_block_keys
from shared.protocol import KvEventBatch

logger = logging.getLogger(__name__)
BALANCE_SLACK = 4  # requests: an engine holding the prefix may be this much busier
BALANCE_RATIO = 0.5  # ... plus this share of the least busy engine's load
MAX_KEYS = 1 << 20  # keys remembered per engine (the oldest heard go first)


@dataclass
class EngineView:
    session: int | None = None
    next_seq: int = 0
    keys: dict[bytes, None] = field(default_factory=dict)  # oldest heard first
    others: int = 0  # the other workers' running + waiting requests, as last reported
    own: int = 0  # this worker's requests on it, sent and not yet ended
    own_reported: int = 0  # this worker's requests on it, as last reported
    other_workers: set[str] = field(default_factory=set)  # with requests on it, as reported
    full: bool = False  # its waiting queue refused new requests, as last reported

    def load(self, num_other_workers: int) -> int:
        """Running and waiting requests now: this worker's, and the other workers' as last
        reported, moved since as much as this worker's own count moved, each (the workers
        route alike: what one sent to an engine since its report, each other one likely did)."""
        moved = self.own - self.own_reported
        return max(self.others + num_other_workers * moved, 0) + self.own


class ReplicaRouter:
    def __init__(self, num_replicas: int, by_prefix: bool = True, worker: str = "") -> None:
        """`by_prefix` False: round-robin (--data-parallel-routing), whatever engines hold.
        `worker`: this worker's name, as the engines' reports count its requests."""
        self.engines = [EngineView() for _ in range(num_replicas)]
        self.by_prefix = by_prefix
        self.worker = worker
        self.block_size: int | None = None  # known from the first batch
        self._turn = 0  # where ties start: engines take cold requests in turn

    def observe(self, batch: KvEventBatch) -> None:
        if not 0 <= batch.replica < len(self.engines):
            logger.warning(
                "a KV event batch of replica %d, of %d", batch.replica, len(self.engines)
            )
            return
        engine = self.engines[batch.replica]
        if batch.session != engine.session:  # a new engine: what the old one held is gone
            engine.session, engine.keys = batch.session, {}
        elif batch.seq != engine.next_seq:
            logger.debug(
                "replica %d: KV event batches %d..%d lost",
                batch.replica,
                engine.next_seq,
                batch.seq - 1,
            )
        engine.next_seq = batch.seq + 1
        self.block_size = batch.block_size
        for key in batch.removed:
            engine.keys.pop(key, None)
        for key in batch.stored:
            engine.keys[key] = None
        while len(engine.keys) > MAX_KEYS:
            del engine.keys[next(iter(engine.keys))]
        total = batch.num_running + batch.num_waiting
        engine.own_reported = batch.num_by_worker.get(self.worker, 0)
        engine.others = max(total - engine.own_reported, 0)
        engine.other_workers = {name for name in batch.num_by_worker if name != self.worker}
        engine.full = batch.queue_full

    def cached_blocks(self, token_ids: Sequence[int], lora_id: int = 0) -> list[int]:
        """How many leading blocks of the prompt each engine holds."""
        if self.block_size is None:
            return [0] * len(self.engines)
        keys = prefix_block_keys(list(token_ids), self.block_size, lora_id)
        held = []
        for engine in self.engines:
            count = 0
            while count < len(keys) and keys[count] in engine.keys:
                count += 1
            held.append(count)
        return held

    def pick(
        self, token_ids: Sequence[int], lora_id: int = 0, among: Sequence[int] | None = None
    ) -> int:
        """The replica for a request, of `among` (default: all), counted on it until
        `release`."""
        replicas = list(range(len(self.engines)) if among is None else among)
        if len(replicas) == 1:  # no choice: no prompt keys to hash
            self.engines[replicas[0]].own += 1
            return replicas[0]
        # In turn from the last pick's successor (of all the engines).
        order = sorted(replicas, key=lambda r: (r - self._turn) % len(self.engines))
        if not self.by_prefix:
            chosen = order[0]
            self._turn = (chosen + 1) % len(self.engines)
            self.engines[chosen].own += 1
            return chosen
        held = self.cached_blocks(token_ids, lora_id)
        loads = self.loads()
        # An engine whose queue is full would refuse it (429): the others first, if any.
        order = [r for r in order if not self.engines[r].full] or order
        least = min(order, key=lambda r: loads[r])
        best = max(order, key=lambda r: (held[r], -loads[r]))
        slack = BALANCE_SLACK + BALANCE_RATIO * loads[least]
        chosen = best if held[best] and loads[best] - loads[least] <= slack else least
        self._turn = (chosen + 1) % len(self.engines)
        self.engines[chosen].own += 1
        return chosen

    def loads(self) -> list[int]:
        """Each engine's running and waiting requests, as this worker estimates them now."""
        others = len(set().union(*(engine.other_workers for engine in self.engines)))
        return [engine.load(others) for engine in self.engines]

    def release(self, replica: int) -> None:
        """A request `pick` gave `replica` has ended (finished or aborted)."""
        engine = self.engines[replica]
        engine.own = max(engine.own - 1, 0)
