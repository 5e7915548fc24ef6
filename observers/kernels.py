"""Optional native kernels (the loader every ``csrc/<name>.c`` goes through) and the first of
them: per-group min and max of fp32 CPU data in one read.

Why the min-max kernel: a min-max observer reduces each group to ``(min, max)``. Eager torch does that as two
passes (``amin``, then ``amax``; ``torch.aminmax`` over a short last dim is not vectorized and
is several times slower still), so on CPU a group-128 min-max observe costs about three reads
of the weight. ``csrc/group_min_max.c`` reads it once (AVX-512 or AVX2, chosen at run time).

How (every kernel): on first use the C file is compiled with the system C compiler (``$CC``, else ``cc``,
``gcc`` or ``clang``; plain C, no torch headers, well under a second) into a cache folder
(``$OBSERVERS_CACHE_DIR``, else ``~/.cache/observer-lab``, else a folder of the temp folder that
this user owns and nobody else can write), keyed by a hash of the source and the compiler, then
loaded with ``ctypes`` (which releases the GIL during the call). It is built with OpenMP; torch
has already loaded ``libgomp.so.1``, so the kernel splits the runs over
``torch.get_num_threads()`` of torch's own threads rather than starting a second pool that would
compete with them.

Everything else stays eager torch, and so does this reduction whenever the kernel cannot help:
no compiler, a build failure, a CPU without AVX2, ``OBSERVERS_NATIVE=0`` (``avx2``: at most the
AVX2 variants), CUDA tensors, other
dtypes, non-contiguous views (e.g. per-input-channel or 2-D block layouts), runs shorter than
``MIN_RUN`` or tensors smaller than ``MIN_ELEMENTS``. ``status()`` says which path is in use and
why. Both paths give the same numbers (the min and max are selections, not sums).

Other kernels (``observers.hist_kernel``, ``observers.mse_kernel``, ``observers.float_grid_kernel``,
``observers.metrics_kernel``) ask ``in_use(name)`` whether to run, call ``function(name, isa,
argtypes)``, keep an eager path that gives the same numbers, and are bypassed inside
``disabled()`` like this one. Every source is compiled with
``-ffp-contract=off``, so a multiply-add rounds twice unless the C asks for ``fma``: the
kernels can then round exactly as the eager torch path does.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "group_min_max.c"
MIN_ELEMENTS = 1 << 16
"""Below this many elements the eager passes are as quick (start-up costs dominate both)."""
MIN_RUN = 16
"""Shortest contiguous run (group) the kernel takes; shorter runs (per-feature activation
statistics, run length 1) stay eager, where the reduction is vectorized across runs."""
MAX_RUN = 16384
"""Longer runs (a per-tensor observation is one run) are cut into sub-runs of at most this
length, so every thread gets work; the few sub-run results are then reduced eagerly."""
ELEMENTS_PER_THREAD = 1 << 16
"""Work worth one more thread in a kernel call (256 KiB of fp32; see ``threads_for``)."""
_FLAGS = ("-O2", "-std=c99", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=off")
ISA_NAMES = {2: "avx512", 1: "avx2"}
"""The SIMD variants every kernel source provides, by the level its ``simd_level()`` returns."""

_lock = threading.Lock()
_state: dict[str, object] = {}


def _compiler() -> str | None:
    named = os.environ.get("CC")
    if named:
        return shutil.which(named)
    return next((path for path in map(shutil.which, ("cc", "gcc", "clang")) if path), None)


def _usable(folder: Path, shared_parent: bool) -> bool:
    """Writable, and for folders under a shared parent (the temp folder) created and owned by
    this user with no write access for others: a library loaded from there runs as our code."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = folder.stat()
    except OSError:
        return False
    if shared_parent and hasattr(os, "getuid") and (info.st_uid != os.getuid() or info.st_mode & 0o022):
        return False
    return os.access(folder, os.W_OK)


def _cache_dir() -> Path:
    """``$OBSERVERS_CACHE_DIR``, else ``~/.cache/observer-lab``, else a private temp folder."""
    named = os.environ.get("OBSERVERS_CACHE_DIR")
    home = os.path.expanduser("~")
    candidates = [
        (Path(named) if named else None, False),
        (None if home == "~" else Path(home) / ".cache" / "observer-lab", False),
        (Path(tempfile.gettempdir()) / f"observer-lab-{os.environ.get('USER', 'user')}", True),
    ]
    for folder, shared_parent in candidates:
        if folder is not None and _usable(folder, shared_parent):
            return folder
    raise OSError("no writable cache folder for the native kernel (set OBSERVERS_CACHE_DIR)")


