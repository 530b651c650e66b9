"""The examples/ a new user starts from run as they are against the split stack
(the structured-output tests' stack: a prefill and a decode worker, a frontend)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from .procs import ROOT
from .test_frontend import Frontend
from .test_structured_output import stack  # noqa: F401 - the same split stack, started here


def run_example(name: str, *args: str) -> str:
    # As a user runs them: a script, with this checkout's packages on the path.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_grpc_client(stack: Frontend) -> None:  # noqa: F811
    out = run_example("grpc_client.py", "--address", f"127.0.0.1:{stack.grpc_port}", "--max-tokens", "8",
                      "The capital of France is")
    usage = re.search(r"\[length: (\d+) prompt tokens, (\d+) generated\]", out)
    assert usage and int(usage.group(2)) == 8, out


def test_openai_client(stack: Frontend) -> None:  # noqa: F811
    out = run_example("openai_client.py", "--base-url", f"{stack.url}/v1")
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert lines["chat"] == lines["streamed"]  # greedy: the stream is the same reply
    answer = json.loads(lines["json"])
    assert set(answer) == {"city", "population"} and isinstance(answer["population"], int)


def test_langchain_agent(stack: Frontend) -> None:  # noqa: F811
    pytest.importorskip("langchain_openai")
    out = run_example("langchain_agent.py", "--base-url", f"{stack.url}/v1")
    assert re.search(r"^structured: City\(name=", out, re.M), out
    call = re.search(r"^tool call: GetWeather (.*)$", out, re.M)
    assert call and set(json.loads(call.group(1))) == {"city", "unit"}, out
    assert re.search(r"^answer: .+", out, re.M), out
