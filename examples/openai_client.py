"""splitserve with the official openai SDK: a chat completion, the same one
streamed, and a reply forced to match a JSON schema.

    python examples/openai_client.py --base-url http://localhost:8000/v1

With API keys configured, pass one with --api-key (or OPENAI_API_KEY).
"""

from __future__ import annotations

import json

import openai
from example_args import example_parser


def main() -> int:
    p = example_parser(__doc__)
    args = p.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    ask = [{"role": "user", "content": "Name a city in Norway."}]

    reply = client.chat.completions.create(model=args.model, messages=ask, max_tokens=24, temperature=0)
    print("chat:", reply.choices[0].message.content)

    stream = client.chat.completions.create(model=args.model, messages=ask, max_tokens=24, temperature=0,
                                            stream=True)
    print("streamed:", "".join(c.choices[0].delta.content or "" for c in stream if c.choices))

    city = {"type": "object", "required": ["city", "population"],
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "population": {"type": "integer", "minimum": 0, "maximum": 20000000}}}
    structured = client.chat.completions.create(
        model=args.model, messages=ask, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": city}})
    print("json:", json.dumps(json.loads(structured.choices[0].message.content or "")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