def _build(compiler: str, name: str) -> Path:
    """Compile ``csrc/<name>.c`` (with the headers of ``csrc/``, which kernels include) once
    per (source, compiler); concurrent builders each write a private temporary file and rename
    it into place, so a reader never sees a half-written library."""
    source_path = CSRC / f"{name}.c"
    source = source_path.read_bytes() + b"".join(header.read_bytes() for header in sorted(CSRC.glob("*.h")))
    build = " ".join([compiler, *_FLAGS, sys.platform, platform.machine()])
    key = hashlib.sha256(source + build.encode()).hexdigest()
    library = _cache_dir() / f"{name}-{key[:16]}.so"
    if library.exists():
        return library
    handle, partial = tempfile.mkstemp(dir=library.parent, suffix=".so.partial")
    os.close(handle)
    try:
        done = subprocess.run(
            [compiler, *_FLAGS, str(source_path), "-o", partial], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise OSError(f"{Path(compiler).name} failed: {done.stderr.strip()[-300:]}")
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return library


NATIVE_CHOICES = {"0": "eager", "1": "the best variant this CPU runs", "avx2": "at most the AVX2 variants"}
"""What ``$OBSERVERS_NATIVE`` may say. ``avx2`` runs an AVX-512 machine as a machine without
AVX-512 would (benchmarks of the AVX2 variants; tests run every variant anyway)."""


def _load(name: str) -> tuple[ctypes.CDLL | None, int, str]:
    """(library, SIMD level, status line) of ``csrc/<name>.c``, built if needed."""
    choice = os.environ.get("OBSERVERS_NATIVE", "1")
    if choice not in NATIVE_CHOICES:
        allowed = ", ".join(f"{key} ({meaning})" for key, meaning in NATIVE_CHOICES.items())
        raise ValueError(f"OBSERVERS_NATIVE must be one of {allowed}; got {choice!r}")
    if choice == "0":
        return None, 0, "eager: native kernel disabled by OBSERVERS_NATIVE=0"
    compiler = _compiler()
    if compiler is None:
        return None, 0, f"eager: no C compiler found (set CC to build the native {name} kernel)"
    try:
        path = _build(compiler, name)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as error:
        return None, 0, f"eager: native kernel unavailable ({error})"
    level = int(library.simd_level())
    if level == 0:
        return None, 0, "eager: this CPU has no AVX2 with FMA, which the native kernels need"
    if choice == "avx2" and level > 1:
        return library, 1, f"native (avx2 by OBSERVERS_NATIVE=avx2, {path.name})"
    return library, level, f"native ({ISA_NAMES[level]}, {path.name})"


def native(name: str) -> tuple[ctypes.CDLL | None, int, str]:
    """The loaded kernel library ``csrc/<name>.c`` as (library or None, SIMD level, status
    line), built and loaded on first call and remembered; (None, 0, why) when the eager path
    must be used. Callers declare their functions' ``argtypes`` on the library."""
    with _lock:
        loaded = _state.setdefault("loaded", {})
        if name not in loaded:
            loaded[name] = _load(name)
        return loaded[name]


def in_use(name: str) -> tuple[ctypes.CDLL, str] | None:
    """(library, best ISA name) when kernel ``name`` should run now, else None (not built,
    unsupported CPU, or inside ``disabled()``)."""
    if _state.get("disabled"):
        return None
    library, level, _ = native(name)
    return None if library is None else (library, ISA_NAMES[level])


def available_isas(name: str = "group_min_max") -> list[str]:
    """The variants of kernel ``name`` this CPU runs, best first (empty when it is not built)."""
    level = native(name)[1]
    return [isa for lvl, isa in ISA_NAMES.items() if lvl <= level]


def function(name: str, isa: str | None, argtypes: list, restype: type | None = None) -> ctypes._CFuncPtr:
    """Kernel ``name``'s entry point ``<name>_<isa>`` (``isa`` None: the best this CPU runs), its
    argument types declared on first use. Raises ``RuntimeError`` when the kernel is not built
    here (``status(name)`` says why) and ``ValueError`` for a variant this CPU does not run.
    Callers that may fall back to eager ask ``in_use(name)`` first; this one ignores ``disabled()``
    so tests can compare the variants."""
    library, level, line = native(name)
    if library is None:
        raise RuntimeError(f"the native {name} kernel is not in use: {line}")
    isa = isa or ISA_NAMES[level]
    runnable = [variant for lvl, variant in ISA_NAMES.items() if lvl <= level]
    if isa not in runnable:
        raise ValueError(f"kernel variant {isa!r} does not run here; available: {runnable}")
    entry = getattr(library, f"{name}_{isa}")  # ctypes keeps one object per name, so this sticks
    if entry.argtypes is None:
        entry.argtypes = argtypes
        if restype is not None:
            entry.restype = restype
    return entry


_MIN_MAX_ARGUMENTS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]


