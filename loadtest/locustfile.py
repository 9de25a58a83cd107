"""Locust users that stream chat and completion requests to any OpenAI-compatible server and
report per-stream latency figures as locust metrics. How to run it and what each figure means:
loadtest/README.md.

    locust -f loadtest/locustfile.py --headless -u 8 -r 4 -t 60s --host http://127.0.0.1:8000

Each stream is one row named "<scenario> <api>" (its response time is the whole stream, from
sending the request to `[DONE]`); the figures are rows of type METRIC: `ttft`, `itl` and `tpot`
in milliseconds, `output_tok_per_s` in tokens per second (in the same columns).

Why HttpUser (requests) with stream=True rather than FastHttpUser or the openai client:
FastHttpUser's `iter_content` reads through geventhttpclient's `read(n)`, which waits until n
bytes have arrived, so several SSE events would be timed together; requests yields each HTTP
chunk as it arrives, so every event gets its own timestamp. The openai client works under
gevent too, but it builds a pydantic object per chunk, and that client time lands inside the
inter-token latency we mean to measure.

It is one file so that it can be copied next to any server, and sent to locust workers by the
master (`locust -f -` on the workers).
"""

from __future__ import annotations

import functools
import itertools
import json
import random
import time
from argparse import ArgumentTypeError
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gevent
import requests
from locust import HttpUser, TaskSet, constant, events, tag, task
from locust.clients import ResponseContextManager
from locust.env import Environment
from locust.event import EventHook
from locust.exception import StopTest, StopUser
from locust.stats import CSV_STATS_INTERVAL_SEC

# Longest silence between two bytes of a stream before it counts as failed: a stuck server
# must show up as a failure, not as a user that waits forever.
READ_TIMEOUT_S = 300.0
CONNECT_TIMEOUT_S = 10.0

# Common English words are one token each in the usual BPE vocabularies, so a prompt of n of
# them is about n tokens; the usage chunk's prompt_tokens says exactly.
COMMON_WORDS = (
    "the of and to in is was for on are with as at be this have from or one had by word but "
    "not what all were when we there can an your which their said if do will each about how up "
    "out them then she many some so these would other into has more her two like him see time "
    "could no make than first been its who now people my made over did down only way find use "
    "may water long little very after words called just where most know get through back much "
    "before go good new write our used me man too any day same right look think also around "
    "another came come work three must because does part even place well such here take "
    "why things help put years different away again off went old number great tell men say"
)
WORDS = COMMON_WORDS.split()
STREAMS_ENDED = itertools.count()  # --num-requests: the streams this process has ended


