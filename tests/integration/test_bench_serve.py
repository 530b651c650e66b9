"""`splitserve bench serve` against a real stack (`splitserve up --prefill 0
--decode 1`, its worker pinned with --cpu-affinity), and `splitserve export-hf`:
the exported directory loads in transformers and greedily says what the stack
says."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from .procs import ROOT, free_port

PIN_CPU = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


@pytest.fixture(scope="module")
def stack(tmp_path_factory):  # type: ignore[no-untyped-def]
    log = tmp_path_factory.mktemp("bench") / "up.log"
    port = free_port()
    argv = [sys.executable, "-m", "services.cli", "up", "--prefill", "0", "--decode", "1",
            "--port", str(port), "--grpc-port", str(free_port()), "--dtype", "float32",
            "--num-blocks", "128", "--max-model-len", "1024", "--num-threads", "1"]
    if PIN_CPU is not None:
        argv += ["--cpu-affinity", f"decode={PIN_CPU}"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while b"splitserve is up" not in log.read_bytes():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.mark.skipif(PIN_CPU is None, reason="needs sched_getaffinity")
def test_up_pins_the_worker(stack) -> None:  # type: ignore[no-untyped-def]
    (worker,) = httpx.get(f"{stack}/cluster").json()["workers"]
    assert os.sched_getaffinity(worker["pid"]) == {PIN_CPU}


def test_bench_serve_reports_one_json_line(stack, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "runs.jsonl"
    plot = tmp_path / "plot.png"
    argv = [sys.executable, "-m", "services.cli", "bench", "serve", "--base-url", stack,
            "--num-prompts", "6", "--input-len-min", "8", "--input-len-max", "60", "--output-len", "5",
            "--concurrency", "3", "--slo-ttft-ms", "600000", "--slo-itl-ms", "0.001",
            "--label", "splitserve-test", "--json-out", str(out), "--plot", str(plot)]
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    line = json.loads(run.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text())  # --json-out appends the same line
    assert line["bench"] == "serve" and line["label"] == "splitserve-test"
    assert line["model"] == "SmolLM2-135M-Instruct"  # asked from /v1/models
    assert (line["requests"], line["completed"], line["failed"]) == (6, 6, 0)
    assert line["output_tokens"] == 6 * 5  # ignore_eos + min_tokens hold every length
    assert line["input_tokens"] >= 6 * 8
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = line[key]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"], (key, d)
    assert line["ttft_ms"]["p99"] <= line["e2e_ms"]["p99"]
    assert line["output_throughput"] > 0 and line["request_throughput"] > 0
    assert line["goodput"]["good_requests"] == 0  # nobody makes 1 us per token
    assert "6/6 done" in run.stderr  # the progress bar's last line
    assert "TTFT" in run.stdout and "ITL" in run.stdout
    try:
        import matplotlib  # noqa: F401
        assert plot.stat().st_size > 0
    except ImportError:
        assert "matplotlib is not installed" in run.stderr and not plot.exists()


def test_export_hf_loads_in_transformers_and_matches_the_stack(stack, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.cli import main

    out = tmp_path / "hf"
    assert main(["export-hf", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = "The capital of France is"
    ids = tok.encode(prompt)
    with torch.inference_mode():  # greedy, a full forward per token: cheaper than generate() to start
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    expected = tok.decode(ids[-6:], skip_special_tokens=True)
    r = httpx.post(f"{stack}/v1/completions", timeout=120,
                   json={"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 6,
                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "<|im_start|>user" in chat  # the chat template came along
