"""Offline batch generation: `LLM(model=...).generate(prompts, SamplingParams(...))`.

The serving engine's own parts in one process: the executor's `ModelRunner`, the scheduler's
`EngineCore` (the same pipelined loop the scheduler process runs), and the tokenizer worker's
core, which tokenizes prompts and turns tokens into text and stop strings as when serving.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any, cast

import msgspec

from kvflow.data_parallel import WAVE_STOPPED, OtherReplicas, WaveStopped, share_cpu_threads
from kvflow.lora_request import LoRARequest
from kvflow.outputs import Completion, EmbeddingResult, GenerationResult
from kvflow.progress import Progress, ProgressSink
from services.executor.parallel.lockstep import Lockstep
from services.executor.parallel.world import leave_world
from services.executor.rank_group import end_group, start_runner
from services.executor.runner.plan_check import PlanError
from services.executor.runner.replica_rounds import idle_round
from services.frontend.api.openai_types import Message, Tool, chat_message
from services.frontend.api.structured import tool_definition
from services.scheduler.engine_core import EngineCore
from services.scheduler.handshake import scheduler_config
from services.scheduler.scheduler import Scheduler
from services.tokenizer.worker import TokenizerWorker
from shared.config import OFFLINE_DEFAULTS, Config
from shared.gc_heap import heap_frozen
from shared.hf_tokenizer import load_tokenizer
from shared.pooling import shorten
from shared.protocol import (
    ChatMessage,
    GenerateRequest,
    ParameterError,
    SamplingParams,
    StatsSnapshot,
    ToolDefinition,
)
from shared.replicas import experts_across_replicas

logger = logging.getLogger(__name__)
Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **config: Any) -> None:
        if isinstance(config.get("speculative_config"), dict):  # as vLLM's LLM takes it
            config["speculative_config"] = json.dumps(config["speculative_config"])
        self.config = Config(model=model, **{**OFFLINE_DEFAULTS, **config})
        if self.config.kv_events_address is not None:
            raise ValueError("--kv-events-address: a serving scheduler publishes KV events")
        # With data_parallel_size N, this is replica 0, and replicas 1..N-1 load in processes
        # of their own meanwhile; one of those is an LLM given its data_parallel_rank.
        self.replicas: OtherReplicas | None = None
        self.closed = False  # close(): no more calls
        if self.config.data_parallel_size > 1 and self.config.data_parallel_rank is None:
            if experts_across_replicas(self.config) and self.config.data_parallel_group is None:
                # Where the replicas' executors meet (services/executor/parallel/world.py)
                group = tempfile.mkdtemp(prefix="kvflow-replica-group-")  # 0700
                atexit.register(shutil.rmtree, group, ignore_errors=True)
                self.config = self.config.replace(data_parallel_group=group)
            self.replicas = OtherReplicas(self.config)
            share_cpu_threads(self.config.device, self.config.data_parallel_size)
        try:
            self._start_engine()
        except BaseException:
            self.close()
            raise

    def _start_engine(self) -> None:
        self.runner = start_runner(self.config)
        name = self.config.served_model_name or self.runner.source.name
        ready = self.runner.ready_message(name)
        # Offline, the whole batch is queued at once: no cap on waiting requests.
        settings = dataclasses.replace(
            scheduler_config(self.config, ready), max_queued_requests=None, max_queued_tokens=None
        )
        self.engine = EngineCore(Scheduler(settings), self.runner)
        self.task = self.runner.task  # "generate" or "embed" (shared/pooling.py)
        for lora_id in range(1, len(ready.lora_modules) + 1):  # --lora-modules: ids 1, 2, ...
            self.engine.scheduler.add_lora(lora_id)
        self.worker = TokenizerWorker(
            load_tokenizer(self.runner.source, self.config.tokenizer, self.config.cache_dir),
            grammar_timeout_s=self.config.grammar_compile_timeout,
            lenient_json=not self.config.disable_additional_properties,
            reasoning_parser=self.config.reasoning_parser,
        )
        self._next_id = 0
        if self.replicas is not None:
            self.replicas.wait_ready(self.config.startup_timeout)
            # Stopped before this engine's own teardown (atexit runs the newest first).
            atexit.register(self._close_at_exit)
        logger.info(
            "engine ready: %s, max_model_len=%d, %d KV blocks%s",
            name,
            ready.max_model_len,
            ready.num_blocks,
            f" in each of {self.config.data_parallel_size} replicas" if self.replicas else "",
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        show_progress: bool = False,
    ) -> list[GenerationResult]:
        """Generate for every prompt (text or token ids) in one continuous batch.

        `sampling_params` is one for all prompts, or a list with one per prompt; so is
        `lora_request`, the LoRA adapter a prompt runs under (None: the base model; needs
        `enable_lora=True`).
        """
        self._require_task("generate")
        requests = _prompt_requests(prompts)
        return self._run(requests, sampling_params, lora_request, show_progress)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        dimensions: int | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        show_progress: bool = False,
    ) -> list[EmbeddingResult]:
        """The embedding of every prompt (text or token ids), pooled as the model defines
        (shared/pooling.py), in one continuous batch. `dimensions`: a Matryoshka model's
        shorter vectors (truncated and renormalized)."""
        self._require_task("embed")
        requests = _prompt_requests(prompts)
        params = SamplingParams(embed=True, max_tokens=1, temperature=0.0)
        results = self._run(requests, params, lora_request, show_progress)
        embeddings = []
        for result in results:
            if result.embedding is None:  # ended without one (finish_reason says why)
                raise RuntimeError(f"a prompt ended with {result.finish_reason}, not embedded")
            vector = shorten(result.embedding, dimensions, self.runner.pooling)
            embeddings.append(EmbeddingResult(result.prompt, result.prompt_token_ids, vector))
        return embeddings

    def _require_task(self, task: str) -> None:
        if self.task != task:
            raise ParameterError(
                "task",
                f"this model is loaded for {self.task}, not {task} (LLM(..., task={task!r}))",
            )

    def chat(
        self,
        conversations: Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        show_progress: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[GenerationResult]:
        """Generate a reply for each conversation, through the model's chat template.

        Messages and `tools` take the OpenAI chat API's shapes (tool calls and tool results
        included), read as the server reads them; the tools are shown to the template, and the
        reply is the model's text (as vLLM's LLM.chat). `chat_template_kwargs` are extra
        template variables (`{"enable_thinking": False}`). With `reasoning_parser` set, a
        completion's `text` is the answer and its `reasoning` the thinking.
        """
        self._require_task("generate")
        definitions = _tool_definitions(tools)
        requests = [
            GenerateRequest(
                request_id="",
                sampling_params=SamplingParams(),
                messages=_chat_messages(messages),
                tools=definitions,
                chat_template_kwargs=chat_template_kwargs,
            )
            for messages in conversations
        ]
        return self._run(requests, sampling_params, lora_request, show_progress)

    def close(self) -> None:
        """Stop the other data-parallel replicas and tensor-parallel ranks now rather than at
        exit (their GPUs are freed), and leave their group (another `LLM` may then start its
        own in this process); this LLM takes no more calls then. Without them, nothing to do."""
        self._close(at_exit=False)

    def _close_at_exit(self) -> None:
        self._close(at_exit=True)  # a group's teardown that hangs then exits the process

    def _close(self, at_exit: bool) -> None:
        if self.closed:  # once: a group left again might be a later LLM's
            return
        self.closed = True
        runner = getattr(self, "runner", None)  # None: closed as its start failed
        if self.replicas is not None:
            self.replicas.stop()
            atexit.unregister(self._close_at_exit)
            if runner is not None and runner.tp.replicas is not None and runner.tp.size == 1:
                leave_world()  # the replicas' group (with more ranks: end_group's)
        if runner is not None:
            end_group(runner, at_exit)  # the other tensor-parallel ranks, then the group

    def stats(self) -> StatsSnapshot:
        """The engine's gauges and counters (with data_parallel_size > 1: replica 0's)."""
        return self.engine.stats()

    def replica_stats(self) -> list[StatsSnapshot]:
        """Every replica's gauges and counters: replica 0's now, the others' as their last
        share ended (none before their first)."""
        others = self.replicas.stats if self.replicas is not None else []
        return [self.stats(), *(s for s in others if s is not None)]

    # ---------------------------------------------------------------- the run

    def _run(
        self,
        prompts: list[GenerateRequest],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
        show_progress: bool,
    ) -> list[GenerationResult]:
        if self.closed:
            raise RuntimeError("this LLM was closed (its replicas and ranks stopped): no calls")
        params = sampling_params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if len(per_prompt) != len(prompts):
            raise ParameterError("sampling_params", "give one per prompt, or a single one")
        per_prompt = list(per_prompt)
        loras = _per_prompt_loras(lora_request, len(prompts))
        progress = Progress(sum(max(p.n, 1) for p in per_prompt), show_progress)
        if self.replicas is None:
            return self.run_share(prompts, per_prompt, loras, progress)
        return self.replicas.generate(self.run_share, prompts, per_prompt, loras, progress)

    @heap_frozen()  # no full collection walks the engine mid-run
    def run_share(
        self,
        prompts: list[GenerateRequest],
        params: list[SamplingParams],
        loras: list[LoRARequest | None],
        progress: ProgressSink,
    ) -> list[GenerationResult]:
        """Generate for `prompts` in this process's engine, one continuous batch (with
        data_parallel_size > 1, each replica's share of a batch)."""
        results: list[GenerationResult] = []
        owners: dict[str, tuple[GenerationResult, Completion]] = {}
        done = False
        try:
            lora_ids = [0 if lora is None else self.add_lora(lora) for lora in loras]
            for prompt, prompt_params, lora_id in zip(prompts, params, lora_ids, strict=True):
                prompt = msgspec.structs.replace(prompt, lora_id=lora_id)
                results.append(self._add(prompt, prompt_params, owners))
            self._step_until_done(owners, progress)
            done = True
        except PlanError:
            # The runner held a plan it could not run (an adapter whose files are gone): it
            # starts over, with every tensor-parallel rank, before the requests are withdrawn.
            self.runner.reset()
            self.engine.forget_in_flight()
            raise
        finally:
            if owners:  # an error or an interrupt: withdraw what is left
                self.engine.abort(list(owners))
                self.worker.abort(list(owners))
            self._end_wave(stop=not done)
        return results

    def _lockstep(self) -> Lockstep | None:
        """With expert parallelism across replicas, this replica's part in the rounds."""
        replicas = self.runner.tp.replicas
        return replicas.lockstep if replicas is not None else None

    def _end_wave(self, stop: bool) -> None:
        """With expert parallelism across replicas: serve the other replicas' steps (each
        replica's experts take part in every one) until none has work left; `stop`: this
        share failed or was cancelled, and so every replica's share stops (WaveStopped)."""
        if self._lockstep() is not None:
            while idle_round(self.runner, stop).busy:
                pass

    def add_lora(self, lora: LoRARequest) -> int:
        """Register a LoRA adapter (read and checked the first time its id is given) and return
        its id; `generate` and `chat` do it for the adapters they are given."""
        if self.runner.lora is None:
            raise ParameterError("lora_request", "LoRA is not enabled: LLM(..., enable_lora=True)")
        error = self.runner.add_lora(lora.lora_int_id, lora.lora_name, lora.lora_path)
        if error is not None:
            raise ParameterError("lora_request", error)
        self.engine.scheduler.add_lora(lora.lora_int_id)
        return lora.lora_int_id

    def _add(
        self,
        prompt: GenerateRequest,
        params: SamplingParams,
        owners: dict[str, tuple[GenerationResult, Completion]],
    ) -> GenerationResult:
        """Admit the prompt's n requests; raises ParameterError for a bad prompt or params."""
        result = GenerationResult(prompt.prompt, [], [])
        for index, child_params in enumerate(params.fan_out()):
            request_id = f"gen-{self._next_id}"
            self._next_id += 1
            request = msgspec.structs.replace(
                prompt, request_id=request_id, sampling_params=child_params
            )
            engine_request = self.worker.admit(request)
            result.outputs.append(Completion(index))
            owners[request_id] = (result, result.outputs[-1])
            self.engine.add_request(engine_request)
            result.prompt_token_ids = engine_request.prompt_token_ids
        return result

    def _step_until_done(
        self, owners: dict[str, tuple[GenerationResult, Completion]], progress: ProgressSink
    ) -> None:
        lockstep = self._lockstep()
        while owners and self.engine.has_unfinished():
            if lockstep is not None and lockstep.stop_asked:
                raise WaveStopped(WAVE_STOPPED)
            deltas, ended = self.worker.on_outputs(self.engine.step())
            if ended:  # ended by the worker (a stop string): the engine stops them too
                self.engine.abort(ended)
            # NOTE: this loop runs for every request in every step, on the host's critical path
            # while the device runs the next step: keep it lean.
            num_tokens = num_done = 0
            for delta in deltas:
                owner = owners.get(delta.request_id)
                if owner is None:
                    continue
                result, completion = owner
                completion.absorb(delta)
                if delta.prompt_logprobs is not None:
                    result.prompt_logprobs = delta.prompt_logprobs
                if delta.embedding is not None:
                    result.embedding = delta.embedding
                num_tokens += len(delta.token_ids)
                if delta.finish_reason is not None:
                    result.num_cached_tokens = max(
                        result.num_cached_tokens, delta.num_cached_tokens
                    )
                    del owners[delta.request_id]
                    num_done += 1
            progress.update(num_tokens, num_done)
        progress.close()


