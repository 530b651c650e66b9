"""The CPU kernels' own thread pool (engine/layers/csrc/parallel_claim.h): the
same bits as OpenMP, callers on several Python threads at once, a fork, and a
worker's share done by the caller when the worker is late."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import engine
from engine.layers.cpu_attention import load_linear_kernel
from engine.layers.packed_linear import q4_blocks
from tests.unit.test_linear_isa import q4_weight

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    k = load_linear_kernel()
    assert k is not None, "the linear kernel must build on this machine"
    torch.set_num_threads(2)
    k.use_pool(True)  # this process loaded torch first: the loader left it on OpenMP
    yield k
    k.use_pool(engine.OPENMP_SLEEPS)


def pool_threads() -> int:
    n = 0
    for t in os.listdir("/proc/self/task"):
        # a thread (not the pool's, which stay) may end between the listing and the read
        with contextlib.suppress(FileNotFoundError):
            n += Path(f"/proc/self/task/{t}/comm").read_text().strip() == "ss-kernel"
    return n


def inputs(seed: int, m: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, 256, generator=gen), torch.randn(600, 256, generator=gen)


def test_the_pool_runs_the_kernels_and_gives_openmp_s_bits(kernel, tmp_path) -> None:  # type: ignore[no-untyped-def]
    x, w = inputs(0)
    panels = kernel.pack_weight(w)
    y = kernel.packed_linear(x, panels, 600)
    assert pool_threads() >= 1, "two torch threads and 38 panels: the pool's worker should be running"
    torch.save({"x": x, "w": w}, tmp_path / "in.pt")
    script = (
        "import sys, torch\n"
        "from engine.layers.cpu_attention import load_linear_kernel\n"
        "k = load_linear_kernel(); torch.set_num_threads(2)\n"
        f"d = torch.load({str(tmp_path / 'in.pt')!r})\n"
        "y = k.packed_linear(d['x'], k.pack_weight(d['w']), 600)\n"
        f"torch.save(y, {str(tmp_path / 'omp.pt')!r})\n"
        "import os; assert not any(open(f'/proc/self/task/{t}/comm').read().strip() == 'ss-kernel'"
        " for t in os.listdir('/proc/self/task')), 'omp mode started the pool'\n")
    env = dict(os.environ, SPLITSERVE_KERNEL_THREADS="omp")
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, check=True, timeout=300)
    assert torch.equal(torch.load(tmp_path / "omp.pt"), y)


def test_callers_on_several_threads_at_once_each_get_their_own_result(kernel) -> None:  # type: ignore[no-untyped-def]
    w = q4_weight(512, 256, torch.Generator().manual_seed(3))
    blocks = q4_blocks(w, kernel)
    assert blocks is not None
    panels = kernel.pack_weight(w)
    xs = [inputs(10 + i, m=1 + 7 * i)[0] for i in range(4)]
    want = [(kernel.packed_linear(x, panels, 512), kernel.q4_linear(x, blocks, 512)) for x in xs]
    errors: list[str] = []
    start = threading.Barrier(len(xs))

    def call(i: int) -> None:
        start.wait()
        for _ in range(40):
            got = (kernel.packed_linear(xs[i], panels, 512), kernel.q4_linear(xs[i], blocks, 512))
            if not all(torch.equal(g, e) for g, e in zip(got, want[i], strict=True)):
                errors.append(f"caller {i} got another result")
                return

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    assert errors == []


LATE_WORKER = """
import os
import engine  # before torch, as a worker imports them
import torch
from engine.layers.cpu_attention import load_linear_kernel
from engine.layers.packed_linear import q4_blocks
from tests.unit.test_linear_isa import q4_weight
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core: the worker runs when the caller waits
k = load_linear_kernel()
k.use_pool(True)
w = q4_weight(3072, 576, torch.Generator().manual_seed(4))
blocks = q4_blocks(w, k)
xs = [torch.randn(m, 576, generator=torch.Generator().manual_seed(m)) for m in (1, 3, 8)]
torch.set_num_threads(1)  # inline: no pool
want = [k.q4_linear(x, blocks, 3072) for x in xs]
torch.set_num_threads(2)
before = k.pool_stolen()
for _ in range(50):
    for x, y in zip(xs, want):
        assert torch.equal(k.q4_linear(x, blocks, 3072), y), "a result changed"
