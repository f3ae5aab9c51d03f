"""Run by tests/test_cpu_target.py in a process of its own, whose environment names a compile target
(NUMBA_CPU_NAME, NUMBA_CPU_FEATURES, a fresh NUMBA_CACHE_DIR): compiles the cpu kernels of some
quant types for it, checks their outputs against the numpy reference, and prints JSON: the target
the kernels say they were compiled for, each kernel's AVX-512 instructions (`avx512_in_asm` of
numba's assembly; none on an AVX2 target), and each check's error.

    python tests/cpu_target_check.py           # the test suite's subset (a model's types, a few more)
    python tests/cpu_target_check.py --all     # every quant type the kernels decode (minutes)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MODEL = HERE / "fixtures" / "q3moe256-Q4_K_M.gguf"  # Q4_K, Q6_K, F32; routed experts
# More types through the dense products: the signed integer path (Q8_0), the int16 paths with
# an offset per block (Q4_1) and per sub-block (Q5_K; without VNNI both fold their pair sums,
# int_dots.FOLD), the float path of a table-decoded type (MXFP4, on VNNI an integer type) and
# of a codebook type (IQ2_XXS)
MORE = ("Q8_0", "Q4_1", "Q5_K", "MXFP4", "IQ2_XXS")

# -- AVX-512 in AT&T assembly -----------------------------------------------------------------
# What only an EVEX encoding (AVX-512) can say: a zmm register, xmm/ymm 16-31, a mask register
# (k0-k7, as an operand or a {%k} write mask), zeroing {z}, an embedded broadcast {1toN}; and the
# instructions that have no VEX form (the mask ops, the 8/16/32/64-element moves and
# blends, the 64-bit integer ops, ternary logic, two-table permutes, down-converting moves,
# compress/expand, the unsigned and 64-bit integer conversions, VNNI dot products ...).
EVEX_OPERAND = re.compile(r"%zmm\d+|%[xy]mm(?:1[6-9]|2\d|3[01])\b|%k[0-7]\b|\{z\}|\{1to\d+\}")
EVEX_MNEMONIC = re.compile(
    r"k(?:mov|and|andn|or|xor|xnor|not|shiftl|shiftr|ortest|test|unpck|add)[bwdq]{1,2}"
    r"|vpternlog[dq]|vperm[it]2(?:b|w|d|q|ps|pd)|vperm[bw]"
    r"|vpmov(?:[us]?(?:qb|qw|qd|db|dw|wb)|[bwdq]2m|m2[bwdq])"
    r"|vp?compress\w+|vp?expand\w+"
    r"|v(?:extract|insert)[fi](?:32x4|64x2|32x8|64x4)|vbroadcast[fi](?:32x[248]|64x[24])|vshuf[fi](?:32x4|64x2)"
    r"|vmovdq[au](?:8|16|32|64)|vpcmpu?[bwdq]|vptestn?m[bwdq]|vp?blendm\w+"
    r"|vp(?:abs|maxs|maxu|mins|minu|mull|sra)q|vps(?:ra|ll|rl)vw|vpro[lr]v?[dq]"
    r"|vrndscale\w+|vscalef\w+|vgetexp\w+|vgetmant\w+|vfixupimm\w+|vrange\w+|vreduce\w+|vrcp14\w+"
    r"|vrsqrt14\w+|vcvtt?\w*2u\w+|vcvtu\w+|vcvtt?p[sd]2qq|vcvtqq2\w+|valign[dq]|vdbpsadbw|vpconflict[dq]"
    r"|vplzcnt[dq]|vfpclass\w+|vpopcnt[bwdq]|vpsh[lr]dv?[wdq]|vpdpbusds?|vpdpwssds?|vpmadd52\w+"
    r"|vpmultishiftqb|vpshufbitqmb|vgf2p8\w+")


def avx512_in_asm(asm: str) -> list[str]:
    """The instruction lines of `asm` (AT&T syntax, as numba's inspect_asm gives) that only
    AVX-512 has, stripped."""
    found = []
    for line in asm.splitlines():
        text = line.split("#")[0].strip()
        if not text or text.startswith(".") or text.endswith(":"):
            continue
        mnemonic = text.split()[0]
        if EVEX_MNEMONIC.fullmatch(mnemonic) or EVEX_OPERAND.search(text):
            found.append(text)
    return found


# -- the checks -------------------------------------------------------------------------------


def _close(got, want) -> float:
    """Largest |got - want| as a fraction of the largest |want|."""
    return float(np.abs(got - want).max() / np.abs(want).max())


def main(every: bool) -> dict:
    sys.path.insert(0, str(HERE.parent))
    import onebit
    from onebit.backends.cpu import int_dots, target
    from onebit.backends.cpu.base import SUPPORTED
    from onebit.backends.cpu.kernel_sets import Kernels, kernels_for
    from onebit.formats.gguf_file import GGUFFile
    from onebit.backends.vulkan.reference import random_blocks
    from onebit.formats.quants import QTYPES, QTYPES_BY_NAME

    report = {"target": target.describe(), "vnni": int_dots.VNNI, "errors": {}, "kernels": []}
    # the model's kernels compiled here, not by the backend's worker processes: numba shows the
    # assembly only of code it compiled in this process (not of code loaded from its disk cache)
    gguf = GGUFFile(MODEL)
    own = kernels_for(gguf, repack=False)
    own.warm_up()
    ref, cpu = onebit.load(MODEL, backend="numpy"), onebit.load(MODEL, backend="cpu")
    assert cpu.be.K.names == own.names and cpu.be.K.matmul is own.matmul  # (the same dispatchers)
    ids = np.load(MODEL.with_suffix(".ref.npz"))["tokens"][:12].astype(np.int64)
    report["errors"]["model logits"] = _close(cpu.logits(ids), ref.logits(ids))
    kernel_sets = [cpu.be.K]
    names = sorted(QTYPES[t].name for t in SUPPORTED) if every else MORE
    more = Kernels(names, ("dense", "fused", "small", "experts", "experts_oai") if every else ("dense",))
    more.warm_up()
    kernel_sets.append(more)
    rng = np.random.default_rng(20261207)
    for name in names:
        qt = QTYPES_BY_NAME[name]
        k = max(qt.block_size, 32) * 3
        w = random_blocks(name, (37, k), rng)
        w.flags.writeable = False
        wf = qt.dequantize(w)
        for rows in (1, 9):  # mat-vec; a group of 8 rows and one alone
            x = rng.standard_normal((rows, k)).astype(np.float32)
            out = np.full((rows, 37), np.nan, np.float32)
            more.matmul(out, x, w, qt.type_id)
            report["errors"][f"{name} matmul {rows}"] = _close(out, x @ wf.T)
        if every:
            got = np.full((2, k), np.nan, np.float32)
            more.get_rows(got, w, np.array([3, 30], np.int64), qt.type_id, more.LUT, more.M)
            report["errors"][f"{name} get_rows"] = _close(got, wf[[3, 30]])
    report["int_types"] = list(int_dots.INT_TYPES)
    # without VNNI, quantize_acts' second copy of each row: every block of 32 in EO order (the
    # values at even offsets, then at odd ones), which Q4_K's row dot reads (int_dots.EO_TYPES)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    q = int_dots.quantize_acts(x)[0]
    blocks = q[:, :96].reshape(3, 3, 32)
    report["eo_copy"] = bool(np.array_equal(q[:, 96:192], np.concatenate(
        [blocks[:, :, 0::2], blocks[:, :, 1::2]], axis=2).reshape(3, 96)))
    for ks in kernel_sets:
        for kernel in ks.kernels():
            for sig, asm in kernel.inspect_asm().items():
                report["kernels"].append({"name": kernel.py_func.__qualname__, "sig": str(sig), "chars": len(asm),
                                          "avx512": avx512_in_asm(asm)[:5]})
    return report


if __name__ == "__main__":
    print(json.dumps(main("--all" in sys.argv[1:])))
