"""The cpu backend: the numpy backend's schedule with its ops in numba kernels that read quantized
blocks straight from the file map (or a streaming pool's slot).

Products (`matmul`, `matmul3`, `expert_ffn`) run each weight type's own row loop (rows.py), which
dots each weight row with up to eight activation rows at once (a prompt's rows meet a tile of
weight rows at a time) through DOT1 / .. / DOT8 (float_dots.py) or IDOT1 / .. / IDOT8 (int_dots.py):
LLVM vector IR (numba intrinsics) that decodes a block 32 weights at a time in registers
(ir_blocks.py) and multiplies them into one 32-wide accumulator per activation row. No float32
copy of a weight matrix is ever made and a row's bytes are read once per eight activation rows.
Activations are float32, or int16 per block of 32 for INT_TYPES, never 8-bit: results differ
from the numpy twins (`quants.QTYPES[..].dequantize` then matmul) by float32 rounding of the
decode, the summation order and, for INT_TYPES, the activations' 1/32767 rounding. Every type of
onebit.formats.quants has its decoder here; the codebook (IQ) types read their grids from int8 tables in
the kernel's module. `decode_row` (decode.py: plain numba, and the IR decoders for MORE_TYPES)
serves get_rows. On AVX-512 VNNI, matrices and experts of X16_TYPES are held sixteen rows side
by side (x16.py: the layouts and their dots; repack.py: the repacks).

Threads split output rows, or whole experts (`prange`); each output element is written by one
thread in a fixed order, so results do not depend on the thread count or on where the bytes
live (file map or a streaming pool's slot). A decode token runs about 3 parallel regions per
layer (q/k/v, attention output, experts); smaller products and the small ops (small_ops.py) run
serially; how idle workers wait is threads.py's. Compiled once per machine and cached on disk. A
backend takes `kernels_for(file)` (kernel_sets.py): the products compiled for the file's quant
types only (`Kernels`; the all-types kernels of products.py when only they are cached), whose
`warm_up` loads every signature a forward uses when the backend opens. Every kernel releases the
interpreter lock while it runs (nogil): an expert pool's reader threads issue their next reads
while a kernel computes (held, the drive sat idle for the length of each kernel call).

Modules, lowest first: base (types, LUT, the disk cache's key), views, ir_blocks, decode,
float_dots, int_dots, x16, repack, rows, products, small_ops, kernel_sets; kernels (what the
backend calls, imported when a backend opens: numba is not loaded before); threads; target (the
instruction sets the kernels are compiled for, which every choice of code path follows: the
host's, or one named, such as AVX2 without AVX-512); backend (CpuBackend, X16Experts).
"""

from .backend import CpuBackend, X16Experts

__all__ = ["CpuBackend", "X16Experts"]
