"""Run another benchmark script with the native float32 kernel built with extra -D settings.

The kernel's compile-time settings (layers/csrc/f32_tiles.h: TM_DECODE_ROWS, TM_ROW_TILE
/ TM_BLOCK_TILE, TM_UNIT_TILE / TM_FUSED_ROW_TILE, TM_WIDE_FUSED_ROWS, TM_CHUNK, TM_PANEL,
TM_PREFETCH_NEXT, TM_STREAM_AHEAD, TM_SPREAD, TM_PACK_ROWS, TM_SLICE_ROWS,
TM_SPLIT_PANELS, TM_EVEN_SHARES, TM_EVEN_TILES, TM_STEAL, TM_UNROLL) select other builds;
each build compiles once into its own cache directory. Run two settings in turn to A/B them
inside the engine:

    python benchmarks/with_kernel_build.py "TM_DECODE_ROWS=0" \\
        benchmarks/bench_decode_split.py --batch 8 --rounds 2
    python benchmarks/with_kernel_build.py "" benchmarks/bench_decode_split.py --batch 8

The settings also reach the processes the script starts (TOKENMILL_KERNEL_DEFINES, read
by layers/native_linear.py), so a compare's `tokenmill-serve` peer runs the same build:

    python benchmarks/with_kernel_build.py "TM_STEAL=0" .venv/bin/tokenmill bench compare \\
        --configs native:cpu_blas=native --peers tokenmill-serve --concurrency 8 ...
"""

from __future__ import annotations

import os
import runpy
import sys

from tokenmill.layers import native_linear


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    defines, script = sys.argv[1], sys.argv[2]
    native_linear.FLAGS = (*native_linear.FLAGS, *(f"-D{d}" for d in defines.split()))
    # Processes the script starts (a `tokenmill serve` peer) build the same kernel.
    os.environ["TOKENMILL_KERNEL_DEFINES"] = " ".join(
        [os.environ.get("TOKENMILL_KERNEL_DEFINES", ""), defines]).strip()
    sys.argv = [script, *sys.argv[3:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