print(k.pool_stolen() - before)
"""


def test_a_late_workers_share_is_done_by_the_caller() -> None:
    """The worker sleeps after each job (no spin) and shares one core with the
    caller, so it wakes after the caller has run its own share: the caller
    takes the worker's pieces too (pool_stolen counts them), with the bits of
    one thread."""
    env = dict(os.environ, SPLITSERVE_KERNEL_SPIN_US="0")
    out = subprocess.run([sys.executable, "-c", LATE_WORKER], cwd=ROOT, env=env, check=True, timeout=300,
                         capture_output=True, text=True)
    assert int(out.stdout.split()[-1]) > 0, "no piece was taken from another thread's share"


def child(conn, x, panels, want) -> None:  # type: ignore[no-untyped-def]
    k = load_linear_kernel()
    assert k is not None
    torch.set_num_threads(2)
    got = k.packed_linear(x, panels, 600)
    # compared in Python: torch's own OpenMP regions hang in a forked child (libgomp)
    conn.send((got.tolist() == want.tolist(), pool_threads()))


def test_a_forked_child_starts_its_own_pool(kernel) -> None:  # type: ignore[no-untyped-def]
    x, w = inputs(1)
    panels = kernel.pack_weight(w)
    want = kernel.packed_linear(x, panels, 600)
    assert pool_threads() >= 1
    ctx = mp.get_context("fork")
    parent, conn = ctx.Pipe()
    p = ctx.Process(target=child, args=(conn, x, panels, want))
    p.start()
    assert parent.poll(120), "the forked child hung in the kernel"
    same, threads = parent.recv()
    p.join(30)
    assert same, "the child computed another result"
    assert threads >= 1, "the child ran without a pool worker of its own"



SHARED = ("import os, engine, torch\n"
          "from engine import LLM, SamplingParams\n"
          "torch.set_num_threads(2)\n"
          "llm = LLM(max_num_seqs=4, dtype='float32')\n"
          "llm.generate(['One', 'Two, three', 'Four five six', 'Seven'], SamplingParams(max_tokens=4))\n"
          "d = '/proc/self/task'\n"
          "print(engine.OPENMP_SLEEPS, sum(open(f'{d}/{t}/comm').read().strip() == 'ss-kernel'"
          " for t in os.listdir(d)))\n")


def test_the_linear_and_attention_kernels_share_one_pool() -> None:
    """Four sequences decoding on two threads: the projections and the
    attention (a span per sequence and more) each run on a pool, and it is
    the same pool, so there is one worker beside the calling thread."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", SHARED], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True, timeout=300).stdout.split()
    assert out == ["True", "1"]


PROBE = ("import sys, os{first}\n"
         "import engine\n"
         "from engine.layers.cpu_attention import load_linear_kernel\n"
         "import torch; torch.set_num_threads(2)\n"
         "k = load_linear_kernel()\n"
         "k.packed_linear(torch.randn(64, 256), k.pack_weight(torch.randn(600, 256)), 600)\n"
         "d = '/proc/self/task'; tasks = [open(f'{{d}}/{{t}}/comm').read().strip() for t in os.listdir(d)]\n"
         "print(os.environ.get('OMP_WAIT_POLICY'), engine.OPENMP_SLEEPS, 'ss-kernel' in tasks)\n")


@pytest.mark.parametrize("first,policy,want", [
    ("", None, ["PASSIVE", "True", "True"]),  # engine first: OpenMP sleeps, the pool runs
    ("", "ACTIVE", ["ACTIVE", "False", "False"]),  # told otherwise: OpenMP spins, so no pool
    ("; import torch", None, ["None", "False", "False"]),  # torch loaded OpenMP first: too late to ask
])
def test_the_pool_runs_only_where_openmp_threads_sleep(first: str, policy: str | None,
                                                       want: list[str]) -> None:
    """engine sets OMP_WAIT_POLICY before torch loads OpenMP: spinning OpenMP
    threads would take the cores the kernel pool's workers run on."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True, timeout=300).stdout.split()
    assert out == want


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_runs_its_kernels_on_the_pool(role: str) -> None:
    """Each worker's entry point imports engine before anything loads torch (the
    prefill worker's KV transport once loaded torch first, leaving its kernels
    on OpenMP's spinning threads)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    probe = f"import services.{role}.__main__, engine; print(engine.OPENMP_SLEEPS)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True, timeout=300).stdout.split()
    assert out == ["True"]