@dataclass(frozen=True)
class Api:
    """One of the two streaming routes, and where its chunks carry their text."""

    name: str
    path: str

    def body(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        if self.name == "chat":
            return {"messages": messages}
        # The completions route takes the conversation's text as one prompt.
        return {"prompt": "\n\n".join(m["content"] for m in messages)}

    def content(self, choice: dict[str, Any]) -> str:
        if self.name == "chat":
            return choice.get("delta", {}).get("content") or ""
        return choice.get("text") or ""


CHAT = Api("chat", "/v1/chat/completions")
COMPLETIONS = Api("completions", "/v1/completions")
APIS = {"chat": (CHAT,), "completions": (COMPLETIONS,), "both": (CHAT, COMPLETIONS)}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ArgumentTypeError(f"must be within [0, 1], got {value}")
    return value


@events.init_command_line_parser.add_listener
def add_options(parser: Any) -> None:
    parser.add_argument(
        "--api-key",
        env_var="OPENAI_API_KEY",
        default="",
        is_secret=True,
        help="Bearer token sent with every request; none when empty.",
    )
    parser.add_argument(
        "--model", default="", help="Model name; default: the first id that /v1/models lists."
    )
    parser.add_argument(
        "--api",
        choices=sorted(APIS),
        default="both",
        help="Route of the random, shared-prefix and cancel scenarios (multi-turn is chat).",
    )
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        default=128,
        help="max_tokens of the shared-prefix, multi-turn and cancel scenarios.",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="Sampling temperature of every request."
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="Send ignore_eos (vLLM's extension) so that every stream runs to max_tokens, and "
        "count a usage.completion_tokens other than max_tokens as a failure.",
    )
    parser.add_argument(
        "--random-input-min",
        type=positive_int,
        default=32,
        help="random: shortest prompt, in words (about one token each).",
    )
    parser.add_argument(
        "--random-input-max", type=positive_int, default=512, help="random: longest prompt."
    )
    parser.add_argument(
        "--random-output-min",
        type=positive_int,
        default=16,
        help="random: smallest max_tokens; each request draws one from [min, max].",
    )
    parser.add_argument(
        "--random-output-max", type=positive_int, default=256, help="random: largest max_tokens."
    )
    parser.add_argument(
        "--shared-prefix-words",
        type=positive_int,
        default=500,
        help="shared-prefix: length in words of the system prompt that every request shares.",
    )
    parser.add_argument(
        "--question-words",
        type=positive_int,
        default=16,
        help="shared-prefix and multi-turn: length in words of each user question.",
    )
    parser.add_argument(
        "--turns",
        type=positive_int,
        default=4,
        help="multi-turn: user turns in a conversation before it starts over.",
    )
    parser.add_argument(
        "--cancel-fraction",
        type=fraction,
        default=0.5,
        help="cancel: fraction of streams that the client closes early.",
    )
    parser.add_argument(
        "--cancel-after",
        type=positive_int,
        default=4,
        help="cancel: content chunks read before such a stream is closed.",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        default=0,
        help="Stop once this many streams have ended, as a benchmark of a number of prompts "
        "does (in this locust process; 0: none, -t/--run-time decides). Streams in flight then "
        "are cut off unreported.",
    )


@events.test_start.add_listener
def check_ranges(environment: Environment, **_: Any) -> None:
    """Ranges are checked when each test starts, not by the parser, because the web UI can
    change them; StopTest ends the test with its message."""
    options = environment.parsed_options
    for name in ("random_input", "random_output"):
        low, high = getattr(options, f"{name}_min"), getattr(options, f"{name}_max")
        if low > high:
            flag = name.replace("_", "-")
            environment.process_exit_code = 2
            raise StopTest(f"--{flag}-min ({low}) is above --{flag}-max ({high})")


@events.quitting.add_listener
def let_the_csv_catch_up(environment: Environment, **_: Any) -> None:
    """Locust rewrites the --csv files once a second and not at exit, so the streams that end
    while users stop (--stop-timeout) would be missing from them (locust issue #1806): wait
    for one more write."""
    if environment.parsed_options is not None and environment.parsed_options.csv_prefix:
        gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.5)


def words(count: int) -> str:
    return " ".join(random.choices(WORDS, k=count))


@functools.cache
def system_prompt(num_words: int) -> str:
    # Seeded, so that every user and every locust worker process sends the same prefix.
    background = " ".join(random.Random(0).choices(WORDS, k=num_words))
    return f"You are a helpful assistant. Background: {background}."


@dataclass
class Stream:
    """What one streamed response brought, timed from just before its request was sent."""

    start: float
    end: float = 0.0
    content_times: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    done: bool = False
    closed_early: bool = False
    num_bytes: int = 0
    problem: str | None = None


