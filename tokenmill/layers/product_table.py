"""Which float32 product path `--cpu-blas auto` takes on this machine, measured here.

Hosts differ: oneDNN's packed products win on one CPU (AVX-512) and lose single-row
decode to OpenBLAS on another (an AVX2 host measured 1.48x faster with NumPy). So
`auto` does not assume: it reads the choice measured on this CPU (model and ISA
flags), torch version and thread count from the cache, written by `tokenmill tune`
(the model's own layer shapes, row classes up to prefill) or, when nothing was
measured yet, by a start-up probe of a couple of seconds: a decoder-sized set of
weights, larger than the last-level cache, multiplied at 1, 8, 32 and 128 rows by
each candidate. The choice is the candidate with the smallest geometric-mean
slowdown against the fastest at each row class; every engine on the host then takes
it (one weight form per engine: the candidates keep their weights differently).

The native kernel's decode tiles are measured the same way, once per host, thread
count and kernel build: whether its 4 x 6 tiles or its wide tile read a decode step's
8 rows faster (`native_decode_rows`; hosts disagree).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.layers import cpu_blas, native_linear
from tokenmill.layers.row_slices import last_level_cache_bytes
from tokenmill.layers.timing import CACHE, cpu_signature, host_available_memory

logger = logging.getLogger(__name__)

CANDIDATES = ("onednn", "numpy", "native", "torch")
PROBE_ROWS = (1, 8, 32, 128)
# The probe's weights: a Qwen2.5-0.5B-like MLP's three matrices, ~52 MB in float32
# (over a 32 MB L3, so one-row products stream from memory as a model's do).
PROBE_SHAPES = ((4864, 896), (4864, 896), (896, 4864))
# Candidates whose library runs its own thread pool, and how long to let its threads
# settle after its passes: NumPy's OpenBLAS workers spin on the cores for a while after
# each call (2^28 cycles by default), so whatever was timed next ran on one core. On a
# Zen 5 host the probe timed the native kernel at 128 rows at 2.0x its real cost right
# after OpenBLAS's passes (15.5 ms against 7.6 alone) and chose oneDNN over it; 0.1 s of
# rest measured clean there (docs/BENCHMARKS.md).
SPINNING = frozenset({"numpy"})
SETTLE_S = 0.2


def host_key(threads: int) -> str:
    text = f"{cpu_signature()}|{torch.__version__}|{threads}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def table_path(threads: int) -> Path:
    return CACHE / "products" / f"{host_key(threads)}-{threads}t.json"


def choose(seconds: dict[str, dict[int, float]]) -> str:
    """The candidate with the smallest geometric-mean slowdown over the row classes."""
    rows = next(iter(seconds.values())).keys()
    best = {r: min(times[r] for times in seconds.values()) for r in rows}
    return min(seconds, key=lambda c: sum(math.log(seconds[c][r] / best[r]) for r in rows))


def available_candidates() -> list[str]:
    missing = {"onednn": not cpu_blas.onednn_available(),
               "native": not native_linear.available()}
    return [c for c in CANDIDATES if not missing.get(c, False)]


def product_function(candidate: str, weight: torch.Tensor) -> Callable[[torch.Tensor], object]:
    """x -> x @ weight.T the way `candidate` does it, its weight form prepared once."""
    if candidate == "onednn":
        packed = cpu_blas.onednn_weight(weight, transposed=False)
        return lambda x: cpu_blas.onednn_linear(x, packed)
    if candidate == "native":
        blocks = native_linear.pack(weight)
        return lambda x: native_linear.linear(x, blocks, None, weight.shape[0])
    wide = weight.shape[0] > weight.shape[1]  # the layout the policies keep wide layers in
    stored = weight.t().contiguous() if wide else weight
    if candidate == "numpy":
        blas = cpu_blas.numpy_weight(stored, wide)
        return lambda x: cpu_blas.matmul(x, blas)
    return (lambda x: x @ stored) if wide else (lambda x: F.linear(x, stored))


@contextlib.contextmanager
def candidate_threads(threads: int) -> Iterator[None]:
    """Every candidate's library on `threads` for the whole measurement: switching
    torch's pool between passes makes oneDNN rebuild its kernels (they are cached per
    thread count), which once cost it 2.6x at one row in a first version of this."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    cpu_blas.set_blas_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cold_copies(pass_bytes: int, most: int, forms: int = 4) -> int:
    """Copies of a pass's weights (`pass_bytes` each) to cycle through so that a pass
    reads them from memory, as a model's decode step does, not from the last-level
    cache: twice its size in all, at most `most` copies (a model's layer count), and
    `forms` weight forms of every copy within half the memory available."""
    wanted = math.ceil(2 * last_level_cache_bytes() / max(pass_bytes, 1))
    room = host_available_memory() // 2 // max(forms * pass_bytes, 1)
    return max(1, min(most, wanted, room))


