"""LangChain over splitserve: a typed answer (with_structured_output) and a
tool call, answered with the tool's result in a second turn.

    pip install langchain-openai
    python examples/langchain_agent.py --base-url http://localhost:8000/v1
"""

from __future__ import annotations

import json
from typing import Literal

from example_args import example_parser
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


def main() -> int:
    p = example_parser(__doc__)
    args = p.parse_args()
    llm = ChatOpenAI(model=args.model, base_url=args.base_url, api_key=args.api_key, temperature=0,
                     max_tokens=80)

    city = llm.with_structured_output(City).invoke("Name a city in Norway.")
    print("structured:", repr(city))

    ask = HumanMessage("What is the weather in Oslo?")
    asked = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke([ask])
    [call] = asked.tool_calls
    print("tool call:", call["name"], json.dumps(call["args"]))
    result = ToolMessage('{"temperature": 4, "sky": "snow"}', tool_call_id=call["id"])
    answer = llm.bind_tools([GetWeather]).invoke([ask, asked, result])
    print("answer:", answer.content or answer.tool_calls)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
