"""LangChain over the split stack: ChatOpenAI's with_structured_output (JSON
schema and function calling) and bind_tools with tool_choice required and
named give valid objects and calls; a two-turn tool conversation completes."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

from .test_frontend import MODEL, Frontend
from .test_structured_output import stack  # noqa: F401 - the same split stack, started here

langchain_openai = pytest.importorskip("langchain_openai")
messages = pytest.importorskip("langchain_core.messages")


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    hobbies: list[Literal["chess", "music", "hiking"]] = Field(max_length=2)


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


class Add(BaseModel):
    """Add two integers."""

    a: int = Field(ge=-1000, le=1000)
    b: int = Field(ge=-1000, le=1000)


@pytest.fixture(scope="module")
def llm(stack: Frontend):  # type: ignore[no-untyped-def]  # noqa: F811
    return langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{stack.url}/v1", api_key="unused",
                                       temperature=0, max_tokens=80, max_retries=0, timeout=300)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(llm, method: str) -> None:  # type: ignore[no-untyped-def]
    person = llm.with_structured_output(Person, method=method).invoke("Describe a person who likes chess.")
    assert isinstance(person, Person)  # LangChain parsed and validated it


def test_bind_tools_required_and_named(llm) -> None:  # type: ignore[no-untyped-def]
    required = llm.bind_tools([GetWeather, Add], tool_choice="required", parallel_tool_calls=False)
    msg = required.invoke("What is the weather in Oslo?")
    assert len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    {"GetWeather": GetWeather, "Add": Add}[call["name"]].model_validate(call["args"])
    named = llm.bind_tools([GetWeather, Add], tool_choice="Add").invoke("What is 19 plus 23?")
    assert [c["name"] for c in named.tool_calls] == ["Add"]
    Add.model_validate(named.tool_calls[0]["args"])


def test_two_turn_tool_conversation(llm) -> None:  # type: ignore[no-untyped-def]
    ask = messages.HumanMessage("What is the weather in Oslo?")
    call_msg = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke([ask])
    [call] = call_msg.tool_calls
    result = messages.ToolMessage('{"temperature": 4, "sky": "snow"}', tool_call_id=call["id"])
    answer = llm.bind_tools([GetWeather]).invoke([ask, call_msg, result])
    assert isinstance(answer, messages.AIMessage)
    assert answer.content or answer.tool_calls
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
