"""Random interleavings of add / step / abort against the scheduler's invariants.

A state machine plays the engine: it replays the executor's side of every plan (its
per-request state built from the incremental deltas, and a fake KV cache that stores the
token id written at each slot, and the LoRA adapter it was computed under, read back at every
position a step's queries see in each layer group (those in a sliding group's window: the blocks
behind it return to the pool), copied to and from
a fake host tier as each plan's host copies say, and handed over: a request that hands over
exports its prompt's blocks, and a later request continues it, importing them back, or
failing to), so a prefix hit on a block that was never written or was written under another
adapter, a restored or imported block that holds anything else, a delta that disagrees with
the scheduler, a plan with more adapters than slots, or a leaked block all fail here.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from services.scheduler.kv_cache_manager import group_key, window_blocks
from services.scheduler.scheduler import Scheduler
from services.scheduler.scheduler_config import SchedulerConfig
from shared.protocol import (
    EngineRequest,
    FinishReason,
    KVTransfer,
    ModelRunnerOutput,
    ParameterError,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
)

BLOCK_SIZE = 4
VOCAB = 4  # prompts use token ids 0..3, so prefixes collide and the prefix cache hits
EOS = VOCAB
STOP = VOCAB + 1  # a stop_token_id some requests ask for
LORA_IDS = (1, 2, 3)  # registered adapters; requests run under one of them or the base model
BASES = [random.Random(seed).choices(range(VOCAB), k=40) for seed in range(3)]
MAX_DRAIN_STEPS = 2_000


@st.composite
def prompts(draw: st.DrawFn) -> list[int]:
    """1..40 tokens: the start of one of a few shared sequences, then random tokens."""
    length = draw(st.integers(1, 12) | st.integers(1, 40))
    num_shared = draw(st.integers(0, length) | st.just(length))
    tail = st.integers(0, VOCAB - 1)
    num_tail = length - num_shared
    return draw(st.sampled_from(BASES))[:num_shared] + draw(
        st.lists(tail, min_size=num_tail, max_size=num_tail)
    )


request_params = st.builds(
    SamplingParams,
    max_tokens=(st.integers(1, 8) | st.integers(0, 24)).map(lambda n: n or None),
    min_tokens=st.integers(0, 2),
    ignore_eos=st.booleans(),
    stop_token_ids=st.sampled_from([[], [STOP]]),
)
# Mostly ordinary tokens; now and then EOS or the stop token.
sampled_tokens = st.sampled_from([*range(VOCAB)] * 6 + [EOS, STOP])


def expected_rejection(
    config: SchedulerConfig, prompt_len: int, max_tokens: int | None, min_tokens: int
) -> str | None:
    """The parameter admission must reject, in the order the scheduler checks them."""
    if max_tokens is not None and min_tokens > max_tokens:
        return "min_tokens"
    if prompt_len >= config.max_model_len:
        return "prompt"
    total = config.max_model_len if max_tokens is None else prompt_len + max_tokens
    if total > config.max_model_len:
        return "max_tokens"
    if not config.enable_chunked_prefill and prompt_len > config.max_num_batched_tokens:
        return "prompt"
    logical, step = -(-total // config.block_size), min(config.max_num_batched_tokens, total)
    blocks = sum(  # a sliding group's behind the window return to the pool
        logical if window is None else min(logical, window_blocks(window, step, BLOCK_SIZE))
        for window in config.kv_windows
    )
    usable = config.num_blocks - any(config.kv_windows)  # the null block
    if blocks > usable:
        return "max_tokens"
    return None


@dataclass
class Tracked:
    """What the test knows of one admitted request, from the outputs it was sent."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    outputs: list[int] = field(default_factory=list)
    ends: list[FinishReason] = field(default_factory=list)
    hands_over: bool = False  # KVTransfer.export: ends after its first token, handed over
    lora_id: int = 0