def read_stream(
    response: ResponseContextManager, api: Api, stream: Stream, close_after: int | None
) -> None:
    """Read the SSE events of `response` into `stream`, closing it after `close_after` content
    chunks when that is set."""
    try:
        for line in response.iter_lines():
            now = time.perf_counter()
            stream.num_bytes += len(line) + 1
            if not line.startswith(b"data:"):
                continue  # the blank line between events, comments, `event:` fields
            data = line[5:].strip()
            if data == b"[DONE]":
                stream.done = True
                break
            event = json.loads(data)
            if not isinstance(event, dict):
                stream.problem = "an SSE event that is not a JSON object"
                break
            if "error" in event:
                stream.problem = f"error event: {error_message(event['error'])}"
                break
            stream.usage = event.get("usage") or stream.usage
            for choice in event.get("choices", []):
                if content := api.content(choice):
                    stream.content_times.append(now)
                    stream.text.append(content)
            if close_after is not None and len(stream.content_times) >= close_after:
                response.close()
                stream.closed_early = True
                break
    except requests.RequestException as exc:
        stream.problem = f"stream broken: {type(exc).__name__}"
    except json.JSONDecodeError:
        stream.problem = "an SSE event that is not a JSON object"
    stream.end = time.perf_counter()


def http_problem(response: ResponseContextManager) -> str:
    if response.status_code == 0:  # locust's stand-in response for a connection error
        return f"no response: {type(response.error).__name__}"
    try:
        message = error_message(response.json()["error"])
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    return f"HTTP {response.status_code}: {message}"


def error_message(error: Any) -> str:
    """The message of an OpenAI-shaped error object; some servers send a bare string."""
    return str(error.get("message") if isinstance(error, dict) else error)


def stream_problem(stream: Stream, max_tokens: int, ignore_eos: bool) -> str | None:
    """Why a stream that was read to its end (or closed early) is a failure, or None."""
    if stream.problem is not None or stream.closed_early:
        return stream.problem
    if not stream.done:
        return "stream ended without [DONE]"
    if stream.usage is None:
        return "no usage chunk (stream_options.include_usage was set)"
    num_tokens = stream.usage.get("completion_tokens")
    if not isinstance(num_tokens, int):
        return "usage without completion_tokens"
    if ignore_eos and num_tokens != max_tokens:
        return f"usage.completion_tokens is {num_tokens}, max_tokens {max_tokens} (ignore_eos)"
    return None


def report_metrics(request: EventHook, stream: Stream) -> None:
    """The stream's figures as METRIC rows; a failed stream reports none, one closed early
    only those of the tokens it read."""

    def fire(name: str, value: float) -> None:
        request.fire(
            request_type="METRIC",
            name=name,
            response_time=value,
            response_length=0,
            exception=None,
            context={},
        )

    if stream.problem is not None:
        return
    if stream.content_times:
        fire("ttft", 1000 * (stream.content_times[0] - stream.start))
    for earlier, later in itertools.pairwise(stream.content_times):
        fire("itl", 1000 * (later - earlier))
    if stream.closed_early or stream.usage is None:
        return
    num_tokens = stream.usage["completion_tokens"]
    fire("output_tok_per_s", num_tokens / (stream.end - stream.start))
    # A stream whose every token decodes to no text (special tokens) has no first token time.
    if stream.content_times and num_tokens > 1:
        fire("tpot", 1000 * (stream.end - stream.content_times[0]) / (num_tokens - 1))


# The scenarios' turns, counted over every user of this process.
_TURNS = itertools.count()


class Scenarios(TaskSet):
    """Each task is one scenario, tagged with its name (`--tags multi-turn`). They are taken
    in turn across the users, not drawn at random: the mix is even in any run, and the first
    streams of a run, one per user, already cover every scenario (when there are as many
    users)."""

    def get_next_task(self) -> Callable[..., Any]:
        return self.tasks[next(_TURNS) % len(self.tasks)]

    @tag("random")
    @task
    def random_lengths(self) -> None:
        self.user.random_lengths()

    @tag("shared-prefix")
    @task
    def shared_prefix(self) -> None:
        self.user.shared_prefix()

    @tag("multi-turn")
    @task
    def multi_turn(self) -> None:
        self.user.multi_turn()

    @tag("cancel")
    @task
    def cancel(self) -> None:
        self.user.cancel()