def _prompt_requests(prompts: Prompt | Sequence[Prompt]) -> list[GenerateRequest]:
    """One request per prompt (a single prompt, text or token ids, is a batch of one)."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [cast(Prompt, prompts)]
    return [
        GenerateRequest(
            request_id="",
            sampling_params=SamplingParams(),
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=None if isinstance(prompt, str) else list(prompt),
        )
        for prompt in cast(Sequence[Prompt], prompts)
    ]


def _per_prompt_loras(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if len(lora_request) != num_prompts:
        raise ParameterError("lora_request", "give one per prompt, or a single one")
    return list(lora_request)


def _chat_messages(messages: Sequence[dict[str, Any]]) -> list[ChatMessage]:
    """A conversation as the tokenizer worker takes it, read as the server reads one."""
    try:
        decoded = msgspec.convert(list(messages), list[Message])
    except msgspec.ValidationError as exc:
        raise ParameterError("messages", str(exc)) from None
    return [chat_message(message) for message in decoded]


def _tool_definitions(tools: Sequence[dict[str, Any]] | None) -> list[ToolDefinition] | None:
    if tools is None:
        return None
    try:
        decoded = msgspec.convert(list(tools), list[Tool])
    except msgspec.ValidationError as exc:
        raise ParameterError("tools", str(exc)) from None
    return [tool_definition(tool) for tool in decoded]