@torch.inference_mode()
def measure(shapes: list[tuple[int, int]], rows: tuple[int, ...], threads: int,
            repeats: int = 5, candidates: list[str] | None = None,
            progress: Callable[[str], None] | None = None,
            copies: int = 1) -> dict[str, dict[int, float]]:
    """Seconds for one pass of products over `shapes` ([out, in] weights) at each row
    count, per candidate: the fastest of `repeats` consecutive passes after a warm-up
    (consecutive: a library's threads spin a while after its call, which would slow
    the next library's pass; after a SPINNING library's passes the next timing waits
    for its threads to settle), the candidates taking turns per row count. With
    `copies`, each pass goes through that many copies of the weights (cold_copies),
    and its time is divided by them."""
    generator = torch.Generator().manual_seed(0)
    first = [torch.randn(out, inp, generator=generator) * 0.02 for out, inp in shapes]
    weights = [w if i == 0 else w.clone() for i in range(copies) for w in first]
    candidates = candidates or available_candidates()
    functions = {c: [product_function(c, w) for w in weights] for c in candidates}
    inputs = {n: [torch.randn(n, w.shape[1], generator=generator) for w in first] * copies
              for n in rows}

    def timed(candidate: str, n: int) -> float:
        with candidate_threads(threads):
            one_pass(functions[candidate], inputs[n])  # warm-up
            best = min(one_pass(functions[candidate], inputs[n]) for _ in range(repeats))
        if candidate in SPINNING:
            time.sleep(SETTLE_S)  # its pool's threads stop spinning before the next timing
        return best / copies

    out: dict[str, dict[int, float]] = {c: {} for c in candidates}
    for n in rows:
        for candidate in candidates:
            out[candidate][n] = timed(candidate, n)
        if progress is not None:
            progress(f"{n} rows: " + ", ".join(f"{c} {out[c][n] * 1e3:.2f} ms"
                                               for c in candidates))
    for candidate, n in implausible(out):
        # Fewer rows slower than more: another process's burst hit every pass (a
        # capped probe once timed the native kernel's 8 rows at 2.4x its 32 and
        # chose NumPy on it). Measured again, the faster kept.
        out[candidate][n] = min(out[candidate][n], timed(candidate, n), timed(candidate, n))
    return out


def implausible(seconds: dict[str, dict[int, float]]) -> list[tuple[str, int]]:
    """(candidate, rows) cells slower than the same candidate at the next larger row
    count: a product of fewer rows does no more work, so such a cell is noise."""
    cells = []
    for candidate, times in seconds.items():
        counts = sorted(times)
        cells += [(candidate, n) for n, larger in itertools.pairwise(counts)
                  if times[n] > times[larger]]
    return cells


def one_pass(functions: list[Callable[[torch.Tensor], object]],
             xs: list[torch.Tensor]) -> float:
    started = time.perf_counter()
    for function, x in zip(functions, xs, strict=True):
        function(x)
    return time.perf_counter() - started


def write_json(path: Path, entry: dict) -> None:
    """Store a measurement atomically (ranks read it too)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(entry, indent=1))
    temporary.replace(path)


def read_json(path: Path) -> dict | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) else None


def measured_once(path: Path, current: Callable[[], dict | None],
                  measure_and_store: Callable[[], dict]) -> dict:
    """The stored entry `current` accepts, or one measured and stored under a file lock
    (worker processes starting together measure once)."""
    entry = current()
    if entry is not None:
        return entry
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entry = current()  # another process may have measured meanwhile
        return entry if entry is not None else measure_and_store()


def write_table(threads: int, entry: dict) -> None:
    """Store a measurement as this host's choice."""
    write_json(table_path(threads), entry)


def read_table(threads: int) -> dict | None:
    entry = read_json(table_path(threads))
    return entry if entry is not None and entry.get("choice") in CANDIDATES else None


# The native kernel's decode tiles (4 rows x 6 blocks, f32_linear.cpp) against its wide
# tile at a decode step's rows: on one AVX-512 host they read 8 rows 1.05-1.12x faster,
# on another 1.2x slower (docs/BENCHMARKS.md), so each host measures which it takes.
DECODE_TILE_ROWS = 8


def decode_tiles_path(threads: int) -> Path:
    return CACHE / "products" / f"{host_key(threads)}-{threads}t-native-decode.json"


@torch.inference_mode()
def time_native_settings(shapes: list[tuple[int, int]], rows: int, threads: int,
                         settings: tuple[int, ...], apply: Callable[[int], None],
                         current: Callable[[], int], repeats: int,
                         copies: int = 1) -> dict[int, float]:
    """Seconds for one pass of native products over `copies` copies of `shapes` ([out,
    in] weights) at `rows` rows, per setting of the kernel (`apply(setting)` before its
    pass), the settings alternating pass by pass: the fastest of `repeats` passes each
    after a warm-up round. The kernel's setting (`current()`) is restored after."""
    generator = torch.Generator().manual_seed(0)
    weights = [native_linear.pack(torch.randn(out, inp, generator=generator) * 0.02)
               for _ in range(copies) for out, inp in shapes]
    xs = [torch.randn(rows, w.shape[1], generator=generator) for w in weights]
    functions = [functools.partial(native_linear.linear, packed=w, bias=None,
                                   out_features=w.shape[0] * native_linear.LANES)
                 for w in weights]
    seconds: dict[int, list[float]] = {setting: [] for setting in settings}
    before = current()
    try:
        with candidate_threads(threads):
            for _ in range(repeats + 1):  # the first round warms up
                for setting in settings:
                    apply(setting)
                    seconds[setting].append(one_pass(functions, xs))
    finally:
        apply(before)
    return {setting: min(times[1:]) for setting, times in seconds.items()}


