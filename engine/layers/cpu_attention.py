"""Builds and loads the CPU kernels (csrc/): decode attention over the paged
cache and float32 linear layers over packed weights, once per machine, cached
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


def build(name: str, source: Path) -> ModuleType | None:
    if os.environ.get("SPLITSERVE_NO_CPU_KERNEL"):
        return None
    try:
        from torch.utils.cpp_extension import load

        from engine.vocab.models import cache_dir

        # One folder per extension and source version: checkouts with different
        # sources (branches, worktrees) never rebuild over each other's build.
        sources = [source, *sorted(CSRC.glob("*.h"))]
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]
        build_dir = cache_dir() / "kernels" / f"{name}-{digest}"
        build_dir.mkdir(parents=True, exist_ok=True)
        for header in CSRC.glob("*.h"):  # the sources include these from their own folder
            stable_source(build_dir, header)
        return load(name=name, sources=[str(stable_source(build_dir, source))],
                    extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means: use the torch path
        log.warning("CPU kernel %s unavailable, using the torch path: %s", name, e)
        return None


@functools.cache
def load_cpu_kernel() -> ModuleType | None:
    return build("splitserve_paged_attention_cpu", SOURCE)


@functools.cache
def load_linear_kernel() -> ModuleType | None:
    return build("splitserve_linear_cpu", CSRC / "linear_cpu.cpp")
