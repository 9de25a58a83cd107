"""A tokenizer worker's core: text in, token ids to the engine; token ids back, text out.

It keeps one incremental detokenizer per live request (requests are sticky to a worker),
finds stop strings, and turns logprobs into token text. No sockets here: the tokenizer
process wraps it for serving, and `kvflow.LLM` uses it in-process, so both paths produce
text the same way.

A model without a tokenizer (a dummy preset) still runs: prompts are token ids, and the
text of every output is empty.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
from dataclasses import dataclass
from typing import Any

import msgspec
from llguidance import LLTokenizer
from transformers import PreTrainedTokenizerBase

from services.tokenizer.detokenizer import IncrementalDetokenizer, token_text
from services.tokenizer.harmony import HarmonyReader
from services.tokenizer.reasoning import THINK_END, ReasoningReader, starts_in_reasoning
from services.tokenizer.stop_strings import StopStrings
from services.tokenizer.tokenizer_info import tokenizer_info
from services.tokenizer.tool_calls import ToolCallReader
from shared.grammar import GrammarChecker, llg_tokenizer
from shared.hf_tokenizer import RESERVED_TEMPLATE_KWARGS, apply_chat_template, decode, encode
from shared.protocol import (
    ChatMessage,
    EngineRequest,
    FinishReason,
    GenerateRequest,
    ParameterError,
    PromptTokenLogprob,
    RequestError,
    RequestOutput,
    SamplingParams,
    TextDelta,
    TokenizeRequest,
    TokenizeResult,
    TokenLogprob,
    TokenLogprobs,
    ToolCallDelta,
    ToolChoice,
    ToolDefinition,
    TopLogprob,
)

logger = logging.getLogger(__name__)


@dataclass
class _LiveRequest:
    detokenizer: IncrementalDetokenizer | None  # None without a tokenizer
    num_prompt_tokens: int
    echo_prompt_ids: list[int] | None  # sent back with the first delta when echo is asked
    num_output_tokens: int = 0
    tool_calls: ToolCallReader | None = None  # a chat with tools: reads its calls
    prompt_token_ids: list[int] | None = None  # kept when its prompt logprobs will come
    prompt_only: bool = False  # echo with max_tokens 0: the one token computed is dropped
    reasoning: ReasoningReader | HarmonyReader | None = None  # a chat under --reasoning-parser
    answer_stops: StopStrings | None = None  # with `reasoning`: stop strings of the answer
    num_reasoning_tokens: int = 0  # with `reasoning`: the output tokens that were thinking


class TokenizerWorker:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        *,
        grammar_timeout_s: float = 10.0,
        tool_call_parser: str | None = None,
        lenient_json: bool = False,
        reasoning_parser: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.live: dict[str, _LiveRequest] = {}
        self._token_texts: dict[int, str] = {}  # logprob text by token id: decoded once
        self.grammar_timeout_s = grammar_timeout_s
        self.tool_call_parser = tool_call_parser
        self.lenient_json = lenient_json  # --no-disable-additional-properties
        self.reasoning_parser = reasoning_parser
        self._grammars: GrammarChecker | None = None  # made on first use
        self._grammar_tokenizer: concurrent.futures.Future[LLTokenizer] | None = None

    # ---------------------------------------------------------------- inbound

    def admit(self, request: GenerateRequest) -> EngineRequest:
        """Tokenize a request for the engine; raises ParameterError for a bad prompt."""
        token_ids = self._prompt_ids(request)
        params = self._with_server_json_rules(request.sampling_params)
        if self.tokenizer is None and params.stop:
            raise ParameterError("stop", "stop strings need a tokenizer; this model has none")
        if params.structured_output is not None:
            self._grammar_checker(params.structured_output.source).check(params.structured_output)
        reasoning = self._reasoning_reader(request, token_ids)
        if reasoning is not None and params.structured_output is not None:
            params = self._grammar_after_thinking(params, token_ids)
        detokenizer = None
        if self.tokenizer is not None and not params.embed:  # an embedding has no text
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                # harmony's markers are special tokens: its reader needs them
                skip_special_tokens=params.skip_special_tokens
                and not isinstance(reasoning, HarmonyReader),
                # With a reasoning reader, stop strings end the answer, not the thinking.
                stop=() if reasoning is not None else params.stop,
            )
        self.live[request.request_id] = _LiveRequest(
            detokenizer,
            num_prompt_tokens=len(token_ids),
            echo_prompt_ids=token_ids if request.echo else None,
            tool_calls=self._tool_call_reader(request),
            prompt_token_ids=token_ids if params.prompt_logprobs is not None else None,
            prompt_only=request.prompt_only or params.embed,
            reasoning=reasoning,
            answer_stops=None if reasoning is None else StopStrings(params.stop),
        )
        return EngineRequest(
            request_id=request.request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=request.arrival_time,
            priority=request.priority,
            lora_id=request.lora_id,
        )

    def _with_server_json_rules(self, params: SamplingParams) -> SamplingParams:
        """`params` with the server's JSON rules on its structured output: the engine builds
        the grammar from the message alone, so the rule travels in it."""
        spec = params.structured_output
        if spec is None or spec.lenient == self.lenient_json:
            return params
        spec = msgspec.structs.replace(spec, lenient=self.lenient_json)
        return msgspec.structs.replace(params, structured_output=spec)

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            vocab = None if self.tokenizer is None else len(self.tokenizer)
            if vocab is not None and any(not 0 <= t < vocab for t in request.prompt_token_ids):
                raise ParameterError("prompt", f"token ids must be in [0, {vocab})")
            return list(request.prompt_token_ids)
        if request.messages is not None:
            return self._chat_ids(request.messages, request.tools, request.chat_template_kwargs)
        return encode(self._require_tokenizer("prompt"), request.prompt or "")

    def _reasoning_reader(
        self, request: GenerateRequest, token_ids: list[int]
    ) -> ReasoningReader | HarmonyReader | None:
        """Chats only (a completion's text is the client's to read), with a tokenizer."""
        if self.reasoning_parser is None or request.messages is None or self.tokenizer is None:
            return None
        if self.reasoning_parser == "openai_gptoss":
            return HarmonyReader(keep_calls=self.tool_call_parser == "openai")
        # The prompt's tail says whether the template opened <think> (qwen3 thinking models).
        tail = decode(self.tokenizer, token_ids[-8:], skip_special_tokens=False)
        return ReasoningReader(starts_in_reasoning(self.reasoning_parser, tail))

    def _grammar_after_thinking(
        self, params: SamplingParams, token_ids: list[int]
    ) -> SamplingParams:
        """A chat's grammar constrains its answer: it starts after `</think>`, unless the prompt
        closed the thinking already (Qwen3 with thinking off). Only where `</think>` is one
        token (Qwen3, DeepSeek R1): else it constrains the whole output, as before."""
        assert self.tokenizer is not None and params.structured_output is not None
        end_ids = encode(self.tokenizer, THINK_END, add_special_tokens=False)
        tail = decode(self.tokenizer, token_ids[-8:], skip_special_tokens=False)
        if len(end_ids) != 1 or tail.rstrip().endswith(THINK_END):
            return params
        spec = msgspec.structs.replace(params.structured_output, reasoning_end_token_ids=end_ids)
        return msgspec.structs.replace(params, structured_output=spec)

    def _chat_ids(
        self,
        messages: list[ChatMessage],
        tools: list[ToolDefinition] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        tokenizer = self._require_tokenizer("messages")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {}))
        if reserved:
            raise ParameterError(
                "chat_template_kwargs", f"may not set the template's own {', '.join(reserved)}"
            )
        try:
            return apply_chat_template(
                tokenizer,
                [template_message(m) for m in messages],
                None if tools is None else [template_tool(t) for t in tools],
                template_kwargs,
            )
        except Exception as exc:  # chat templates raise jinja2 errors for bad conversations
            raise ParameterError("messages", str(exc)) from exc

    def start_grammar_tokenizer(self) -> None:
        """Make the grammar tokenizer on a thread now (1-3 s for a 150k vocabulary), so that
        the first structured-output request does not wait for it (serving calls this)."""
        if self.tokenizer is not None and self._grammar_tokenizer is None:
            pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-init")
            self._grammar_tokenizer = pool.submit(llg_tokenizer, self.tokenizer)
            pool.shutdown(wait=False)

    def _grammar_checker(self, param: str) -> GrammarChecker:
        if self._grammars is None:
            self._require_tokenizer(param)
            self.start_grammar_tokenizer()
            assert self._grammar_tokenizer is not None
            tokenizer = self._grammar_tokenizer.result()
            self._grammars = GrammarChecker(tokenizer, self.grammar_timeout_s)
        return self._grammars

    def _tool_call_reader(self, request: GenerateRequest) -> ToolCallReader | None:
        choice = request.tool_choice
        if choice is None:
            return None
        if choice is ToolChoice.AUTO and self.tool_call_parser is None:
            raise ParameterError(
                "tool_choice",
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser",
            )
        return ToolCallReader(
            choice,
            request.tool_name,
            self.tool_call_parser,
            request.parallel_tool_calls,
            request.tools,
        )

    def _require_tokenizer(self, param: str) -> PreTrainedTokenizerBase:
        if self.tokenizer is None:
            raise ParameterError(param, "this model has no tokenizer: pass token ids")
        return self.tokenizer

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.live.pop(request_id, None)

    def tokenize(self, request: TokenizeRequest) -> TokenizeResult:
        """/tokenize (text or messages to ids) and /detokenize (ids to text)."""
        try:
            if request.info:
                info = tokenizer_info(self._require_tokenizer("tokenizer"))
                return TokenizeResult(request_id=request.request_id, text=info)
            if request.token_ids is not None:
                text = decode(self._require_tokenizer("tokens"), request.token_ids)
                return TokenizeResult(
                    request_id=request.request_id, text=text, token_ids=request.token_ids
                )
            if request.messages is not None:
                ids = self._chat_ids(request.messages, request.tools, request.chat_template_kwargs)
            else:
                ids = encode(
                    self._require_tokenizer("prompt"),
                    request.prompt or "",
                    add_special_tokens=request.add_special_tokens,
                )
        except ParameterError as exc:
            return TokenizeResult(request_id=request.request_id, error=RequestError.of(exc))
        except Exception as exc:  # ids the tokenizer cannot decode are the client's error
            error = RequestError.of(ParameterError("tokens", str(exc)))
            return TokenizeResult(request_id=request.request_id, error=error)
        return TokenizeResult(request_id=request.request_id, token_ids=ids)

    # ---------------------------------------------------------------- outbound

    def on_outputs(self, outputs: list[RequestOutput]) -> tuple[list[TextDelta], list[str]]:
        """Text deltas for the frontend, and the requests this worker ended (a stop string, or
        text it could not make) that the engine is still running and must stop."""
        deltas, ended = [], []
        for output in outputs:
            live = self.live.get(output.request_id)
            if live is None:
                # Aborted or ended here already (stopping it again is harmless), or admitted by
                # this worker's previous process, whose client is gone: stop it.
                if not output.finished:
                    ended.append(output.request_id)
                continue
            try:
                delta = self._delta(output, live)
            except Exception as exc:  # one request's failure must not lose the others' text
                logger.exception(
                    "request_id=%s: its output could not be detokenized", output.request_id
                )
                delta = TextDelta.failure(output.request_id, RequestError.of(exc))
            if delta.finish_reason is not None:
                del self.live[output.request_id]
                if not output.finished:
                    ended.append(output.request_id)
            deltas.append(delta)
        return deltas, ended

    def _delta(self, output: RequestOutput, live: _LiveRequest) -> TextDelta:
        finish, text = output.finish_reason, ""
        token_ids, logprobs = output.new_token_ids, output.new_logprobs
        detokenizer = live.detokenizer
        if detokenizer is not None:
            text, num_taken = detokenizer.add_until_stop(token_ids)
            token_ids, logprobs = token_ids[:num_taken], logprobs[:num_taken]
            if detokenizer.stop_hit is not None:
                finish = FinishReason.STOP
            elif finish is not None:
                text += detokenizer.flush()
        reasoning = ""
        if live.reasoning is not None:
            # The thinking is the output's start: every token up to the one that closes it
            # (the tokens of an opening <think> too, counted once it is read as one).
            thinking_before = live.reasoning.thinking
            reasoning, text, finish = _split_reasoning(live, text, finish)
            if thinking_before or live.reasoning.thinking:
                live.num_reasoning_tokens = live.num_output_tokens + len(token_ids)
        tool_calls: list[ToolCallDelta] = []
        if live.tool_calls is not None:
            text, tool_calls = live.tool_calls.feed(text)
            if finish is not None:
                more_text, more_calls = live.tool_calls.finish()
                text, tool_calls = text + more_text, tool_calls + more_calls
        if live.prompt_only:  # its one token was never asked for
            text, token_ids, logprobs, finish = "", [], [], FinishReason.LENGTH
        live.num_output_tokens += len(token_ids)
        delta = TextDelta(
            request_id=output.request_id,
            text=text,
            token_ids=token_ids,
            logprobs=[self._logprob(lp) for lp in logprobs] if logprobs else [],
            finish_reason=finish,
            num_prompt_tokens=live.num_prompt_tokens,
            num_output_tokens=live.num_output_tokens,
            num_cached_tokens=output.num_cached_tokens,
            error=output.error,
            tool_calls=tool_calls,
            stop_reason=_stop_hit(live) if finish else None,
            reasoning=reasoning,
            num_reasoning_tokens=live.num_reasoning_tokens,
            embedding=output.embedding,
        )
        if live.echo_prompt_ids is not None:
            delta.prompt_token_ids = live.echo_prompt_ids
            delta.prompt_text = self._text(live.echo_prompt_ids)
            live.echo_prompt_ids = None
        if live.prompt_token_ids is not None:  # the first output carries them
            delta.prompt_logprobs = self._prompt_logprobs(
                live.prompt_token_ids, output.prompt_logprobs
            )
            live.prompt_token_ids = None
        return delta

    def _prompt_logprobs(
        self, prompt_ids: list[int], entries: list[TokenLogprobs]
    ) -> list[PromptTokenLogprob]:
        """The prompt's tokens with their text; the first has no logprob."""
        first = PromptTokenLogprob(prompt_ids[0], self._token_text(prompt_ids[0]), None, None, [])
        return [first] + [
            PromptTokenLogprob(
                lp.token_id, self._token_text(lp.token_id), lp.logprob, lp.rank, self._top(lp)
            )
            for lp in entries
        ]

    def _text(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else decode(self.tokenizer, token_ids)

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = "" if self.tokenizer is None else token_text(self.tokenizer, token_id)
            self._token_texts[token_id] = text
        return text

    def _logprob(self, lp: TokenLogprobs) -> TokenLogprob:
        text = self._token_text(lp.token_id)
        return TokenLogprob(lp.token_id, text, lp.logprob, lp.rank, self._top(lp))

    def _top(self, lp: TokenLogprobs) -> list[TopLogprob]:
        return [
            TopLogprob(t, self._token_text(t), v)
            for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
        ]


def _stop_hit(live: _LiveRequest) -> str | None:
    """The stop string that ended the text: the answer's under a reasoning parser."""
    if live.answer_stops is not None:
        return live.answer_stops.stop_hit
    return None if live.detokenizer is None else live.detokenizer.stop_hit


def _split_reasoning(
    live: _LiveRequest, text: str, finish: FinishReason | None
) -> tuple[str, str, FinishReason | None]:
    """A piece of a chat's text read apart into thinking and answer; the answer's stop
    strings may end it (finish STOP)."""
    assert live.reasoning is not None and live.answer_stops is not None
    split = live.reasoning.feed(text)
    if finish is not None:
        split += live.reasoning.finish()
    content = live.answer_stops.feed(split.content, final=finish is not None)
    if live.answer_stops.stop_hit is not None:
        finish = FinishReason.STOP
    return split.reasoning, content, finish


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as Hugging Face chat templates take it; `developer` is OpenAI's newer name
    for `system`, which templates know."""
    out: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.content,
    }
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        # Templates write arguments with `tojson`: an object, or the JSON text would be
        # quoted twice.
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _json_or_text(call.arguments)},
            }
            for call in message.tool_calls
        ]
    return out


def template_tool(tool: ToolDefinition) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": json.loads(tool.parameters)}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
