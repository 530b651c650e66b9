"""The projections of a decode step on their own: SmolLM2-135M's four
projections (qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576) for
30 layers of distinct random weights, so that they stream from memory as in a
step, at `--rows` rows, on the 4-bit blocks (the default model's path at every
row count) and on float32 panels.  The two are interleaved run by run (the
machines are shared and noisy); best and median of `--runs` per format.

    python -m benchmarks.projection_formats --rows 32 --runs 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

# engine before torch (imported in main): the kernels' own thread pool, as in a
# worker (engine/__init__.py).
from engine.layers.cpu_attention import load_linear_kernel
from engine.layers.cpu_features import cpu_summary
from engine.layers.packed_linear import q4_layout
from services.help_format import DefaultsHelpFormatter as HelpFormatter

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (outputs, inputs) of one layer
LAYERS = 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--rows", type=int, default=32, help="rows of x (sequences in a decode step)")
    p.add_argument("--runs", type=int, default=8, help="runs of each format")
    args = p.parse_args()
    import torch

    kernel = load_linear_kernel()
    if kernel is None:
        raise SystemExit("projection_formats: the linear kernel did not build here")
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layer = []
        for n, k in SHAPES:
            q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
            d = (torch.rand(n, k // 32) * 0.01).half().float()
            m = (-torch.rand(n, k // 32) * 0.08).half().float()
            blocks = q4_layout(q, d, m)
            layer.append((kernel.pack_weight(kernel.q4_unpack(blocks, n)), blocks, n, k))
        layers.append(layer)
    xs = {k: torch.randn(args.rows, k) for _, k in SHAPES}
    flops = 2 * args.rows * LAYERS * sum(n * k for n, k in SHAPES)

    def float32() -> None:
        for layer in layers:
            for panels, _, n, k in layer:
                kernel.packed_linear(xs[k], panels, n)

    def q4() -> None:
        for layer in layers:
            for _, blocks, n, k in layer:
                kernel.q4_linear(xs[k], blocks, n, None)

    runs: dict[str, Callable[[], None]] = {"4-bit blocks": q4, "float32 panels": float32}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for f in runs.values():
        f()
    for _ in range(args.runs):
        for name, f in runs.items():
            t = time.perf_counter()
            f()
            seconds[name].append(time.perf_counter() - t)
    print(f"# {cpu_summary()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.rows} rows, {LAYERS} layers' projections, {args.runs} runs interleaved")
    print("| format | best ms | GFLOP/s | median ms |")
    print("|---|---:|---:|---:|")
    for name, ts in seconds.items():
        best, median = min(ts), statistics.median(ts)
        print(f"| {name} | {best * 1e3:.1f} | {flops / best / 1e9:.1f} | {median * 1e3:.1f} |")


if __name__ == "__main__":
    main()