class OpenAIUser(HttpUser):
    """One client with one stream in flight at a time, so `-u` is the number of concurrent
    streams; its tasks are the `Scenarios`."""

    wait_time = constant(0)  # a closed loop: the next request leaves when a stream ends
    tasks = [Scenarios]  # noqa: RUF012 (locust reads the class attribute, a list)

    def on_start(self) -> None:
        self.options = self.environment.parsed_options
        if self.options.api_key:
            self.client.headers["Authorization"] = f"Bearer {self.options.api_key}"
        self.model = self.options.model or self.first_model_id()
        self.conversation: list[dict[str, str]] = []

    def first_model_id(self) -> str:
        with self.client.get("/v1/models", catch_response=True) as response:
            try:
                return str(response.json()["data"][0]["id"])
            except (ValueError, KeyError, IndexError, TypeError):
                response.failure(f"no model id in /v1/models: {http_problem(response)}")
        raise StopUser()

    def random_lengths(self) -> None:
        options = self.options
        prompt = words(random.randint(options.random_input_min, options.random_input_max))
        max_tokens = random.randint(options.random_output_min, options.random_output_max)
        self.stream("random", self.pick_api(), [user(prompt)], max_tokens)

    def shared_prefix(self) -> None:
        messages = [
            {"role": "system", "content": system_prompt(self.options.shared_prefix_words)},
            user(f"{words(self.options.question_words)}?"),
        ]
        self.stream("shared-prefix", self.pick_api(), messages, self.options.max_tokens)

    def multi_turn(self) -> None:
        if len(self.conversation) >= 2 * self.options.turns:
            self.conversation = []
        self.conversation.append(user(f"{words(self.options.question_words)}?"))
        stream = self.stream("multi-turn", CHAT, self.conversation, self.options.max_tokens)
        if stream.problem is None:
            self.conversation.append({"role": "assistant", "content": "".join(stream.text)})
        else:
            self.conversation = []

    def cancel(self) -> None:
        options = self.options
        close_after = options.cancel_after if random.random() < options.cancel_fraction else None
        prompt = words(options.question_words)
        self.stream("cancel", self.pick_api(), [user(prompt)], options.max_tokens, close_after)

    def pick_api(self) -> Api:
        return random.choice(APIS[self.options.api])

    def stream(
        self,
        scenario: str,
        api: Api,
        messages: list[dict[str, str]],
        max_tokens: int,
        close_after: int | None = None,
    ) -> Stream:
        """Send one streaming request, check it, and report it and its figures."""
        body = {
            **api.body(messages),
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": self.options.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.options.ignore_eos:  # sent only when set: OpenAI itself refuses unknown fields
            body["ignore_eos"] = True
        stream = Stream(time.perf_counter())
        with self.client.post(
            api.path,
            json=body,
            name=f"{scenario} {api.name}",
            stream=True,
            catch_response=True,
            timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
        ) as response:
            if response.status_code == 200:
                read_stream(response, api, stream, close_after)
            else:
                stream.problem, stream.end = http_problem(response), time.perf_counter()
            stream.problem = stream_problem(stream, max_tokens, self.options.ignore_eos)
            # With stream=True locust would report the time to the response headers, which
            # kvflow sends with the first token and other servers at once; the whole stream
            # is the comparable figure. request_meta is what the with-block reports on exit.
            response.request_meta["response_time"] = 1000 * (stream.end - stream.start)
            response.request_meta["response_length"] = stream.num_bytes
            if stream.closed_early:
                response.request_meta["name"] += " (closed early)"
            if stream.problem is None:
                response.success()
            else:
                response.failure(stream.problem)
        report_metrics(self.environment.events.request, stream)
        limit = self.options.num_requests
        if limit and next(STREAMS_ENDED) + 1 == limit:  # quit stops every user: not this one's
            gevent.spawn(self.environment.runner.quit)  # greenlet, or it would stop mid-way
        return stream


def user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}
