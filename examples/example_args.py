"""The flags every example takes: where the server is, the key, the model.

Examples run as scripts (`python examples/NAME.py`), so this module is found
beside them."""

from __future__ import annotations

import argparse
import os

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def example_parser(doc: str, *, grpc: bool = False) -> argparse.ArgumentParser:
    """A parser described by the example's docstring, with --base-url (REST)
    or --address (gRPC), --api-key and --model."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    if grpc:
        p.add_argument("--address", default="localhost:50051", help="the frontend's gRPC address")
        p.add_argument("--api-key", default=os.environ.get("SPLITSERVE_API_KEY"),
                       help="an API key, when the server has keys (env SPLITSERVE_API_KEY)")
    else:
        p.add_argument("--base-url", default="http://localhost:8000/v1", help="the frontend's REST API")
        p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"),
                       help="an API key, when the server has keys (env OPENAI_API_KEY)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the served model's name")
    return p
