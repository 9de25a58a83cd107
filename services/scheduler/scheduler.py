"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

One budget model covers every case: a request owes `num_tokens - num_computed_tokens`
tokens of forward pass (a whole prompt, the rest of a chunked prompt, or the one token of
a decode step); each step pays as many of those as the budget allows.

    prompt  [=========== computed ==========|--- scheduled now ---|... owed later ...]
            0                    num_computed_tokens        num_computed + n      num_tokens

A pipelined engine schedules step k+1 before step k's sampled tokens arrive: a request whose
step k samples owes that token too (`num_pending_tokens`), so its decode is scheduled on a
placeholder the executor fills in on the device (see ModelRunner.submit). Limits (max_tokens,
max_model_len) count pending tokens; a stop token found late costs one discarded step.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from collections.abc import Sequence

from services.scheduler.admission import admissible_max_tokens, check_queue_room
from services.scheduler.block_pool import BlockEvents
from services.scheduler.handover import Handovers
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.long_rope import crosses_original_context, settle_long_rope
from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler_config import SchedulerConfig
from services.scheduler.scheduler_view import SchedulerView
from services.scheduler.speculation import (
    SpecDecodeStats,
    add_draft_slots,
    note_proposal,
    reserve_lookahead,
)
from services.scheduler.waiting_queue import WaitingQueue, priority_key
from shared.protocol import (
    CachedRequestData,
    EngineRequest,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    NotFoundError,
    ParameterError,
    RequestOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from shared.speculative import speculates

logger = logging.getLogger(__name__)


class Scheduler(SchedulerView):
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_events = BlockEvents() if config.kv_events else None
        self.kv = KVCacheManager.of(config, self.block_events)
        self.handover = Handovers(self.kv, config.host_block_bytes)
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.scheduling_policy)
        # fcfs: in admission order; priority: by priority_key. The last is preempted first.
        self.running: list[Request] = []
        # LoRA: the adapter ids requests may name, and how many running requests run each.
        # NOTE: every running request is in every step it can be, so the running requests hold
        # at most max_loras adapters, and no step needs more slots than the executor has.
        self.lora_ids: set[int] = set()
        self._running_loras: Counter[int] = Counter()
        # The adapters of the last plan's rows: an addendum joins a plan whose rows may belong
        # to requests that have ended since, and its adapters count until it runs.
        self._plan_loras: set[int] = set()
        self._num_arrivals = 0
        self._dropped_ids: list[str] = []  # executor state to drop at the next step
        # Ended requests that a plan not yet reported (`update`) still runs: request_id -> the
        # last such plan. Their ids cannot be taken again before it is reported: its token
        # for the old request would go to the new one.
        self._retiring: dict[str, int] = {}
        self._last_updated_step = 0
        self._step = 0
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.device_busy_seconds = 0.0
        self.expert_tokens: list[int] = []  # a mixture of experts' load (ModelRunnerOutput)
        self.expert_ranks: list[int] = []
        self.spec_decode = SpecDecodeStats()

    # ------------------------------------------------------------------ intake

    def add_lora(self, lora_id: int) -> None:
        """Let requests name the LoRA adapter `lora_id` (registered with the executor)."""
        if not self.config.max_loras:
            raise ParameterError("lora_request", "LoRA is not enabled (--enable-lora)")
        self.lora_ids.add(lora_id)

    def remove_lora(self, lora_id: int) -> None:
        """Refuse new requests for the adapter; those admitted already run to their end."""
        self.lora_ids.discard(lora_id)

    def add_request(self, engine_request: EngineRequest) -> None:
        """Queue a request, or raise ParameterError if it can never be served."""
        request_id = engine_request.request_id
        if request_id in self.requests or request_id in self._retiring:
            raise ParameterError("request_id", f"{request_id!r} is already in flight")
        lora_id = engine_request.lora_id
        if lora_id and lora_id not in self.lora_ids:
            raise NotFoundError("model", f"no LoRA adapter has id {lora_id}")
        max_tokens = admissible_max_tokens(self.config, engine_request)
        check_queue_room(self.config, self.waiting, len(engine_request.prompt_token_ids))
        self._num_arrivals += 1
        request = Request(engine_request, max_tokens, self.config.block_size, self._num_arrivals)
        may_speculate = bool(self.config.num_speculative_tokens) and not request.hands_over
        request.speculates = may_speculate and speculates(engine_request.sampling_params)
        self.requests[request_id] = request
        self.waiting.add(request)

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._finish(request, FinishReason.ABORT)
            outputs.append(self._output(request, []))
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ planning

    def schedule(self) -> SchedulerOutput:
        self._step += 1
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        slots: dict[str, int] = {}  # draft slots of the speculating rows
        cached_data, budget, preempted = self._schedule_running(budget, scheduled)
        new_data = [] if preempted else self._schedule_waiting(budget, scheduled)
        if self.config.num_speculative_tokens:  # from what is left once every row is placed
            budget = self.config.max_num_batched_tokens - sum(scheduled.values())
            placed = [(self.requests[data.request_id], data) for data in cached_data]
            add_draft_slots(self.kv, self.config, placed, scheduled, slots, budget)
        for data in cached_data:
            reserve_lookahead(self.kv, self.config, self.requests[data.request_id], data, scheduled)
        self._commit(scheduled, slots)
        self._plan_loras = {self.requests[rid].lora_id for rid in scheduled} - {0}
        dropped, self._dropped_ids = self._dropped_ids, []
        return SchedulerOutput(
            step=self._step,
            new_requests=new_data,
            cached_requests=cached_data,
            num_scheduled_tokens=scheduled,
            finished_request_ids=dropped,
            draft_slots=slots,
            host_copies=self.kv.take_copies(),
            kv_exports=self.handover.take_exports(),
            kv_imports=self.handover.take_imports(),
        )

    def schedule_addendum(self, plan: SchedulerOutput) -> SchedulerOutput | None:
        """Admit waiting requests into `plan`, already sent but not launched, within what is
        left of its budget; returns the rows added (merged into `plan` too), or None.

        Only first admissions: a preempted request waits for a whole plan, because the
        executor drops its old state at the start of the next one (`finished_request_ids`).
        NOTE: the plan keeps the rows of requests that finished since it was made (their
        tokens are discarded), so its rows, not the running requests, bound what joins it;
        and such a row still writes KV into the blocks its request freed, which a request
        admitted into the same step could be given: none is, until the next plan.
        """
        if plan.step in self._retiring.values():  # a row of it ended since it was made
            return None
        budget = self.config.max_num_batched_tokens - plan.total_num_scheduled_tokens
        num_rows = self.config.max_num_seqs - len(plan.num_scheduled_tokens)
        scheduled: dict[str, int] = {}
        new_data = self._schedule_waiting(
            budget,
            scheduled,
            first_admissions_only=True,
            max_new_rows=num_rows,
            planned_loras=self._plan_loras,
        )
        if not new_data:
            return None
        self._commit(scheduled)
        self._plan_loras |= {self.requests[rid].lora_id for rid in scheduled} - {0}
        plan.new_requests.extend(new_data)
        plan.num_scheduled_tokens.update(scheduled)
        plan.kv_imports.extend(imports := self.handover.take_imports())  # reported with it
        return SchedulerOutput(
            step=plan.step,
            new_requests=new_data,
            cached_requests=[],
            num_scheduled_tokens=scheduled,
            finished_request_ids=[],
            addendum=True,
            host_copies=self.kv.take_copies(),  # run after the plan's own (HostTier)
            kv_exports=self.handover.take_exports(),
            kv_imports=imports,
        )

    def _commit(self, scheduled: dict[str, int], slots: dict[str, int] | None = None) -> None:
        """Count the rows as computed; a row that reaches the request's end samples, and may
        bring it as many tokens as it has draft slots, and one."""
        for request_id, num_tokens in scheduled.items():
            request = self.requests[request_id]
            request.last_scheduled_step = self._step
            request.num_computed_tokens += num_tokens
            self.handover.computed(request)
            if request.num_computed_tokens >= request.num_scheduled_tokens_end:
                request.num_pending_tokens += 1 + (slots.get(request_id, 0) if slots else 0)

    def _schedule_running(
        self, budget: int, scheduled: dict[str, int]
    ) -> tuple[list[CachedRequestData], int, bool]:
        cached_data: list[CachedRequestData] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_scheduled_tokens_end - request.num_computed_tokens, budget)
            if num_new <= 0 or self._ends_with_pending(request) or self.handover.waits(request):
                index += 1
                continue
            if crosses_original_context(request, self.config.long_rope_after):
                self.running.pop(index)
                self._requeue(request)  # then computed again from its start, with the long set
                request.num_preemptions += 1  # readmitted in a whole plan (schedule_addendum)
                continue
            num_held = len(self.kv.block_ids.get(request.request_id, []))
            while not self.kv.allocate(request, num_new):
                preempted = True
                victim = self.running.pop()  # the last admitted, or of the lowest priority
                self._preempt(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            data = CachedRequestData(
                request_id=request.request_id,
                new_block_ids=self.kv.block_ids[request.request_id][num_held:],
                num_computed_tokens=request.num_computed_tokens,
            )
            cached_data.append(data)
            scheduled[request.request_id] = num_new
            budget -= num_new
            index += 1
        return cached_data, budget, preempted

    def _schedule_waiting(
        self,
        budget: int,
        scheduled: dict[str, int],
        first_admissions_only: bool = False,
        max_new_rows: int | None = None,
        planned_loras: set[int] | None = None,
    ) -> list[NewRequestData]:
        new_data: list[NewRequestData] = []
        planned = planned_loras or set()
        room = self.config.max_num_seqs if max_new_rows is None else max_new_rows
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and len(new_data) < room
        ):
            request = self.waiting.first(lambda r: self._admissible(r, planned))
            if request is None:
                break
            if request.num_pending_tokens:
                break  # preempted with a token in flight: readmit it once the token is in
            if first_admissions_only and request.num_preemptions:
                break
            settle_long_rope(request, self.config.long_rope_after)
            cached = self.kv.find_cached_prefix(request)
            num_cached = len(cached) // self.kv.num_groups  # logical blocks: one of each group's
            restored = self.kv.find_host_prefix(request, num_cached)
            num_hits = num_cached + len(restored)  # blocks
            if self.kv.fetch_from_disk(request, num_hits):
                continue  # admitted once the disk tier's reads are in (DiskTier)
            num_imported = self.handover.num_to_import(request, num_hits)
            num_computed = (num_hits + num_imported) * self.config.block_size
            num_new = request.num_tokens - num_computed
            # NOTE: admission keeps a prompt within max_num_batched_tokens, but a preempted
            # request recomputes its outputs too and may never fit whole: chunk only that one.
            fits_one_step = num_new <= self.config.max_num_batched_tokens
            if num_new > budget and not self.config.enable_chunked_prefill and fits_one_step:
                break
            num_new = min(num_new, budget)
            if not self.kv.allocate(request, num_new, cached, restored, num_imported):
                break
            self.waiting.remove(request)
            self.kv.record_prefix_lookup(request.num_tokens, cached, restored)
            if num_imported:  # computed elsewhere: not this engine's cache hits
                request.num_cached_tokens = num_hits * self.config.block_size
                self.handover.imported(request, num_hits, num_imported)
            self._admit(request, num_computed)
            new_data.append(self._new_request_data(request))
            scheduled[request.request_id] = num_new
            budget -= num_new
        return new_data

    def _admissible(self, request: Request, planned: set[int]) -> bool:
        """Whether the request can run beside the running ones (and the adapters of the plan
        it would join, `planned`): the base model always; an adapter if it runs already or a
        slot is left; not while it waits for reads from the disk tier."""
        if self.kv.waits_for_disk(request):
            return False
        lora_id = request.lora_id
        if not lora_id or lora_id in self._running_loras or lora_id in planned:
            return True
        return len(self._running_loras.keys() | planned) < self.config.max_loras

    def _count_running_lora(self, request: Request, change: int) -> None:
        if request.lora_id:
            self._running_loras[request.lora_id] += change
            if not self._running_loras[request.lora_id]:
                del self._running_loras[request.lora_id]

    def _admit(self, request: Request, num_computed: int) -> None:
        self._count_running_lora(request, +1)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_computed
        if self.config.scheduling_policy == "priority":
            self.running.insert(
                bisect.bisect_right(self.running, priority_key(request), key=priority_key), request
            )
        else:
            self.running.append(request)

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            sampling_params=request.sampling_params,
            block_ids=list(self.kv.block_ids[request.request_id]),
            num_computed_tokens=request.num_computed_tokens,
            lora_id=request.lora_id,
            long_rope=request.long_rope,
        )

    def _requeue(self, request: Request) -> None:
        """Release the request's blocks (they stay findable by prefix) and requeue it first, to
        compute what it holds again."""
        self.kv.free(request)
        self._count_running_lora(request, -1)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.waiting.requeue(request)
        self._dropped_ids.append(request.request_id)

    def _preempt(self, request: Request) -> None:
        self._requeue(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        logger.info(
            "preempted request_id=%s (%d tokens) to free KV blocks; total preemptions=%d",
            request.request_id, request.num_tokens, self.num_preemptions,
        )  # fmt: skip

    # ------------------------------------------------------------------ results

    def update(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        """Append sampled tokens, apply stop conditions, and report what each request got."""
        outputs = []
        self._last_updated_step = plan.step
        if self._retiring:
            self._retiring = {r: step for r, step in self._retiring.items() if step > plan.step}
        self.device_busy_seconds += result.device_ms / 1000
        if result.expert_tokens:  # the newest of the executor's reads
            self.expert_tokens, self.expert_ranks = result.expert_tokens, result.expert_ranks
        for request_id, part in result.prompt_logprobs.items():
            if (request := self.requests.get(request_id)) is not None:
                request.add_prompt_logprobs(part)
        self.kv.disk_reported(result)
        failed = set(result.kv_import_failed)
        self.handover.reported(plan, failed, result.kv_import_seconds)
        for request_id in failed:
            self._void_import(request_id)
        for request_id in plan.num_scheduled_tokens:
            request = self.requests.get(request_id)
            token_ids = result.sampled.get(request_id)
            if request is None or not token_ids or request_id in failed:
                continue  # finished meanwhile, or a prompt chunk that samples nothing
            num_slots = plan.draft_slots.get(request_id, 0)
            num_drafts = result.num_drafts.get(request_id, 0)
            taken = self._take_tokens(request, token_ids, num_slots, num_drafts)
            if request.status is not RequestStatus.FINISHED and request.speculates:
                note_proposal(request, num_slots, num_drafts)
            logprobs = result.logprobs.get(request_id, [])[: len(taken)]
            output = self._output(request, taken, logprobs)
            output.embedding = result.embeddings.get(request_id)
            outputs.append(output)
        return outputs

    def _void_import(self, request_id: str) -> None:
        """Its prompt's fetch failed: the step's token is void; it computes the prompt here."""
        request = self.requests.get(request_id)
        if request is None:
            return
        request.num_pending_tokens = 0
        request.num_preemptions += 1  # readmitted as a preempted one is (never into an addendum)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._requeue(request)
        logger.warning("request_id=%s: its KV could not be fetched: computing it here", request_id)

    def _take_tokens(
        self, request: Request, token_ids: list[int], num_slots: int, num_drafts: int
    ) -> list[int]:
        """Append a step's tokens up to the first that stops the request; returns those taken.

        The step's row had `num_slots` draft slots and verified `num_drafts` drafts: it was
        counted as bringing 1 + num_slots tokens (`num_pending_tokens`, `num_computed_tokens`),
        and brought the drafts accepted and one; its computed tokens fall back by the slots
        not accepted, to those whose KV holds what was accepted.
        """
        taken = []
        for token_id in token_ids:
            request.append_output(token_id)
            taken.append(token_id)
            self.num_generation_tokens += not request.sampling_params.embed  # dropped there
            if request.num_output_tokens == 1:
                self.num_prompt_tokens += request.num_prompt_tokens
            reason = self._stop_reason(request, token_id)
            if reason is not None:
                self._finish(request, reason)
                break
        num_accepted = len(token_ids) - 1
        request.num_pending_tokens -= 1 + num_slots
        if num_drafts:
            self.spec_decode.record(num_drafts, num_accepted)
        if request.status is RequestStatus.RUNNING:  # else preempted: it starts over
            request.num_computed_tokens -= num_slots - num_accepted
        return taken

    def _ends_with_pending(self, request: Request) -> bool:
        """Whether the tokens in flight already take the request to its length limit."""
        if not request.num_pending_tokens:
            return False
        num_outputs = request.num_output_tokens + request.num_pending_tokens
        return (
            request.hands_over  # its first token ends it here
            or num_outputs >= request.max_tokens
            or request.num_scheduled_tokens_end >= self.config.max_model_len
        )

    def _stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                return FinishReason.STOP
            if not params.ignore_eos and token_id in self.config.eos_token_ids:
                return FinishReason.STOP
        if request.num_output_tokens >= request.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        if request.hands_over:  # goes on in a decode engine (RequestOutput.handed_over)
            request.handed_over = True
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._count_running_lora(request, -1)
            self._dropped_ids.append(request.request_id)
        elif request.status is RequestStatus.WAITING:
            # Aborted while queued, or preempted while its last token was in flight.
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        if request.last_scheduled_step > self._last_updated_step:
            self._retiring[request.request_id] = request.last_scheduled_step

    def _output(
        self,
        request: Request,
        token_ids: list[int],
        logprobs: Sequence[TokenLogprobs] = (),
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            new_logprobs=list(logprobs),
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            prompt_logprobs=request.take_prompt_logprobs(),
            handed_over=request.handed_over,
        )