@dataclass
class ExecutorState:
    """The executor's memory of one request, built only from plans."""

    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    lora_id: int


def expected_finish(config: SchedulerConfig, tracked: Tracked) -> FinishReason | None:
    params, num_out, last = tracked.params, len(tracked.outputs), tracked.outputs[-1]
    is_stop = last in params.stop_token_ids or (last == EOS and not params.ignore_eos)
    if is_stop and num_out >= params.min_tokens:
        return FinishReason.STOP
    if num_out >= tracked.max_tokens or len(tracked.prompt) + num_out >= config.max_model_len:
        return FinishReason.LENGTH
    return FinishReason.LENGTH if tracked.hands_over else None


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        # Half the time a tight pool and budget, where preemption and chunking happen.
        num_blocks=st.integers(6, 12) | st.integers(6, 40),
        budget=st.integers(4, 16) | st.integers(4, 64),
        max_num_seqs=st.integers(1, 8),
        max_model_len=st.integers(24, 96),
        prefix_caching=st.booleans(),
        chunked=st.booleans(),
        initial_requests=st.lists(st.tuples(prompts(), request_params), min_size=1, max_size=8),
        end_by_abort=st.sampled_from([False, False, True]),
        policy=st.sampled_from(["fcfs", "priority"]),
        max_loras=st.integers(1, 2),
        host_blocks=st.sampled_from([0, 0, 1, 3, 12]),
        disk_blocks=st.sampled_from([0, 0, 2, 8, 30]),
        # Layer groups: one full (most), one sliding, or full and sliding ones side by side
        windows=st.sampled_from(
            [(None,), (None,), (1,), (3,), (6,), (9,), (None, 3), (None, 6), (5, None, 2)]
        ),
    )
    def configure(
        self,
        num_blocks: int,
        budget: int,
        max_num_seqs: int,
        max_model_len: int,
        prefix_caching: bool,
        chunked: bool,
        initial_requests: list[tuple[list[int], SamplingParams]],
        end_by_abort: bool,
        policy: str,
        max_loras: int,
        host_blocks: int,
        disk_blocks: int,
        windows: tuple[int | None, ...],
    ) -> None:
        self.config = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            enable_prefix_caching=prefix_caching,
            enable_chunked_prefill=chunked,
            eos_token_ids=(EOS,),
            scheduling_policy=policy,
            max_loras=max_loras,
            num_host_blocks=host_blocks,
            num_disk_blocks=disk_blocks if host_blocks else 0,
            kv_windows=windows,
        )
        self.scheduler = Scheduler(self.config)
        event(f"{len(windows)} layer groups, windows {windows}")
        for lora_id in LORA_IDS:
            self.scheduler.add_lora(lora_id)
        self.tracked: dict[str, Tracked] = {}
        self.executor: dict[str, ExecutorState] = {}
        # (block, offset) -> (adapter, token id) written there
        self.kv_slots: dict[tuple[int, int], tuple[int, int]] = {}
        # host slot -> its block's (adapter, token id) at each offset (None: never written)
        self.host_slots: dict[int, list[tuple[int, int] | None]] = {}
        # the disk tier's files: block hash -> what the host slot written held
        self.disk_files: dict[bytes, list[tuple[int, int] | None]] = {}
        # reads not reported yet, oldest first: (hash, host slot, what the file held or None)
        self.disk_out: list[tuple[bytes, int, list[tuple[int, int] | None] | None]] = []
        # Handovers: an export's blocks as (adapter, token id) at each offset, by request id;
        # and which export each continuing request imports from.
        self.exports: dict[str, list[list[tuple[int, int]]]] = {}
        self.import_from: dict[str, str] = {}
        self.handed_over: list[str] = []  # requests that ended handed over, in order
        self.next_id = 0
        self.end_by_abort = end_by_abort  # else teardown runs everything to completion
        for prompt, params in initial_requests:
            self.add(prompt, params)

    # ------------------------------------------------------------ rules

    @rule(
        prompt=prompts(),
        params=request_params,
        priority=st.integers(-2, 2),
        lora_id=st.sampled_from((0, *LORA_IDS)),
        hands_over=st.sampled_from([False, False, False, True]),
    )
    def add(
        self,
        prompt: list[int],
        params: SamplingParams,
        priority: int = 0,
        lora_id: int = 0,
        hands_over: bool = False,
    ) -> None:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        if self.config.scheduling_policy != "priority":
            priority = 0
        hands_over = hands_over and self.config.kv_windows == (None,)  # a prefill replica: one
        max_tokens = params.max_tokens
        rejection = expected_rejection(self.config, len(prompt), max_tokens, params.min_tokens)
        request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            priority=priority,
            lora_id=lora_id,
            kv_transfer=KVTransfer(export=True) if hands_over else None,
        )
        try:
            self.scheduler.add_request(request)
        except ParameterError as error:
            event(f"rejected: {error.param}")
            assert error.param == rejection
            return
        assert rejection is None
        resolved = self.config.max_model_len - len(prompt) if max_tokens is None else max_tokens
        self.tracked[request_id] = Tracked(
            prompt, params, resolved, hands_over=hands_over, lora_id=lora_id
        )

    @rule(data=st.data())
    def continue_handed_over(self, data: st.DataObject) -> None:
        """A decode engine's request for a handed-over one (this engine's own: source 0),
        whose export may since have been fetched."""
        if not self.handed_over:
            return
        source_id = data.draw(st.sampled_from(self.handed_over))
        source = self.tracked[source_id]
        request_id = f"r{self.next_id}"
        self.next_id += 1
        self.scheduler.add_request(
            EngineRequest(
                request_id=request_id,
                prompt_token_ids=source.prompt,
                sampling_params=source.params,
                lora_id=source.lora_id,
                output_token_ids=source.outputs[:1],
                kv_transfer=KVTransfer(source=0),
            )
        )
        self.import_from[request_id] = source_id
        self.tracked[request_id] = Tracked(
            source.prompt, source.params, source.max_tokens, source.outputs[:1], [], False,
            source.lora_id,
        )  # fmt: skip

    @rule(data=st.data())
    def add_duplicate(self, data: st.DataObject) -> None:
        if not self.live_ids():
            return
        request_id = data.draw(st.sampled_from(self.live_ids()))
        request = EngineRequest(
            request_id=request_id, prompt_token_ids=[0], sampling_params=SamplingParams()
        )
        try:
            self.scheduler.add_request(request)
        except ParameterError as error:
            assert error.param == "request_id"
        else:
            raise AssertionError("a duplicate request_id was admitted")

    @rule(
        data=st.data(),
        num_steps=st.integers(1, 8),
        abort_in_flight=st.sampled_from([False, False, False, True]),
    )
    def step(self, data: st.DataObject, num_steps: int, abort_in_flight: bool) -> None:
        """Run steps; maybe abort one request of the last step between its plan and its tokens."""

        def abort_one(plan: SchedulerOutput) -> None:
            if plan.num_scheduled_tokens:
                victim = data.draw(st.sampled_from(sorted(plan.num_scheduled_tokens)))
                self.record(self.scheduler.abort([victim]))

        for index in range(num_steps):
            last = index == num_steps - 1
            before_update = abort_one if abort_in_flight and last else lambda plan: None
            drawn = lambda: data.draw(st.booleans())  # noqa: E731
            self.run_step(lambda: data.draw(sampled_tokens), before_update, drawn, drawn)
            if self.handed_over and data.draw(st.booleans()):  # as the tokenizer worker would
                self.continue_handed_over(data)

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        if not self.live_ids():
            return
        request_id = data.draw(st.sampled_from(self.live_ids()))
        ended = [rid for rid, tracked in self.tracked.items() if tracked.ends][-2:]
        # Ended and unknown ids are no-ops: only `request_id` ends.
        outputs = self.scheduler.abort([*ended, request_id, "no-such-request", request_id])
        assert [(o.request_id, o.finish_reason) for o in outputs] == [
            (request_id, FinishReason.ABORT)
        ]
        self.record(outputs)

    # ------------------------------------------------------------ one engine step

    def run_step(
        self,
        draw_token: Callable[[], int],
        before_update: Callable[[SchedulerOutput], None] = lambda plan: None,
        fetch_fails: Callable[[], bool] = lambda: False,
        read_late: Callable[[], bool] = lambda: False,  # a disk read still out at the report
    ) -> None:
        plan = self.scheduler.schedule()
        self.check_plan(plan)
        failed = self.import_blocks(plan, fetch_fails)
        loaded, missed = self.read_disk(plan, fetch_fails, read_late)
        sampled = self.execute(plan, draw_token, failed)
        self.export_blocks(plan)  # after the step's forward pass
        before_update(plan)
        result = ModelRunnerOutput(
            step=plan.step, sampled=sampled, kv_import_failed=failed, disk_loaded=loaded,
            disk_load_failed=missed,
        )  # fmt: skip
        self.record(self.scheduler.update(plan, result))

    def check_plan(self, plan: SchedulerOutput) -> None:
        assert plan.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len(plan.num_scheduled_tokens) <= self.config.max_num_seqs
        assert all(n > 0 for n in plan.num_scheduled_tokens.values())
        if any(c.request_id in plan.finished_request_ids for c in self.scheduler.waiting):
            event("preempted")
        if any(plan.num_scheduled_tokens[c.request_id] > 1 for c in plan.cached_requests):
            event("chunked prefill")
        loras = {self.scheduler.requests[rid].lora_id for rid in plan.num_scheduled_tokens}
        assert len(loras - {0}) <= self.config.max_loras, "more adapters than slots in a step"
        if any(r.lora_id not in loras for r in self.scheduler.waiting):
            event("a request waits for an adapter slot")
        for new in plan.new_requests:
            event("prefix hit" if new.num_computed_tokens else "prefix miss")
            if self.scheduler.kv.null_block in new.block_ids:
                event("a prefix hit of the window's blocks only")
            if new.output_token_ids:
                event("resumed after preemption")

    def export_blocks(self, plan: SchedulerOutput) -> None:
        """The full blocks of a prompt that hands over hold it once the step completing it has
        run."""
        for export in plan.kv_exports:
            tracked = self.tracked[export.request_id]
            assert tracked.hands_over and not tracked.outputs
            assert len(export.block_ids) == len(tracked.prompt) // BLOCK_SIZE
            blocks = []
            for index, block in enumerate(export.block_ids):
                values = [self.kv_slots.get((block, i)) for i in range(BLOCK_SIZE)]
                prompt = tracked.prompt[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
                assert values == [(tracked.lora_id, t) for t in prompt], "exports stale KV"
                blocks.append(values)
            self.exports[export.request_id] = blocks  # type: ignore[assignment]
            event("exported")

    def import_blocks(self, plan: SchedulerOutput, fetch_fails: Callable[[], bool]) -> list[str]:
        """Each import's blocks from its export, unless the fetch fails: then garbage."""
        failed = []
        for entry in plan.kv_imports:
            source = self.exports.pop(self.import_from[entry.request_id], None)
            fails = source is None or fetch_fails()
            for index, block in enumerate(entry.block_ids):
                for offset in range(BLOCK_SIZE):
                    value = (-1, -1) if fails else source[entry.first + index][offset]  # type: ignore[index]
                    self.kv_slots[(block, offset)] = value
            if fails:
                failed.append(entry.request_id)
            event("import failed" if fails else "imported")
        return failed

    def execute(
        self, plan: SchedulerOutput, draw_token: Callable[[], int], failed: list[str]
    ) -> dict[str, int]:
        """The executor's side: the host tier's copies, apply the deltas, write and read the
        fake KV, sample (a row whose import failed reads garbage: its token is void)."""
        self.copy_host_blocks(plan)
        self.apply_plan(plan)
        groups = range(len(self.config.kv_windows))
        seen_from: dict[str, list[int]] = {}  # each group's first position the queries see
        for request_id, num_new in plan.num_scheduled_tokens.items():
            state = self.executor[request_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_new
            seen_from[request_id] = [self.first_seen(start, g) for g in groups]
            held = self.scheduler.kv.block_ids[request_id]
            for group, first in enumerate(seen_from[request_id]):  # those before: passed
                index = first // BLOCK_SIZE * len(groups) + group
                assert state.block_ids[index :: len(groups)] == held[index :: len(groups)]
            assert end <= len(state.token_ids)
            assert self.scheduler.requests[request_id].num_computed_tokens == end
            for position in range(start, end):
                written = (state.lora_id, state.token_ids[position])
                for group in groups:
                    self.kv_slots[self.slot(state, position, group)] = written
            state.num_computed_tokens = end
        # NOTE: every write of the step lands before any read, as in the executor's layers.
        for request_id in plan.num_scheduled_tokens:
            state = self.executor[request_id]
            if request_id in failed:
                continue
            for group, first in enumerate(seen_from[request_id]):
                for position in range(first, state.num_computed_tokens):
                    written = self.kv_slots.get(self.slot(state, position, group))
                    expected = (state.lora_id, state.token_ids[position])
                    assert written == expected, f"{request_id} reads stale KV or another's"
        sampled = {}
        for request_id in plan.num_scheduled_tokens:
            state = self.executor[request_id]
            if state.num_computed_tokens == len(state.token_ids):
                sampled[request_id] = [draw_token()]
                state.token_ids.extend(sampled[request_id])
        return sampled

    def read_disk(
        self, plan: SchedulerOutput, fails: Callable[[], bool], late: Callable[[], bool]
    ) -> tuple[list[bytes], list[bytes]]:
        """The disk tier's deletes, then its reads into host slots (a file gone, or one that
        fails its checksum: a miss, the slot holding garbage); and the reads done by the
        report: a read may still be out (`late`), but a step that ran no rows reports one."""
        copies = plan.host_copies
        if copies is not None:
            for block_hash in copies.disk_deletes:
                assert self.disk_files.pop(block_hash, None) is not None, "an unwritten file"
            for block_hash, slot in copies.disk_loads:
                held = self.disk_files.get(block_hash)
                corrupted = block_hash[0] % 4 == 0 or fails()  # a quarter of the files, or drawn
                self.disk_out.append((block_hash, slot, None if corrupted else held))
        done = [read for read in self.disk_out if not late()]
        if not done and self.disk_out and not plan.num_scheduled_tokens:
            done = self.disk_out[:1]
            event("an idle step waits for a disk read")
        loaded, missed = [], []
        for read in done:
            self.disk_out.remove(read)
            block_hash, slot, held = read
            self.host_slots[slot] = held or [(-1, -1)] * BLOCK_SIZE  # type: ignore[list-item]
            (loaded if held is not None else missed).append(block_hash)
            event("read from the disk tier" if held is not None else "a disk tier miss")
        if len(done) < len(self.disk_out) + len(done):
            event("a disk read reported with a later step")
        return loaded, missed

    def copy_host_blocks(self, plan: SchedulerOutput) -> None:
        """Offloads (written through to disk where the plan says), then onloads, before any
        write of the step (services/executor/runner/host_kv.py)."""
        if plan.host_copies is None:
            return
        for block, block_hash in plan.host_copies.disk_direct:
            self.disk_files[block_hash] = [self.kv_slots.get((block, i)) for i in range(BLOCK_SIZE)]
            event("written to the disk tier from the GPU")
        for block, slot in plan.host_copies.offloads:
            self.host_slots[slot] = [self.kv_slots.get((block, i)) for i in range(BLOCK_SIZE)]
            event("offloaded to the host tier")
        for slot, block_hash in plan.host_copies.disk_stores:
            self.disk_files[block_hash] = list(self.host_slots[slot])
            event("written to the disk tier")
        for slot, block in plan.host_copies.onloads:
            for offset, value in enumerate(self.host_slots[slot]):
                if value is None:
                    self.kv_slots.pop((block, offset), None)
                else:
                    self.kv_slots[(block, offset)] = value
            event(f"restored from the host tier, {len(self.config.kv_windows)} layer groups")

    def apply_plan(self, plan: SchedulerOutput) -> None:
        for request_id in plan.finished_request_ids:
            self.executor.pop(request_id, None)
        for new in plan.new_requests:
            assert new.request_id not in self.executor, "new request the executor already holds"
            tracked = self.tracked[new.request_id]
            assert new.prompt_token_ids == tracked.prompt
            assert new.output_token_ids == tracked.outputs
            self.executor[new.request_id] = ExecutorState(
                new.prompt_token_ids + new.output_token_ids,
                list(new.block_ids),
                new.num_computed_tokens,
                new.lora_id,
            )
        for delta in plan.cached_requests:
            state = self.executor[delta.request_id]
            assert delta.num_computed_tokens == state.num_computed_tokens
            state.block_ids.extend(delta.new_block_ids)
        assert set(self.executor) == {r.request_id for r in self.scheduler.running}

    def first_seen(self, start: int, group: int) -> int:
        """The first position a group's queries from `start` on read: 0, or the window's."""
        window = self.config.kv_windows[group]
        return 0 if window is None else max(start - window + 1, 0)

    def slot(self, state: ExecutorState, position: int, group: int = 0) -> tuple[int, int]:
        """Where a group's KV of `position` is: a request's blocks are each group's in turn."""
        index = position // BLOCK_SIZE * len(self.config.kv_windows) + group
        return state.block_ids[index], position % BLOCK_SIZE

    def record(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            tracked = self.tracked[output.request_id]
            assert not tracked.ends, f"{output.request_id} got output after it ended"
            if output.finish_reason is FinishReason.ABORT:
                assert output.new_token_ids == []
            else:
                assert len(output.new_token_ids) == 1
                tracked.outputs += output.new_token_ids
                assert output.finish_reason == expected_finish(self.config, tracked)
                # Handed over: where it would have gone on, but for that.
                ends_here = expected_finish(self.config, replace(tracked, hands_over=False))
                assert output.handed_over == (tracked.hands_over and ends_here is None)
                if output.handed_over:
                    self.handed_over.append(output.request_id)
                    event("handed over")
            if output.finished:
                event(f"finished: {output.finish_reason.value}")
                tracked.ends.append(output.finish_reason)

    def live_ids(self) -> list[str]:
        return sorted(self.scheduler.requests)

    # ------------------------------------------------------------ invariants

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        scheduler = self.scheduler
        scheduler.check_invariants()
        assert sum(scheduler.kv.pool.counts()) == self.config.num_blocks
        for request in scheduler.waiting:
            assert request.request_id not in scheduler.kv.block_ids, "a waiting request holds KV"
        windows = self.config.kv_windows
        step = self.config.max_num_batched_tokens
        for request in scheduler.running:
            blocks = scheduler.kv.block_ids[request.request_id]
            logical = scheduler.kv.num_blocks_for(request.num_computed_tokens)
            assert len(blocks) == logical * len(windows)
            for group, window in enumerate(windows):
                own = blocks[group :: len(windows)]
                held = [block for block in own if block != scheduler.kv.null_block]
                if window is None:
                    assert len(held) == logical, "a full group gave a block back"
                    continue
                assert len(held) <= window_blocks(window, step, BLOCK_SIZE)
                event("a block passed the window" if len(held) < logical else "in the window")
            for index, block in enumerate(blocks):
                if block == scheduler.kv.null_block:
                    continue
                block_hash = scheduler.kv.pool.block_hash[block]
                logical_index, group = divmod(index, len(windows))
                if block_hash is not None:
                    key = group_key(request.block_hashes[logical_index], group)
                    assert block_hash == key, "block under a wrong key"

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        if self.end_by_abort:
            self.record(self.scheduler.abort(self.live_ids()))
        every_other = itertools.cycle([True, False])  # disk reads out a step longer, or not
        for _ in range(MAX_DRAIN_STEPS):
            if not self.scheduler.has_unfinished():
                break
            self.run_step(lambda: 0, read_late=lambda: next(every_other))
            self.blocks_are_accounted_for()
        assert not self.scheduler.has_unfinished(), "requests never finished"
        self.run_step(lambda: 0)  # the executor drops the last finished requests
        assert self.executor == {}
        null = any(self.config.kv_windows)  # the null block stays referenced
        assert self.scheduler.kv.pool.counts()[2] == null
        for request_id, tracked in self.tracked.items():
            assert len(tracked.ends) == 1, f"{request_id} ended {len(tracked.ends)} times"
            assert tracked.ends[0] in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT)


SchedulerMachine.TestCase.settings = settings(
    derandomize=True, database=None, max_examples=150, stateful_step_count=40, deadline=None
)
TestScheduler = SchedulerMachine.TestCase


class TieredSchedulerMachine(SchedulerMachine):
    """The same machine where the KV tiers always work: a tight pool with prefix caching, a
    host tier, and a disk tier behind it (its reads missing at times)."""

    def _tiered(
        self,
        num_blocks: int,
        budget: int,
        max_num_seqs: int,
        max_model_len: int,
        chunked: bool,
        initial_requests: list[tuple[list[int], SamplingParams]],
        host_blocks: int,
        disk_blocks: int,
        windows: tuple[int | None, ...],
    ) -> None:
        super().configure(
            num_blocks, budget, max_num_seqs, max_model_len, True, chunked, initial_requests,
            False, "fcfs", 2, host_blocks, disk_blocks, windows,
        )  # fmt: skip

    configure = initialize(  # type: ignore[assignment]
        num_blocks=st.integers(6, 10),
        budget=st.integers(4, 24),
        max_num_seqs=st.integers(1, 6),
        max_model_len=st.integers(24, 64),
        chunked=st.booleans(),
        initial_requests=st.lists(st.tuples(prompts(), request_params), min_size=1, max_size=8),
        host_blocks=st.sampled_from([1, 2, 4]),
        disk_blocks=st.sampled_from([1, 3, 8, 30]),
        windows=st.just((None,)),
    )(_tiered)


TieredSchedulerMachine.TestCase.settings = settings(
    derandomize=True, database=None, max_examples=100, stateful_step_count=40, deadline=None
)
TestTieredScheduler = TieredSchedulerMachine.TestCase


class GroupedHostTierMachine(TieredSchedulerMachine):
    """Layer groups with a host tier large enough to restore from (without a disk tier, which
    layer groups turn off)."""

    configure = initialize(
        num_blocks=st.integers(8, 16),
        budget=st.integers(4, 24),
        max_num_seqs=st.integers(1, 6),
        max_model_len=st.integers(24, 64),
        chunked=st.booleans(),
        initial_requests=st.lists(st.tuples(prompts(), request_params), min_size=1, max_size=8),
        host_blocks=st.sampled_from([4, 16, 30]),
        disk_blocks=st.just(0),
        windows=st.sampled_from([(None, 3), (None, 6), (5, None, 2), (2, 7)]),
    )(TieredSchedulerMachine._tiered)


GroupedHostTierMachine.TestCase.settings = settings(
    derandomize=True, database=None, max_examples=60, stateful_step_count=40, deadline=None
)
TestGroupedHostTier = GroupedHostTierMachine.TestCase
