"""The load generator of `splitserve bench serve`: streams requests to any
OpenAI-compatible server (benchmarks/http_stream.py), on schedule, and times
every chunk."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO
from urllib.parse import urlsplit

from benchmarks.http_stream import StreamClient
from benchmarks.serve_stats import RequestResult, chunk_token_counts, spread_token_times
from benchmarks.serve_workloads import BenchRequest

DONE = "[DONE]"


class SSEDecoder:
    """Server-sent events, line by line: yields each event's data (several
    `data:` lines joined by newlines) at the blank line that ends it."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> Iterator[str]:
        line = line.rstrip("\r\n")
        if not line:
            if self._data:
                yield "\n".join(self._data)
                self._data = []
            return
        if line.startswith(":"):  # comment / keep-alive
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))

    def close(self) -> Iterator[str]:
        """A stream that ends without the final blank line still delivers its event."""
        yield from self.feed("")


@dataclass(frozen=True)
class Target:
    url: str  # .../v1/completions or .../v1/chat/completions
    model: str
    chat: bool
    temperature: float = 0.0


def request_body(target: Target, req: BenchRequest) -> dict[str, Any]:
    """Exactly `output_len` tokens: ignore_eos and min_tokens (vLLM's and
    splitserve's extensions) hold the length, whatever the model would say."""
    body: dict[str, Any] = {"model": target.model, "max_tokens": req.output_len,
                            "min_tokens": req.output_len, "ignore_eos": True,
                            "temperature": target.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if target.chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def chunk_text(obj: dict[str, Any], chat: bool) -> str:
    """The text a streamed chunk adds (choice 0; a usage-only chunk has none)."""
    choices = obj.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


class ResponseTimer:
    """Collects one streamed response's chunks as they arrive."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.chunk_times: list[float] = []
        self.text_lens: list[int] = []
        self.usage: dict[str, Any] | None = None
        self.error = ""

    def on_event(self, data: str, at: float) -> bool:
        """False once the stream is over ([DONE] or an error)."""
        if data == DONE:
            return False
        obj = json.loads(data)
        if "error" in obj:
            err = obj["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return False
        if obj.get("usage"):
            self.usage = obj["usage"]
        text = chunk_text(obj, self.chat)
        if text:
            self.chunk_times.append(at)
            self.text_lens.append(len(text))
        return True

    def result(self, group: str, start: float, end: float) -> RequestResult:
        if self.error or not self.chunk_times:
            return RequestResult(group, ok=False, start=start, e2e=end,
                                 error=self.error or "no tokens in the response")
        usage = self.usage or {}
        total = int(usage.get("completion_tokens") or len(self.chunk_times))
        times = spread_token_times(self.chunk_times, chunk_token_counts(self.text_lens, total))
        return RequestResult(group, ok=True, start=start, ttft=self.chunk_times[0], e2e=end,
                             output_tokens=total, prompt_tokens=usage.get("prompt_tokens"),
                             token_times=times)


async def send_one(client: StreamClient, target: Target, req: BenchRequest, t0: float,
                   timeout: float) -> RequestResult:
    """One streamed request; times are seconds after its start."""
    timer = ResponseTimer(target.chat)
    start = time.perf_counter()
    try:
        await asyncio.wait_for(_stream_one(client, target, req, timer, start), timeout)
    except asyncio.TimeoutError:
        timer.error = f"no complete response within {timeout:g} s"
    except Exception as e:  # a failed request is a result, not a crash
        timer.error = f"{type(e).__name__}: {e}"
    end = time.perf_counter() - start
    return timer.result(req.group, start - t0, end)


async def _stream_one(client: StreamClient, target: Target, req: BenchRequest,
                      timer: ResponseTimer, start: float) -> None:
    u = urlsplit(target.url)
    resp = await client.post(u.path + (f"?{u.query}" if u.query else ""), request_body(target, req))
    try:
        if resp.status != 200:
            body = (await resp.read()).decode(errors="replace")
            timer.error = f"HTTP {resp.status}: {body[:200]}"
            return
        decoder = SSEDecoder()
        async for line in resp.lines():
            for data in decoder.feed(line):
                if not timer.on_event(data, time.perf_counter() - start):
                    return  # [DONE] or an error: the rest is not read (the connection is dropped)
        for data in decoder.close():  # no blank line after the last event
            timer.on_event(data, time.perf_counter() - start)
    finally:
        resp.close()


def render_progress(done: int, total: int, failed: int, elapsed: float, width: int = 30) -> str:
    filled = width * done // total if total else width
    bar = "#" * filled + "." * (width - filled)
    return f"[{bar}] {done}/{total} done" + (f", {failed} failed" if failed else "") + f", {elapsed:.0f} s"


class Progress:
    """A progress bar on a terminal (redrawn in place, at most 10 times a
    second); elsewhere only the last line."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.tty = enabled and self.stream.isatty()
        self.done = self.failed = 0
        self.t0 = time.monotonic()
        self._drawn = 0.0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        now = time.monotonic()
        if self.tty and (now - self._drawn > 0.1 or self.done == self.total):
            self._drawn = now
            self.stream.write("\r" + render_progress(self.done, self.total, self.failed, now - self.t0))
            self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        line = render_progress(self.done, self.total, self.failed, time.monotonic() - self.t0)
        self.stream.write(("\r" + line if self.tty else line) + "\n")
        self.stream.flush()


def auth_headers() -> dict[str, str]:
    """OPENAI_API_KEY, read as OpenAI's clients read it: for an endpoint that wants a key."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def run_requests(target: Target, requests: list[BenchRequest], concurrency: int | None,
                       timeout: float, progress: Progress) -> tuple[list[RequestResult], float]:
    """Send each request at its arrival time (seconds after the start), with at
    most `concurrency` in flight (a request waits for a slot past its time).
    Returns the results in request order and the run's duration (the start to
    the last response)."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time or 0.0)
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    results: list[RequestResult | None] = [None] * len(requests)
    client = StreamClient(target.url, headers=auth_headers(), max_idle=concurrency or 100)
    try:

        async def one(i: int, t0: float) -> None:
            try:
                results[i] = r = await send_one(client, target, requests[i], t0, timeout)
                progress.update(r.ok)
            finally:
                if slots is not None:
                    slots.release()

        tasks = []
        t0 = time.perf_counter()
        for i in order:
            delay = t0 + (requests[i].arrival_time or 0.0) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is not None:
                await slots.acquire()
            tasks.append(asyncio.create_task(one(i, t0)))
        await asyncio.gather(*tasks)
    finally:
        await client.aclose()
    duration = max((r.start + r.e2e for r in results if r is not None), default=0.0)
    progress.close()
    return [r for r in results if r is not None], duration