def measure_decode_tiles(shapes: list[tuple[int, int]], threads: int,
                         repeats: int = 7) -> dict[int, float]:
    """Seconds for one pass of native products over `shapes` at DECODE_TILE_ROWS rows,
    with the decode tiles up to the build's limit and with none (0), the two alternating
    pass by pass; the fastest pass of each."""
    return time_native_settings(shapes, DECODE_TILE_ROWS, threads,
                                (native_linear.max_decode_rows(), 0),
                                native_linear.set_decode_rows, native_linear.decode_rows,
                                repeats)


def choose_decode_rows(seconds: dict[int, float]) -> int:
    """The build's limit unless none (0) measured more than 3% faster (ties stay)."""
    limit = max(seconds)
    return 0 if seconds.get(0, math.inf) < 0.97 * seconds[limit] else limit


def native_decode_rows(threads: int | None = None) -> int:
    """The decode-tile limit the native kernel takes on this host: stored by `tokenmill
    tune` (the model's shapes) or by a start-up probe of a few milliseconds (the
    probe's weights); TOKENMILL_AUTO_TUNE=0 keeps the build's."""
    threads = threads or torch.get_num_threads()
    limit = native_linear.max_decode_rows()
    if os.environ.get("TOKENMILL_AUTO_TUNE", "1") == "0" or limit == 0:
        return limit

    def probe() -> dict:
        seconds = measure_decode_tiles(list(PROBE_SHAPES), threads)
        entry = write_decode_tiles(threads, seconds, "probe")
        logger.info("native decode tiles: probed %s -> up to %d rows",
                    {k: round(v * 1e3, 3) for k, v in seconds.items()}, entry["decode_rows"])
        return entry

    entry = measured_once(decode_tiles_path(threads), lambda: current_decode_tiles(threads),
                          probe)
    return min(int(entry["decode_rows"]), limit)


def read_decode_tiles(threads: int) -> dict | None:
    entry = read_json(decode_tiles_path(threads))
    return entry if entry is not None and "decode_rows" in entry else None


def current_decode_tiles(threads: int) -> dict | None:
    """The stored decode-tile choice if this build of the kernel measured it (a changed
    kernel is measured again)."""
    entry = read_decode_tiles(threads)
    return entry if entry and entry.get("kernel") == native_linear.build_name() else None


def write_decode_tiles(threads: int, seconds: dict[int, float], source: str) -> dict:
    entry = {"source": source, "threads": threads, "rows": DECODE_TILE_ROWS,
             "kernel": native_linear.build_name(),
             "seconds": {str(k): v for k, v in seconds.items()},
             "decode_rows": choose_decode_rows(seconds)}
    write_json(decode_tiles_path(threads), entry)
    return entry


def static_choice() -> str:
    """The rule before any measurement: oneDNN where torch has it, else NumPy."""
    return "onednn" if cpu_blas.onednn_available() else "numpy"


def is_current(entry: dict | None) -> bool:
    """Whether a stored table still decides: its choice is available here, and it
    measured every candidate available now (one stored before a candidate existed is
    measured again)."""
    if entry is None:
        return False
    candidates = available_candidates()
    return entry["choice"] in candidates and set(candidates) <= set(entry.get("seconds", {}))


def auto_choice(threads: int | None = None) -> str:
    """This host's measured product path: the cached table, or the probe's (measured
    once, under a lock, so that worker processes starting together measure once).
    TOKENMILL_AUTO_TUNE=0 ignores measurements (the static rule): the test suite runs
    so, for the same kernels on every run whatever this host's cache holds."""
    threads = threads or torch.get_num_threads()
    if os.environ.get("TOKENMILL_AUTO_TUNE", "1") == "0":
        return static_choice()

    def current() -> dict | None:
        entry = read_table(threads)
        return entry if is_current(entry) else None

    def probe() -> dict:
        seconds = measure(list(PROBE_SHAPES), PROBE_ROWS, threads, repeats=3)
        entry = {"source": "probe", "threads": threads, "choice": choose(seconds),
                 "seconds": seconds}
        write_table(threads, entry)
        logger.info("cpu_blas auto: probed %s at %d threads -> %s (tokenmill tune "
                    "measures the model's own shapes)", list(seconds), threads,
                    entry["choice"])
        return entry

    return measured_once(table_path(threads), current, probe)["choice"]
