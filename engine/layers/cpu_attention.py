"""Builds and loads the CPU kernels (csrc/): decode and prefill attention over
the paged cache and float32 linear layers over packed weights, once per machine, cached
under the splitserve cache dir.  If a build fails (no compiler, no ninja) the
engine keeps the pure-torch path."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "paged_attention_cpu.cpp"
# The linear kernels: the torch-facing file and one file per instruction set.
LINEAR_SOURCES = [CSRC / "linear_cpu.cpp", CSRC / "decode_stack.cpp",
                  *(CSRC / f"linear_isa_{isa}.cpp"
                    for isa in ("scalar", "avx2", "avx512", "avx512bf16", "avx512bf16q4", "avx512vnni",
                                "amx"))]


def stable_source(build_dir: Path, source: Path = SOURCE) -> Path:
    """The kernel's source copied into the cache: the build records the source's
    path, so building from the checkout would rebuild (about a minute) for every
    clone; from here one build serves them all until the source changes."""
    dst = build_dir / source.name
    text = source.read_bytes()
    if not dst.exists() or dst.read_bytes() != text:
        tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
        tmp.write_bytes(text)
        os.replace(tmp, dst)  # atomic: workers starting together never read half a file
    return dst


# -march=native: the attention kernel leans on the compiler's vectorizer, so
# its build is for this CPU (its flags are part of the build's key).  The
# linear kernels pick their instruction set at run time instead (one build for
# every x86-64 CPU); -ffp-contract=off keeps their dequantizing mul-then-add
# from being fused, which would round weights differently from their float32 copies.
NATIVE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
PORTABLE_FLAGS = ["-O3", "-ffast-math", "-ffp-contract=off", "-fopenmp"]
# The attention kernel as an AVX2-only machine builds it (x86-64-v3: AVX2, FMA,
# F16C): SPLITSERVE_ATTENTION_ISA=avx2 runs it on a CPU with AVX-512 too, so
# that, beside SPLITSERVE_LINEAR_ISA=avx2, a step there runs an AVX2 machine's
# code (benchmarks.step_profile's numbers for a Zen 3 measured on a Zen 4).
AVX2_FLAGS = [f for f in NATIVE_FLAGS if f != "-march=native"] + ["-march=x86-64-v3"]
ATTENTION_ISAS = ("native", "avx2")


def build(name: str, sources: list[Path], cflags: list[str]) -> ModuleType | None:
    if os.environ.get("SPLITSERVE_NO_CPU_KERNEL"):
        return None
    try:
        from torch.utils.cpp_extension import load

        from engine.layers.cpu_features import cpuinfo
        from engine.vocab.models import cache_dir

        # One folder per extension and source version: checkouts with different
        # sources (branches, worktrees) never rebuild over each other's build.
        headers = sorted(CSRC.glob("*.h"))
        h = hashlib.sha256(b"".join(p.read_bytes() for p in [*sources, *headers]))
        h.update(" ".join(cflags).encode())
        if "-march=native" in cflags:  # a native build is for this CPU only
            h.update(" ".join(sorted(cpuinfo()[1])).encode())
        build_dir = cache_dir() / "kernels" / f"{name}-{h.hexdigest()[:12]}"
        build_dir.mkdir(parents=True, exist_ok=True)
        for header in headers:  # the sources include these from their own folder
            stable_source(build_dir, header)
        module = load(name=name, sources=[str(stable_source(build_dir, s)) for s in sources],
                      extra_cflags=cflags, extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                      verbose=False)
        import engine
        module.use_pool(engine.OPENMP_SLEEPS and os.environ.get("SPLITSERVE_KERNEL_THREADS") != "omp")
        return module
    except Exception as e:  # noqa: BLE001 - any build failure means: use the torch path
        log.warning("CPU kernel %s unavailable, using the torch path: %s", name, e)
        return None


def attention_isa() -> str:
    """Which attention build load_cpu_kernel loads: "native" (this CPU's
    flags) or "avx2" (SPLITSERVE_ATTENTION_ISA=avx2, an AVX2 machine's)."""
    return os.environ.get("SPLITSERVE_ATTENTION_ISA") or "native"


@functools.cache
def load_cpu_kernel() -> ModuleType | None:
    isa = attention_isa()
    if isa not in ATTENTION_ISAS:
        raise ValueError(f"SPLITSERVE_ATTENTION_ISA={isa}: not one of {', '.join(ATTENTION_ISAS)}")
    if isa == "avx2":
        from engine.layers.cpu_features import has

        if not all(has(f) for f in ("avx2", "fma", "f16c")):
            raise ValueError("SPLITSERVE_ATTENTION_ISA=avx2: this CPU lacks AVX2, FMA or F16C")
        return build_avx2_kernel()
    return build("splitserve_paged_attention_cpu", [SOURCE], NATIVE_FLAGS)


def build_avx2_kernel() -> ModuleType | None:
    """The attention kernel built for x86-64-v3 (AVX2_FLAGS), whatever this CPU has."""
    return build("splitserve_paged_attention_avx2", [SOURCE], AVX2_FLAGS)


@functools.cache
def load_linear_kernel() -> ModuleType | None:
    return build("splitserve_linear_cpu", LINEAR_SOURCES, PORTABLE_FLAGS)
