"""The client libraries people put in front of an OpenAI-compatible server, each on its normal
path against a real `kvflow serve` (issue 45): instructor (TOOLS and JSON_SCHEMA modes),
LangChain's ChatOpenAI (`with_structured_output` by each of its three methods, a `bind_tools`
round trip), litellm (forced tool calls and plain text, as `hosted_vllm/` and `openai/`
models) and the OpenAI Agents SDK (a tool-using agent turn over the Responses API). The
`openai` and `anthropic` SDKs have their own modules (test_structured_output.py,
test_responses_api.py, test_messages_api.py).

Where a library parses what came back (a pydantic model, tool calls, a final output), the check
is that it parsed it: a wrong shape or a missing field fails here as it would for a user.
Outputs are short (small max_tokens, bounded schemas) and greedy (temperature 0), so the same
every run. The servers are tests/e2e/conftest.py's shared ones: the embedded SmolLM2-135M
(`default_server`) for every library but the Agents SDK. An agent resets its tool_choice after
a call, so its next turn is `auto`, which only `tool_server` serves (random weights, the Hermes
parser); there the agent's output_type, a JSON schema, is what ends that turn.

Nothing here may reach the network: the environment below is set before any of the libraries is
imported. Each test imports its library itself, so that only the pytest-xdist worker that runs
these tests pays for the imports (seconds each).
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Annotated, Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.server import API_KEY, Server

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # else litellm downloads it at import
os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"  # else the Agents SDK uploads its traces
os.environ["LANGSMITH_TRACING"] = "false"  # LangChain's tracing: off unless set; kept off

pytestmark = pytest.mark.slow

# A system message that names the keys: LangChain's json_mode sends no schema, only the prompt
# says what the object holds (json_object constrains the output to some JSON object).
CITY_PROMPT = [
    {"role": "system", "content": 'Answer with a JSON object with the keys "name" and "country".'},
    {"role": "user", "content": "Describe Paris."},
]
WEATHER_PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}


class City(BaseModel):
    """A city and its country."""

    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.fixture(scope="module")
def client(default_server: Server) -> openai.OpenAI:
    return default_server.client(max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


# ---------------------------------------------------------------------------- instructor


def test_instructor_tools_mode_extracts_the_model(client: openai.OpenAI, model: str) -> None:
    """TOOLS: the model's schema as the one tool, named in tool_choice; its call's arguments
    are the object."""
    import instructor

    patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    city, completion = patched.chat.completions.create_with_completion(
        model=model,
        messages=CITY_PROMPT,
        response_model=City,
        max_retries=0,  # no re-ask: an invalid reply fails the test
        max_tokens=40,
        temperature=0,
    )
    assert isinstance(city, City) and city.name == "Paris" and city.country
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"  # a named call ends as "stop"
    [call] = choice.message.tool_calls
    assert call.function.name == "City"
    assert json.loads(call.function.arguments) == city.model_dump()


def test_instructor_json_schema_mode_extracts_the_model(client: openai.OpenAI, model: str) -> None:
    """JSON_SCHEMA: the model's schema as response_format; the reply's content is the object."""
    import instructor

    patched = instructor.from_openai(client, mode=instructor.Mode.JSON_SCHEMA)
    city, completion = patched.chat.completions.create_with_completion(
        model=model,
        messages=CITY_PROMPT,
        response_model=City,
        max_retries=0,
        max_tokens=40,
        temperature=0,
    )
    assert isinstance(city, City) and city.name == "Paris" and city.country
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop" and not message.tool_calls
    assert json.loads(message.content) == city.model_dump()


# ---------------------------------------------------------------------------- LangChain


def chat_openai(server: Server, model: str, max_tokens: int = 40) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key=API_KEY,
        model=model,
        temperature=0,
        max_tokens=max_tokens,
        max_retries=0,
    )


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_langchain_structured_output(default_server: Server, model: str, method: str) -> None:
    llm = chat_openai(default_server, model)
    structured = llm.with_structured_output(City, method=method, include_raw=True)
    result = structured.invoke([(m["role"], m["content"]) for m in CITY_PROMPT])
    assert result["parsing_error"] is None
    city, raw = result["parsed"], result["raw"]
    assert isinstance(city, City) and city.name == "Paris" and city.country
    if method == "function_calling":  # the schema as a tool, called by name
        assert [call["name"] for call in raw.tool_calls] == ["City"]
        assert raw.tool_calls[0]["args"] == city.model_dump()
    else:  # the reply's text is the object
        assert not raw.tool_calls and json.loads(raw.content) == city.model_dump()
    assert raw.response_metadata["finish_reason"] == "stop"
    assert raw.usage_metadata["output_tokens"] < 40


def test_langchain_bind_tools_round_trip(default_server: Server, model: str) -> None:
    """The model calls the tool (tool_choice "any": OpenAI's "required"), the tool's result goes
    back as a ToolMessage after the model's call, and the model answers in text."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    ran: list[str] = []

    @tool
    def get_weather(city: Annotated[str, Field(max_length=20)]) -> str:
        """The current weather in a city."""
        ran.append(city)
        return f"It is sunny and 25 degrees in {city}."

    llm = chat_openai(default_server, model)
    messages: list[Any] = [HumanMessage(WEATHER_PROMPT[0]["content"])]
    call = llm.bind_tools([get_weather], tool_choice="any").invoke(messages)
    assert isinstance(call, AIMessage) and call.response_metadata["finish_reason"] == "tool_calls"
    [tool_call] = call.tool_calls
    assert tool_call["name"] == "get_weather" and tool_call["args"] == {"city": "Paris"}
    assert tool_call["id"].startswith("call_")

    messages += [call, get_weather.invoke(tool_call)]
    assert ran == ["Paris"]
    assert isinstance(messages[-1], ToolMessage)
    assert messages[-1].tool_call_id == tool_call["id"]
    answerer = chat_openai(default_server, model, max_tokens=12)
    answer = answerer.bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert isinstance(answer, AIMessage) and not answer.tool_calls
    assert isinstance(answer.content, str) and answer.content.strip()
    # The tool's result reached the prompt (SmolLM2's template shows the call's turn, empty).
    assert answer.usage_metadata["input_tokens"] > call.usage_metadata["input_tokens"] + 10


# ---------------------------------------------------------------------------- litellm


@pytest.fixture(scope="module")
def litellm() -> Any:
    import litellm

    return litellm


@pytest.mark.parametrize(
    ("provider", "tool_choice"),
    [
        ("hosted_vllm", "required"),
        ("openai", {"type": "function", "function": {"name": "get_weather"}}),
    ],
    ids=["hosted_vllm-required", "openai-named"],
)
def test_litellm_forced_tool_call(
    litellm: Any, default_server: Server, model: str, provider: str, tool_choice: Any
) -> None:
    """A call forced either way, through either of litellm's providers for an OpenAI-compatible
    server (vLLM's, and OpenAI's own with api_base)."""
    response = litellm.completion(
        model=f"{provider}/{model}",
        api_base=f"{default_server.url}/v1",
        api_key=API_KEY,
        messages=WEATHER_PROMPT,
        tools=[WEATHER_TOOL],
        tool_choice=tool_choice,
        max_tokens=40,
        temperature=0,
        num_retries=0,
    )
    choice = response.choices[0]
    # litellm reports any reply with calls as "tool_calls" (a named call's "stop" too).
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert response.usage.completion_tokens < 40


@pytest.mark.parametrize("provider", ["hosted_vllm", "openai"])
def test_litellm_plain_completion(
    litellm: Any, default_server: Server, model: str, provider: str
) -> None:
    response = litellm.completion(
        model=f"{provider}/{model}",
        api_base=f"{default_server.url}/v1",
        api_key=API_KEY,
        messages=[{"role": "user", "content": "The capital of France is"}],
        max_tokens=8,
        temperature=0,
        num_retries=0,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert isinstance(choice.message.content, str) and choice.message.content.strip()
    assert response.usage.completion_tokens == 8 and response.usage.prompt_tokens > 0


# ---------------------------------------------------------------------------- OpenAI Agents SDK


class Sky(BaseModel):
    """The agent's final output: bounded, so that the random model's turn ends."""

    sky: Literal["sunny", "rainy"]


def test_agents_sdk_runs_a_tool_then_answers(tool_server: Server) -> None:
    """Turn 1: tool_choice "required" (ModelSettings) makes the model call get_weather; the SDK
    runs it with the parsed arguments and sends its output back as a function_call_output.
    Turn 2: the SDK has reset tool_choice (so `auto`), and the model answers with the agent's
    output_type. Both turns carry the output_type's text.format: beside turn 1's forced call it
    gives way to the call. The model's weights are random: only the grammars make either turn
    parse."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)
    ran: list[str] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=10)]) -> str:
        """The current weather in a city."""
        ran.append(city)
        return f"Sunny in {city}."

    async def run() -> Any:
        client = tool_server.async_client()
        try:
            model = (await client.models.list()).data[0].id
            agent = Agent(
                name="weather",
                instructions="Answer with the weather the tool reports.",
                tools=[get_weather],
                output_type=Sky,
                model=OpenAIResponsesModel(model=model, openai_client=client),
                model_settings=ModelSettings(
                    tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=40
                ),
            )
            return await Runner.run(agent, WEATHER_PROMPT[0]["content"], max_turns=3)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert [type(item) for item in result.new_items] == [
        ToolCallItem,
        ToolCallOutputItem,
        MessageOutputItem,
    ]
    call, output = result.new_items[0].raw_item, result.new_items[1]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert ran == [json.loads(call.arguments)["city"]]
    assert output.output == f"Sunny in {ran[0]}."
    assert isinstance(result.final_output, Sky)
    first, second = result.raw_responses
    assert [item.type for item in first.output] == ["function_call"]
    assert [item.type for item in second.output] == ["message"]