def reset() -> None:
    """Forget the loaded kernel so the next call re-reads the environment (tests, after
    changing ``OBSERVERS_NATIVE`` or ``CC``)."""
    with _lock:
        _state.pop("loaded", None)


@contextmanager
def disabled() -> Iterator[None]:
    """Within this block every native kernel is bypassed: the eager paths run (for side-by-side timings
    and checks; process-wide, so not for use while other threads observe)."""
    with _lock:
        previous = _state.get("disabled", False)
        _state["disabled"] = True
    try:
        yield
    finally:
        with _lock:
            _state["disabled"] = previous


def status(name: str = "group_min_max") -> str:
    """Which path kernel ``name`` takes on CPU fp32 data: ``native (avx512, ...)`` or ``eager: <why>``."""
    return native(name)[2]


@functools.lru_cache(maxsize=256)
def _sub_run(run: int) -> int | None:
    """The run length the kernel uses for groups of ``run`` elements: ``run`` itself, or for long
    runs the largest divisor of ``run`` in [1024, MAX_RUN] (None when there is none)."""
    if run <= MAX_RUN:
        return run
    return next((size for size in range(MAX_RUN, 1023, -1) if run % size == 0), None)


def threads_for(elements: int) -> int:
    """Threads a kernel call over ``elements`` values uses: one per ``ELEMENTS_PER_THREAD``, at
    most ``torch.get_num_threads()``. A small tensor stays on the calling thread: waking a
    sleeping worker (or waiting for a core another process holds) costs more than it saves."""
    return max(1, min(torch.get_num_threads(), elements // ELEMENTS_PER_THREAD))


def _launch(isa: str | None, data: torch.Tensor, run: int, low: torch.Tensor, high: torch.Tensor) -> None:
    """Run the min-max kernel over contiguous ``data`` read as ``low.numel()`` runs of ``run``
    values, writing into the contiguous fp32 ``low`` and ``high``."""
    rows = low.numel()
    threads = max(1, min(threads_for(rows * run), rows))
    entry = function("group_min_max", isa, _MIN_MAX_ARGUMENTS)
    entry(data.data_ptr(), run, rows, threads, low.data_ptr(), high.data_ptr())


def run_min_max(runs: torch.Tensor, isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of each row of a contiguous fp32 CPU ``(rows, run)`` tensor, in one read.

    Rows holding NaN or Inf give NaN in both outputs. ``isa`` picks a kernel variant (tests
    compare them); by default the best this CPU runs. Raises ``RuntimeError`` when the kernel
    is not in use (see ``status()``).
    """
    function("group_min_max", isa, _MIN_MAX_ARGUMENTS)  # not built here, or a variant this CPU lacks: say so
    if runs.ndim != 2 or runs.dtype != torch.float32 or runs.device.type != "cpu" or not runs.is_contiguous():
        raise ValueError(
            f"run_min_max takes a contiguous float32 CPU (rows, run) tensor, got {runs.dtype} "
            f"{tuple(runs.shape)} on {runs.device} (contiguous: {runs.is_contiguous()})"
        )
    rows, run = runs.shape
    if rows == 0 or run == 0:
        raise ValueError(f"run_min_max needs at least one element per row, got shape {(rows, run)}")
    low, high = torch.empty(rows), torch.empty(rows)
    _launch(isa, runs, run, low, high)
    return low, high


def group_min_max(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Min and max of ``data`` over dims ``(0, -1)`` (the layout ``granularity.flatten`` makes)
    with the native kernel, or None when the eager path should do it (see the module docstring).

    Groups holding NaN or Inf come out NaN, so ``all_finite`` on the result still detects them.
    """
    if data.device.type != "cpu" or data.dtype != torch.float32 or data.ndim < 2:
        return None
    run = data.shape[-1]
    if run < MIN_RUN or data.numel() < MIN_ELEMENTS or not data.is_contiguous():
        return None
    sub_run = _sub_run(run)
    if sub_run is None or in_use("group_min_max") is None:
        return None
    if data.shape[0] == 1 and sub_run == run:
        low, high = torch.empty(data.shape[1:-1]), torch.empty(data.shape[1:-1])
        _launch(None, data, run, low, high)
        return low, high
    split = (*data.shape[:-1], run // sub_run)
    low, high = torch.empty(split), torch.empty(split)
    _launch(None, data, sub_run, low, high)
    return low.amin(dim=(0, -1)), high.amax(dim=(0, -1))
