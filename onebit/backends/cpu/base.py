"""What every kernel module of the cpu backend shares: the quant types the kernels decode (type
ids, SUPPORTED), the float32 table of f16 and e8m0 values (LUT), the block loops' length M, the
fastmath flags, and `cached`, the njit(cache=True) whose disk cache is keyed by the sources of
all the kernel modules (a kernel inlines code from several of them)."""

from __future__ import annotations

import os

import numpy as np
from numba import njit

from ...formats.quants import QTYPES_BY_NAME


# reassoc lets LLVM vectorise the dot products; no nnan/ninf (inputs may hold inf or nan).
FM = {"reassoc", "contract", "nsz", "arcp"}

F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4 = (QTYPES_BY_NAME[n].type_id for n in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"))
# The types decode_row decodes in plain numba; the others (MORE_TYPES) it decodes with the
# LLVM IR of the dot products (`DECODE`).
PLAIN = {F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4}
MORE_TYPES = ("Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "TQ1_0", "TQ2_0", "Q1_0", "IQ1_S", "IQ1_M", "IQ2_XXS",
              "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS")
# Types these kernels decode (every type of onebit.formats.quants); a tensor of another type would take
# the numpy reference path.
SUPPORTED = PLAIN | {QTYPES_BY_NAME[n].type_id for n in MORE_TYPES}

E8M0 = 65536  # lut[E8M0 + e]: MXFP4's shared exponent, ggml's e8m0_to_fp32_half


def make_lut() -> np.ndarray:
    """float32 values of every f16 bit pattern, then of every e8m0 byte (halved, as ggml)."""
    f16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    e = np.arange(256, dtype=np.uint32)
    e8m0 = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32).view(np.float32)
    return np.concatenate([f16, e8m0])


LUT = make_lut()
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
# Every kernel takes the block loops' length `m` (always M = 32) from its caller at run time:
# LLVM fully unrolls a loop of a constant 32 trips and then leaves it scalar; with a run-time
# count it vectorises it (measured: Q8_0 mat-vec 2x faster).
M = 32



# -- the disk cache's key --------------------------------------------------------------------
# numba keys a kernel's disk cache by the time and size of the kernel's own source file; a kernel
# here inlines code from several modules (the IR dots, the row loops, the views), and an edit to
# any of them must compile it again: every kernel's key is that of all the kernel modules.


def _source_stamp() -> tuple[float, int]:
    """(newest modification time, total size) of the package's kernel modules: all but the
    backend class's (backend.py), the thread policy's (threads.py), the compile target's
    (target.py: numba keys its cache by the target itself) and the package's __init__."""
    here = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(here, f) for f in sorted(os.listdir(here))
             if f.endswith(".py") and f not in ("__init__.py", "backend.py", "threads.py", "target.py")]
    stats = [os.stat(f) for f in files]
    return max(s.st_mtime for s in stats), sum(s.st_size for s in stats)


SOURCE_STAMP = _source_stamp()


def cached(**options):
    """njit(cache=True, **options), cached on disk under SOURCE_STAMP."""

    def wrap(f):
        kernel = njit(cache=True, **options)(f)
        try:
            kernel._cache._cache_file._source_stamp = SOURCE_STAMP
        except AttributeError:  # (a numba without this layout: keyed by the kernel's own file)
            pass
        return kernel

    return wrap
