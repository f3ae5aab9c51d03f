"""The X16 layouts (AVX-512 VNNI): sixteen weight rows side by side per block, so one vpdpbusd
meets 4 activation bytes broadcast to every lane. The layout of each type (Q4_K, Q5_K, Q6_K,
Q2_K, Q3_K, MXFP4, Q4_0, Q5_0, Q4_1, Q5_1, IQ4_NL, IQ4_XS, Q8_0: X16_TYPES) and its 16-row dot
intrinsic (`dot16_*`), generated as LLVM IR. repack.py makes the layouts from a file's rows."""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ...formats.quants import (QTYPES_BY_NAME, X16_BLOCK as X16_BLOCK_BYTES, X16_Q5_BLOCK, X16_Q6_BLOCK, X16_ROWS,
                               iq4_values)
from .ir_blocks import FAST, FLT, HALF, I16, I32, I64, I8, _const, _load, _splat, _vec
from .int_dots import A, IQ4_PLUS128, MXFP4_PLUS12, PAIRS, _dpbusd, _pshufb

IQ4_LEVELS = [int(v) for v in iq4_values()]  # (signed bytes: -127 .. 113)


# -- Q4_K rows repacked sixteen to a group (AVX-512 VNNI) ------------------------------------
# The row kernels (rows.py) spend most of their work on each 64 weights of one row: two vpdpbusd,
# then a shift, a conversion, the scales' multiply and the float sum, per row. With 16 rows'
# weights side by side (X16: the same 4 weights of 16 rows in one 64-byte vector), each vpdpbusd
# meets 4 activation bytes broadcast to every lane, and a sub-block's integer sums stay in
# int32 until its end: per 64 products one vpdpbusd per activation plane and half a nibble
# unpack, and the conversion and scales once per 32 weights of 16 rows. Measured on the
# 2-core VM (one thread, Q4_K rows of 2048 in cache): 15.3 GB/s as rows, 39.1 repacked.
# Layout of a group (16 rows) and block (256 weights), X16_BLOCK bytes: d of the 16 rows (f16),
# then their dmin (f16), the 6-bit scales as bytes [sub-block][row], the mins likewise, then the
# quants: for each pair of sub-blocks j (weights 64 j ..), each 4 weights k (k = 0..7: 4 k ..
# 4 k + 3 of sub-block 2 j in the low nibbles, of sub-block 2 j + 1 in the high), 16 rows x 4
# bytes. A [N, K] tensor repacks into [N, K / 256 x X16_BLOCK / 16] bytes: the same rows, 2.8%
# more bytes (the scales decoded), so the row loops' chunks of 16 rows and every shape stay.
# Q5_K (the same block with 32 bytes of fifth bits: bit 2 j of byte l is weight 64 j + l's, bit 2 j
# + 1 weight 64 j + 32 + l's) in the same arrangement ("Q5_K_X16"; Q5_K_M files' matrices and
# experts): Q4_K_X16's scales, then the quants of pair j = 0 each followed by the 16 rows'
# fifth-bit bytes 4 k .. 4 k + 3 (k = 0..7), then the quants of pairs 1..3 (X16_Q5_BLOCK bytes:
# 2.3% more than the rows, the scales decoded). In the order the kernel first reads them: with
# the fifth bits after all the quants it moved 15 GB/s from memory against the rows' 27-29.
X16, X16_BLOCK = X16_ROWS, X16_BLOCK_BYTES
Q4_K_X16 = 256 + QTYPES_BY_NAME["Q4_K"].type_id  # (a type id of onebit's own, beside GGUF's)
Q5_K_X16 = 256 + QTYPES_BY_NAME["Q5_K"].type_id


def _x16_frame(context, b, sig, args, block: int):
    """What an X16 dot's code starts from (its args as `dot16_q4_k_x16` takes them): the groups'
    block count nb and first block w0 for weight row n, activation row r's byte planes lo_p,
    hi_p, its block scales xd and its sums row xm, a store of the 16 results, and spread(p, k):
    the 4 activation bytes at p + k in every lane."""
    wa = context.make_array(sig.args[0])(context, b, args[0])
    n = args[1]
    qa, da, ma = (context.make_array(t)(context, b, a) for t, a in zip(sig.args[2:5], args[2:5]))
    r = args[5]
    oa = context.make_array(sig.args[6])(context, b, args[6])
    col = args[7]
    rb = b.extract_value(wa.strides, 0)  # bytes a row
    nb = b.udiv(b.mul(rb, _const(I64, X16)), _const(I64, block))
    w0 = b.gep(wa.data, [b.mul(n, rb)])
    k_len, nblk = b.extract_value(qa.shape, 1), b.extract_value(da.shape, 1)
    xb = b.bitcast(b.gep(qa.data, [b.mul(r, k_len)]), ir.PointerType(I8))
    kk = b.mul(nblk, _const(I64, A))
    lo_p, hi_p = b.gep(xb, [b.mul(kk, _const(I64, 2))]), b.gep(xb, [b.mul(kk, _const(I64, 3))])
    xd = b.gep(da.data, [b.mul(r, nblk)])
    xm = b.gep(ma.data, [b.mul(r, b.extract_value(ma.shape, 1))])
    V16F = _vec(FLT, 16)

    def store(res):
        ob = b.gep(oa.data, [b.add(b.mul(r, b.extract_value(oa.shape, 1)), col)])
        b.store(res, b.bitcast(ob, ir.PointerType(V16F)), align=4)

    def spread(p, k):
        return b.bitcast(_splat(b, _load(b, p, k, I32), 16), _vec(I8, 64))

    return nb, w0, lo_p, hi_p, xd, xm, nblk, store, spread


def _x16_typer(codegen):
    """The typing of an X16 dot intrinsic (see `dot16_q4_k_x16`) with its code `codegen`."""
    def typer(typingctx, w, n, q, d, m, r, out, col):
        ok = (isinstance(w, types.Array) and w.ndim == 2 and w.dtype == types.uint8 and w.layout == "C"
              and isinstance(q, types.Array) and q.ndim == 2 and q.dtype == types.int16 and q.layout == "C"
              and all(isinstance(a, types.Array) and a.ndim == 2 and a.dtype == types.float32 and a.layout == "C"
                      for a in (d, m, out)))
        if not ok:
            return None
        return types.none(w, types.int64, q, d, m, types.int64, out, types.int64), codegen
    return typer


def _transpose16_codegen(context, builder, sig, args):
    b = builder
    sa, da = (context.make_array(t)(context, b, a) for t, a in ((sig.args[0], args[0]), (sig.args[3], args[3])))
    s0, stride, d0 = args[1], args[2], args[4]
    V16I = _vec(I32, 16)
    rows = [_load(b, sa.data, b.add(s0, b.mul(stride, _const(I64, r))), V16I) for r in range(X16)]
    for bit in (1, 2, 4, 8):  # swap bit `bit` of the row and column indices (row r with r + bit)
        for r in range(X16):
            if r & bit:
                continue
            lo, hi = rows[r], rows[r + bit]
            rows[r] = b.shuffle_vector(lo, hi, ir.Constant(V16I, [c if not c & bit else 16 + c - bit
                                                                    for c in range(16)]))
            rows[r + bit] = b.shuffle_vector(lo, hi, ir.Constant(V16I, [c + bit if not c & bit else 16 + c
                                                                          for c in range(16)]))
    for j in range(X16):
        p = b.gep(da.data, [b.add(d0, _const(I64, 64 * j))])
        b.store(rows[j], b.bitcast(p, ir.PointerType(V16I)), align=1)
    return context.get_dummy_value()


@intrinsic
def transpose16(typingctx, src, s0, stride, dst, d0):
    """dst[d0 + 64 j + 4 r ..] (4 bytes) = src[s0 + r stride + 4 j ..] for r, j < 16: 16 rows of 16
    words, `stride` bytes apart, into 16 lines of the rows' word j side by side (a transpose of
    16 x 16 32-bit words; src and dst flat uint8 arrays, any alignment): the X16 layouts' quants
    of one block of a group in 16 loads, 64 shuffles and 16 stores, where a word at a time takes
    256 loads and stores."""
    ok = all(isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.uint8 and a.layout == "C"
             for a in (src, dst)) and all(isinstance(a, types.Integer) for a in (s0, stride, d0))
    if not ok:
        return None
    return types.none(src, types.uint64, types.uint64, dst, types.uint64), _transpose16_codegen


def _bit4(b, v, i: int):
    """<64 x i8>: bit i of each byte of v, moved to bit 4 (0x10 or 0)."""
    V64 = _vec(I8, 64)
    if i < 4:
        v = b.shl(v, ir.Constant(V64, [4 - i] * 64))
    elif i > 4:
        v = b.lshr(v, ir.Constant(V64, [i - 4] * 64))
    return b.and_(v, ir.Constant(V64, [16] * 64))


def _q5_at(j, k):
    """Where Q5_K_X16's quant vector (pair j, 4 weights k) starts in its block (its fifth bits:
    _q5_at(0, k) + 64). Its code's and (as _q5_at_jit) its repack's."""
    return 320 + 128 * k if j == 0 else 1344 + 512 * (j - 1) + 64 * k


_q5_at_jit = njit(inline="always")(_q5_at)


def _k_x16_codegen(five: bool):
    """The dot of Q4_K_X16 weights, or (five) of Q5_K_X16: the same with each quant's fifth bit."""
    block = X16_Q5_BLOCK if five else X16_BLOCK
    return lambda context, builder, sig, args: _k_x16_code(context, builder, sig, args, block, five)


def _accumulators(b):
    """The dots' vector types (16 floats, 16 int32, 64 bytes) and their accumulators: acc and off
    (16 floats each, zeroed, on the stack) and a zero of 16 int32."""
    V16F, V16I, V64 = _vec(FLT, 16), _vec(I32, 16), _vec(I8, 64)
    acc = cgutils.alloca_once_value(b, ir.Constant(V16F, [0.0] * 16))
    off = cgutils.alloca_once_value(b, ir.Constant(V16F, [0.0] * 16))
    return V16F, V16I, V64, acc, off, ir.Constant(V16I, [0] * 16)


def _k_x16_code(context, builder, sig, args, block: int, five: bool):
    b = builder
    nb, w0, lo_p, hi_p, xd, xm, _, store, spread = _x16_frame(context, b, sig, args, block)
    V16F, V16I, V64, acc, off, zero = _accumulators(b)

    with cgutils.for_range(b, nb) as loop:
        i = loop.index
        blk = b.gep(w0, [b.mul(i, _const(I64, block))])
        d = b.fpext(_load(b, blk, 0, _vec(HALF, 16)), V16F)
        dmin = b.fpext(_load(b, blk, 32, _vec(HALF, 16)), V16F)
        first = b.mul(i, _const(I64, 256))
        for j in range(4):
            sums = [zero] * 4  # sub-block 2 j: high plane, low plane; 2 j + 1: the same
            for k in range(8):
                wv = _load(b, blk, _q5_at(j, k) if five else 320 + 64 * (8 * j + k), V64)
                lo4, hi4 = b.and_(wv, ir.Constant(V64, [15] * 64)), b.lshr(wv, ir.Constant(V64, [4] * 64))
                if five:
                    qh = _load(b, blk, _q5_at(0, k) + 64, V64)
                    lo4, hi4 = b.or_(lo4, _bit4(b, qh, 2 * j)), b.or_(hi4, _bit4(b, qh, 2 * j + 1))
                for h, q in enumerate((lo4, hi4)):
                    at = b.add(first, _const(I64, 64 * j + 32 * h + 4 * k))
                    sums[2 * h] = _dpbusd(b, sums[2 * h], q, spread(hi_p, at))
                    sums[2 * h + 1] = _dpbusd(b, sums[2 * h + 1], spread(lo_p, at), q)
            for h in range(2):
                sub = 2 * j + h
                isum = b.add(b.shl(sums[2 * h], ir.Constant(V16I, [8] * 16)), sums[2 * h + 1])
                sc = b.uitofp(_load(b, blk, 64 + 16 * sub, _vec(I8, 16)), V16F)
                mn = b.uitofp(_load(b, blk, 192 + 16 * sub, _vec(I8, 16)), V16F)
                s = b.add(b.mul(i, _const(I64, 8)), _const(I64, sub))
                dx, mx = _splat(b, _load(b, xd, s, FLT, align=4), 16), _splat(b, _load(b, xm, s, FLT, align=4), 16)
                scale = b.fmul(b.fmul(d, sc), dx)
                b.store(b.fadd(b.load(acc), b.fmul(b.sitofp(isum, V16F), scale, flags=FAST), flags=FAST), acc)
                b.store(b.fadd(b.load(off), b.fmul(b.fmul(dmin, mn), mx)), off)
    store(b.fsub(b.load(acc), b.load(off)))
    return context.get_dummy_value()


dot16_q4_k_x16 = intrinsic(_x16_typer(_k_x16_codegen(False)))
dot16_q4_k_x16.__doc__ = """out[r, col : col + 16] = rows n .. n + 15 of X16-packed Q4_K weights w (uint8
[N, row bytes], n a multiple of 16) . activation row r of (q, d, m) = quantize_acts(x)."""
dot16_q5_k_x16 = intrinsic(_x16_typer(_k_x16_codegen(True)))
dot16_q5_k_x16.__doc__ = """`dot16_q4_k_x16` for Q5_K_X16 weights."""


# Q6_K in the same arrangement ("Q6_K_X16"; first for the experts' short rows: 3 blocks a row on the
# 30B-A3B shape's down matrices, where the row kernel moved 8.5 GB/s from memory on one thread;
# then matrices too, as Q4_K_M files' output heads, attn_v and half their ffn_down).
# A group and block, X16_Q6_BLOCK = 16 x 210 bytes: d of the 16 rows (f16), the int8 scales
# [sub-block of 16][row], then for k = 0..15, 192 bytes in the order the kernel reads them (three
# vectors of 16 rows x 4 bytes; with the low and high bits apart, the kernel's three streams cost
# it half its speed from memory): the low 4 bits of the stored values u = q + 32 (0..63) of
# weights 4 k .. 4 k + 3 (low nibbles) and 4 (k + 32) .. (high); those of 4 (k + 16) .. and
# 4 (k + 48) ..; then the high 2 bits of 4 k .., 4 (k + 16) .., 4 (k + 32) .., 4 (k + 48) .. in
# bits 0-1, 2-3, 4-5, 6-7. The same bytes as the rows, so every shape stays.
Q6_K_X16 = 256 + QTYPES_BY_NAME["Q6_K"].type_id
Q6_Q = 32 + 256  # where the quants start


def _x16_q6_codegen(context, builder, sig, args):
    b = builder
    nb, w0, lo_p, hi_p, xd, xm, nblk, store, spread = _x16_frame(context, b, sig, args, X16_Q6_BLOCK)
    xs = b.gep(xm, [nblk])  # each 16 values' sum
    V16F, V16I, V64, acc, off, zero = _accumulators(b)
    nib, two = ir.Constant(V64, [15] * 64), ir.Constant(V64, [3] * 64)

    def shr(v, k):
        return b.lshr(v, ir.Constant(V64, [k] * 64)) if k else v

    with cgutils.for_range(b, nb) as loop:
        i = loop.index
        blk = b.gep(w0, [b.mul(i, _const(I64, X16_Q6_BLOCK))])
        d = b.fpext(_load(b, blk, 0, _vec(HALF, 16)), V16F)
        first = b.mul(i, _const(I64, 256))
        for s in range(4):  # sub-blocks s, s + 4, s + 8, s + 12 (16 weights each) at once
            sums = [zero] * 8  # per sub-block: high plane, low plane
            for k4 in range(4):
                k = 4 * s + k4
                l0, l1, hv = (_load(b, blk, Q6_Q + 192 * k + 64 * v, V64) for v in range(3))
                for idx, (lv, lsh, hsh) in enumerate(((l0, 0, 0), (l1, 0, 2), (l0, 4, 4), (l1, 4, 6))):
                    q = b.or_(b.and_(shr(lv, lsh), nib), b.shl(b.and_(shr(hv, hsh), two), ir.Constant(V64, [4] * 64)))
                    at = b.add(first, _const(I64, 4 * (k + 16 * idx)))
                    sums[2 * idx] = _dpbusd(b, sums[2 * idx], q, spread(hi_p, at))
                    sums[2 * idx + 1] = _dpbusd(b, sums[2 * idx + 1], spread(lo_p, at), q)
            for idx in range(4):
                sub = s + 4 * idx
                isum = b.add(b.shl(sums[2 * idx], ir.Constant(V16I, [8] * 16)), sums[2 * idx + 1])
                sc = b.sitofp(_load(b, blk, 32 + 16 * sub, _vec(I8, 16)), V16F)
                at = b.add(b.mul(i, _const(I64, 8)), _const(I64, sub // 2))
                dx = _splat(b, _load(b, xd, at, FLT, align=4), 16)
                sx = _splat(b, _load(b, xs, b.add(b.mul(i, _const(I64, 16)), _const(I64, sub)), FLT, align=4), 16)
                scale = b.fmul(b.fmul(d, sc), dx)
                b.store(b.fadd(b.load(acc), b.fmul(b.sitofp(isum, V16F), scale, flags=FAST), flags=FAST), acc)
                b.store(b.fadd(b.load(off), b.fmul(scale, sx)), off)
    store(b.fsub(b.load(acc), b.fmul(b.load(off), ir.Constant(V16F, [32.0] * 16))))
    return context.get_dummy_value()


dot16_q6_k_x16 = intrinsic(_x16_typer(_x16_q6_codegen))
dot16_q6_k_x16.__doc__ = """`dot16_q4_k_x16` for Q6_K_X16 weights."""


# MXFP4, Q4_0 and Q5_0 (32 weights a block: a scale, Q5_0's 32 fifth bits, then 16 bytes whose low
# nibbles are weights 0-15 and high nibbles 16-31) in the same arrangement ("MXFP4_X16",
# "Q4_0_X16", "Q5_0_X16"; gpt-oss's experts, Q4_0 files' experts and matrices, the Q5_0 matrices
# that Q4_K_M files hold where a row is not a multiple of 256, as Gemma 3's). Measured (2-core
# VM, both threads, bench_roofline): gpt-oss-20b's experts (4 of 32, 2880 x 2880) MXFP4 18-24 GB/s
# as rows, 29-48 repacked; prompt 114-121 -> 211-217 GFLOP/s. A group and block, 16 x the type's
# block bytes: the 16 rows' scales (MXFP4's e8m0 bytes, Q4_0's and Q5_0's f16), Q5_0's 16 words
# of fifth bits, then for k = 0..3 the 16 rows' quant bytes 4 k .. 4 k + 3 (weights 4 k .. 4 k +
# 3 in the low nibbles, 16 + 4 k .. in the high). The weights meet the activation planes as
# unsigned bytes, as PAIRS (MXFP4 through its table: the doubled e2m1 value + 12; Q4_0 as stored,
# 0..15 = q + 8; Q5_0 with its fifth bit, 0..31 = q + 16), and c x each block's activation sum
# comes off with the scales. The same bytes as the rows, so every shape stays.
# Q4_1 and Q5_1 (a minimum m per block after d: weight = d q + m, q = 0..15 / 0..31 as stored) in
# the same arrangement, the 16 rows' m after their d (then Q5_1's fifth bits): their dot adds m x
# each block's activation sum where Q4_0's takes c x it off ("Q4_1_X16", "Q5_1_X16": Gemma 3's
# Q5_K_M file holds Q5_1 matrices).
# IQ4_NL (Q4_0's block, its nibbles index IQ4's 16 levels) likewise, through two vpshufb tables:
# its level (signed) meets the low plane (unsigned), its level + 128 (unsigned) the high plane
# (signed), and 128 x 256 x each block's d x the sum of its high bytes (`quantize_acts`, as
# IQ4_XS_X16's) comes off with the scales.
NIBBLE_X16 = ("MXFP4", "Q4_0", "Q5_0", "Q4_1", "Q5_1", "IQ4_NL")
X16_TYPES = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q8_0") + NIBBLE_X16 + ("Q2_K", "Q3_K")  # the types with an X16 layout
MXFP4_X16, Q4_0_X16, Q5_0_X16, Q4_1_X16, Q5_1_X16, IQ4_NL_X16 = (256 + QTYPES_BY_NAME[n].type_id for n in NIBBLE_X16)
# FIFTH[x]: the 4 bits of x (0..15) as 0x10 in bytes 0..3 of a word (bit b -> byte b).
FIFTH = [sum(((x >> i) & 1) << (8 * i + 4) for i in range(4)) for x in range(16)]


def _fifths(b, qh, shift: int):
    """<64 x i8>: in each 32-bit lane (a row), bits shift .. shift + 3 of its Q5_0 fifth bits qh
    (<16 x i32>) as 0x10 in bytes 0..3 (vpermd on FIFTH, which reads an index's low 4 bits)."""
    V16I = _vec(I32, 16)
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(V16I, [V16I, V16I]), "llvm.x86.avx512.permvar.si.512")
    idx = b.lshr(qh, ir.Constant(V16I, [shift] * 16)) if shift else qh
    return b.bitcast(b.call(fn, [ir.Constant(V16I, FIFTH), idx]), _vec(I8, 64))


def _nibble_x16_codegen(name: str):
    ts = QTYPES_BY_NAME[name].type_size
    sb = ts - 16  # scale (minimum, fifth-bit) bytes a row's block
    with_min = name in ("Q4_1", "Q5_1")  # (weight = d q + m: m x the activation sum, added)
    fifths = name in ("Q5_0", "Q5_1")
    wide = name == "IQ4_NL"  # (levels signed: the low plane meets them, the high plane level + 128)
    c = 0.0 if with_min else float(PAIRS[name])

    def codegen(context, builder, sig, args):
        b = builder
        nb, w0, lo_p, hi_p, xd, xm, nblk, store, spread = _x16_frame(context, b, sig, args, X16 * ts)
        if wide:
            xm = b.gep(xm, [b.mul(nblk, _const(I64, 3))])  # each block's d x the sum of its high bytes
        V16F, V16I, V64, acc, off, zero = _accumulators(b)
        with cgutils.for_range(b, nb) as loop:
            i = loop.index
            blk = b.gep(w0, [b.mul(i, _const(I64, X16 * ts))])
            if name == "MXFP4":  # the 16 e8m0 bytes as ggml's e8m0_to_fp32_half (`_e8m0_half`), at once
                e = b.zext(_load(b, blk, 0, _vec(I8, 16)), V16I)
                small = b.shl(ir.Constant(V16I, [0x00200000] * 16), e)
                big = b.shl(b.sub(e, ir.Constant(V16I, [1] * 16)), ir.Constant(V16I, [23] * 16))
                dw = b.bitcast(b.select(b.icmp_unsigned("<", e, ir.Constant(V16I, [2] * 16)), small, big), V16F)
            else:
                dw = b.fpext(_load(b, blk, 0, _vec(HALF, 16)), V16F)
            if with_min:
                mw = b.fpext(_load(b, blk, 32, _vec(HALF, 16)), V16F)
            if fifths:
                qh = _load(b, blk, 64 if with_min else 32, V16I)
            first = b.mul(i, _const(I64, 32))
            hi_sum, lo_sum = zero, zero
            for k in range(4):
                wv = _load(b, blk, X16 * sb + 64 * k, V64)
                lo4, hi4 = b.and_(wv, ir.Constant(V64, [15] * 64)), b.lshr(wv, ir.Constant(V64, [4] * 64))
                if name == "MXFP4":
                    lo4, hi4 = _pshufb(b, MXFP4_PLUS12, lo4), _pshufb(b, MXFP4_PLUS12, hi4)
                elif wide:
                    lo4, hi4 = (_pshufb(b, IQ4_PLUS128, lo4), _pshufb(b, IQ4_LEVELS, lo4)), (
                        _pshufb(b, IQ4_PLUS128, hi4), _pshufb(b, IQ4_LEVELS, hi4))
                elif fifths:
                    lo4, hi4 = b.or_(lo4, _fifths(b, qh, 4 * k)), b.or_(hi4, _fifths(b, qh, 16 + 4 * k))
                for h, q in enumerate((lo4, hi4)):
                    at = b.add(first, _const(I64, 16 * h + 4 * k))
                    qu, qs = q if wide else (q, q)  # (the unsigned and the signed side)
                    hi_sum = _dpbusd(b, hi_sum, qu, spread(hi_p, at))
                    lo_sum = _dpbusd(b, lo_sum, spread(lo_p, at), qs)
            isum = b.add(b.shl(hi_sum, ir.Constant(V16I, [8] * 16)), lo_sum)
            dx, mx = _splat(b, _load(b, xd, i, FLT, align=4), 16), _splat(b, _load(b, xm, i, FLT, align=4), 16)
            b.store(b.fadd(b.load(acc), b.fmul(b.sitofp(isum, V16F), b.fmul(dw, dx), flags=FAST), flags=FAST), acc)
            b.store(b.fadd(b.load(off), b.fmul(mw if with_min else dw, mx)), off)
        if with_min:
            store(b.fadd(b.load(acc), b.load(off)))
        elif wide:
            store(b.fsub(b.load(acc), b.fmul(b.load(off), ir.Constant(V16F, [32768.0] * 16))))
        else:
            store(b.fsub(b.load(acc), b.fmul(b.load(off), ir.Constant(V16F, [c] * 16))))
        return context.get_dummy_value()

    return codegen


dot16_mxfp4_x16 = intrinsic(_x16_typer(_nibble_x16_codegen("MXFP4")))
dot16_mxfp4_x16.__doc__ = """`dot16_q4_k_x16` for MXFP4_X16 weights."""
dot16_q4_0_x16 = intrinsic(_x16_typer(_nibble_x16_codegen("Q4_0")))
dot16_q4_0_x16.__doc__ = """`dot16_q4_k_x16` for Q4_0_X16 weights."""
dot16_q5_0_x16 = intrinsic(_x16_typer(_nibble_x16_codegen("Q5_0")))
dot16_q5_0_x16.__doc__ = """`dot16_q4_k_x16` for Q5_0_X16 weights."""
dot16_q4_1_x16 = intrinsic(_x16_typer(_nibble_x16_codegen("Q4_1")))
dot16_q4_1_x16.__doc__ = """`dot16_q4_k_x16` for Q4_1_X16 weights."""
dot16_q5_1_x16 = intrinsic(_x16_typer(_nibble_x16_codegen("Q5_1")))
dot16_q5_1_x16.__doc__ = """`dot16_q4_k_x16` for Q5_1_X16 weights."""
dot16_iq4_nl_x16 = intrinsic(_x16_typer(_nibble_x16_codegen("IQ4_NL")))
dot16_iq4_nl_x16.__doc__ = """`dot16_q4_k_x16` for IQ4_NL_X16 weights."""


# IQ4_XS (256 weights a block: f16 d, the 8 sub-blocks' 6-bit scales as 2 high bits in a u16 and
# a low nibble in 4 bytes, then 8 x 16 quant bytes, low nibbles weights 0-15 of each 32, high
# 16-31) in the same arrangement ("IQ4_XS_X16"): a group and block, 16 x 136 bytes (the same
# bytes): d of the 16 rows (f16), their u16 of high scale bits, the 4 bytes of low scale nibbles
# as [byte][row], then for each sub-block j and k = 0..3 the 16 rows' quant bytes 16 j + 4 k ..
# 16 j + 4 k + 3. A quant's level (-127..113, IQ4_NL's table) needs both byte signs: it meets the
# signed high plane as u = level + 128 (unsigned, through vpshufb) and the unsigned low plane as
# the signed level (u ^ 0x80), so sum level x v = 256 sum u hi + sum level lo - 32768 sum hi, the
# last per block of 32 from `quantize_acts` (d x the sum of its high bytes).
IQ4_XS_X16_BLOCK = 16 * 136
IQ4_XS_X16 = 256 + QTYPES_BY_NAME["IQ4_XS"].type_id


def _signed_frame(context, b, sig, args, block: int):
    """`_x16_frame` for the layouts whose weights meet both activation planes signed (IQ4_XS_X16,
    Q8_0_X16), with the blocks' d x sum of high bytes xh and the accumulators acc, off."""
    nb, w0, lo_p, hi_p, xd, xm, nblk, store, spread = _x16_frame(context, b, sig, args, block)
    xh = b.gep(xm, [b.mul(nblk, _const(I64, 3))])  # each block's d x sum of high bytes
    V16F = _vec(FLT, 16)
    acc = cgutils.alloca_once_value(b, ir.Constant(V16F, [0.0] * 16))
    off = cgutils.alloca_once_value(b, ir.Constant(V16F, [0.0] * 16))
    return nb, w0, lo_p, hi_p, xd, xh, acc, off, store, spread


def _signed_pair(b, sums, u, at, lo_p, hi_p, spread):
    """(hi, lo) sums plus 64 weights given as u = level + 128 (unsigned) against the 4 activation
    bytes at `at`: u against the signed high plane, the signed level (u ^ 0x80) against the low."""
    V64 = _vec(I8, 64)
    hi_sum = _dpbusd(b, sums[0], u, spread(hi_p, at))
    return hi_sum, _dpbusd(b, sums[1], spread(lo_p, at), b.xor(u, ir.Constant(V64, [-128] * 64)))


def _signed_block(b, sums, dw, acc, off, xd, xh, s):
    """Add a block of 32 (index s)'s (hi, lo) sums, scaled by dw (its 16 rows' scales) and the
    activations' d, to acc; its d x sum of high bytes x dw to off (`_signed_result` takes it off)."""
    V16F, V16I = _vec(FLT, 16), _vec(I32, 16)
    isum = b.add(b.shl(sums[0], ir.Constant(V16I, [8] * 16)), sums[1])
    dx, mh = _splat(b, _load(b, xd, s, FLT, align=4), 16), _splat(b, _load(b, xh, s, FLT, align=4), 16)
    b.store(b.fadd(b.load(acc), b.fmul(b.sitofp(isum, V16F), b.fmul(dw, dx), flags=FAST), flags=FAST), acc)
    b.store(b.fadd(b.load(off), b.fmul(dw, mh)), off)


def _signed_result(b, store, acc, off):
    store(b.fsub(b.load(acc), b.fmul(b.load(off), ir.Constant(_vec(FLT, 16), [32768.0] * 16))))


def _x16_iq4xs_codegen(context, builder, sig, args):
    b = builder
    nb, w0, lo_p, hi_p, xd, xh, acc, off, store, spread = _signed_frame(context, b, sig, args, IQ4_XS_X16_BLOCK)
    V16F, V16I, V64 = _vec(FLT, 16), _vec(I32, 16), _vec(I8, 64)
    zero = ir.Constant(V16I, [0] * 16)
    splat = lambda v: ir.Constant(V16I, [v] * 16)  # noqa: E731
    with cgutils.for_range(b, nb) as loop:
        i = loop.index
        blk = b.gep(w0, [b.mul(i, _const(I64, IQ4_XS_X16_BLOCK))])
        d = b.fpext(_load(b, blk, 0, _vec(HALF, 16)), V16F)
        high = b.zext(_load(b, blk, 32, _vec(I16, 16)), V16I)
        # (the sub-blocks as a loop: unrolled, their code spilled registers; 28 -> 35-39 GB/s on the 30B experts)
        with cgutils.for_range(b, _const(I64, 8)) as sub:
            j = sub.index
            j32 = b.trunc(j, I32)
            scale_bytes = b.gep(blk, [b.mul(b.lshr(j, _const(I64, 1)), _const(I64, 16))])  # (byte j // 2 of 4)
            low = b.zext(_load(b, scale_bytes, 64, _vec(I8, 16)), V16I)
            low = b.and_(b.lshr(low, _splat(b, b.shl(b.and_(j32, _const(I32, 1)), _const(I32, 2)), 16)), splat(15))
            ls = b.or_(low, b.shl(b.and_(b.lshr(high, _splat(b, b.shl(j32, _const(I32, 1)), 16)), splat(3)), splat(4)))
            dsc = b.fmul(d, b.sitofp(b.sub(ls, splat(32)), V16F))
            qj = b.gep(blk, [b.add(_const(I64, 128), b.mul(j, _const(I64, 256)))])
            first = b.add(b.mul(i, _const(I64, 256)), b.mul(j, _const(I64, 32)))
            sums = zero, zero
            for k in range(4):
                wv = _load(b, qj, 64 * k, V64)
                lo4, hi4 = b.and_(wv, ir.Constant(V64, [15] * 64)), b.lshr(wv, ir.Constant(V64, [4] * 64))
                for h, q in enumerate((lo4, hi4)):
                    at = b.add(first, _const(I64, 16 * h + 4 * k))
                    sums = _signed_pair(b, sums, _pshufb(b, IQ4_PLUS128, q), at, lo_p, hi_p, spread)
            _signed_block(b, sums, dsc, acc, off, xd, xh, b.add(b.mul(i, _const(I64, 8)), j))
    _signed_result(b, store, acc, off)
    return context.get_dummy_value()


dot16_iq4_xs_x16 = intrinsic(_x16_typer(_x16_iq4xs_codegen))
dot16_iq4_xs_x16.__doc__ = """`dot16_q4_k_x16` for IQ4_XS_X16 weights."""


# Q8_0 (32 weights a block: f16 d, 32 signed bytes) in the same arrangement ("Q8_0_X16"; gpt-oss's
# attention and output head, Q8_0 files' matrices and experts): a group and block, 16 x 34 bytes
# (the same bytes): the 16 rows' d, then for k = 0..7 the 16 rows' quant bytes 4 k .. 4 k + 3. A
# signed quant q meets the signed high activation plane as the unsigned q + 128 (q ^ 0x80) and the
# unsigned low plane as itself, so sum q x v = 256 sum (q + 128) hi + sum q lo - 32768 sum hi, the
# last as IQ4_XS_X16's.
Q8_0_X16 = 256 + QTYPES_BY_NAME["Q8_0"].type_id


def _x16_q8_0_codegen(context, builder, sig, args):
    b = builder
    nb, w0, lo_p, hi_p, xd, xh, acc, off, store, spread = _signed_frame(context, b, sig, args, X16 * 34)
    V16F, V16I, V64 = _vec(FLT, 16), _vec(I32, 16), _vec(I8, 64)
    zero = ir.Constant(V16I, [0] * 16)
    with cgutils.for_range(b, nb) as loop:
        i = loop.index
        blk = b.gep(w0, [b.mul(i, _const(I64, X16 * 34))])
        d = b.fpext(_load(b, blk, 0, _vec(HALF, 16)), V16F)
        first = b.mul(i, _const(I64, 32))
        sums = zero, zero
        for k in range(8):
            u = b.xor(_load(b, blk, 32 + 64 * k, V64), ir.Constant(V64, [-128] * 64))  # q + 128
            sums = _signed_pair(b, sums, u, b.add(first, _const(I64, 4 * k)), lo_p, hi_p, spread)
        _signed_block(b, sums, d, acc, off, xd, xh, i)
    _signed_result(b, store, acc, off)
    return context.get_dummy_value()


dot16_q8_0_x16 = intrinsic(_x16_typer(_x16_q8_0_codegen))
dot16_q8_0_x16.__doc__ = """`dot16_q4_k_x16` for Q8_0_X16 weights."""


# Q2_K and Q3_K (256 weights a block in sub-blocks of 16; byte 32 n + l of the quants holds, in
# bits 2 j and 2 j + 1, the low 2 bits of weight 128 n + 32 j + l) in the same arrangement
# ("Q2_K_X16", "Q3_K_X16"): 4 bytes of 16 rows' quants (one vector) hold 4 weights of each row
# in each of its 4 bit pairs, so one load feeds four vpdpbusd through a shift and a mask. A
# group and block, 16 x the type's block bytes (the same bytes as the rows):
# - Q2_K (weight = d (scale & 15) q - dmin (scale >> 4), q = 0..3): d of the 16 rows (f16),
#   their dmin, the 16 scale bytes as [sub-block][row], then for h = 0, 1 (weights 0-15 or
#   16-31 of each 32), n = 0, 1 and k = 0..3 the 16 rows' quant bytes 32 n + 16 h + 4 k .. + 3.
# - Q3_K (weight = d (scale - 32) (u - 4), u = the 2 low bits + 4 x the hmask bit 4 n + j of
#   byte l): d of the 16 rows, the 12 bytes of packed 6-bit scales as [byte][row], then for
#   h = 0, 1: the 16 rows' hmask bytes 16 h + 4 k .. (k = 0..3), then their quant bytes as
#   Q2_K's for n = 0 and n = 1.
# The quants meet the activation planes unsigned (Q2_K's q, Q3_K's u); dmin x (scale >> 4) x
# each 16 activations' sum (Q3_K: 4 x its scale x that sum) comes off with the scales.
Q2_K_X16, Q3_K_X16 = (256 + QTYPES_BY_NAME[n].type_id for n in ("Q2_K", "Q3_K"))
Q2_Q, Q3_Q = 320, 224  # where the quants start in a group's block


def _q3_six(b, blk, sub: int):
    """<16 x i32>: the 16 rows' 6-bit scale of sub-block sub (0..15) - 32, from Q3_K_X16's packed
    scale bytes (ggml's order: the low nibble of byte sub % 8, bits 2 (sub // 4) .. of byte 8 + sub
    % 4 above it)."""
    V16B, V16I = _vec(I8, 16), _vec(I32, 16)
    c = lambda v: ir.Constant(V16B, [v] * 16)  # noqa: E731
    low = b.and_(b.lshr(_load(b, blk, 32 + 16 * (sub % 8), V16B), c(4 * (sub // 8))), c(15))
    high = b.and_(b.lshr(_load(b, blk, 32 + 16 * (8 + sub % 4), V16B), c(2 * (sub // 4))), c(3))
    return b.sub(b.zext(b.or_(low, b.shl(high, c(4))), V16I), ir.Constant(V16I, [32] * 16))


def _x16_q23_codegen(three: bool):
    """The dot of Q2_K_X16 weights, or (three) of Q3_K_X16. The two sub-blocks of each 32
    weights (h = 0, 1) share the activations' scale dx: their integer sums meet their scales in
    int32 (Q2_K: sum_h scale_h isum_h, under 2^26; Q3_K: sum_h (scale_h - 32)(isum_h - 4 x its
    activations' sum), the offset folded in, under 2^28), then one conversion and one multiply-add
    by dx per 32 weights, and d (Q2_K: dmin for the mins' float sum) once per block."""
    block = X16 * QTYPES_BY_NAME["Q3_K" if three else "Q2_K"].type_size

    def codegen(context, builder, sig, args):
        b = builder
        nb, w0, lo_p, hi_p, xd, xm, nblk, store, spread = _x16_frame(context, b, sig, args, block)
        xs = b.gep(xm, [nblk])  # each 16 values' sum
        V16F, V16I, V64, acc, off, zero = _accumulators(b)
        V32B = _vec(I8, 32)
        c8 = lambda v: ir.Constant(V64, [v] * 64)  # noqa: E731
        shr = lambda v, k: b.lshr(v, c8(k)) if k else v  # noqa: E731
        fzero = ir.Constant(V16F, [0.0] * 16)

        with cgutils.for_range(b, nb) as loop:
            i = loop.index
            blk = b.gep(w0, [b.mul(i, _const(I64, block))])
            d = b.fpext(_load(b, blk, 0, _vec(HALF, 16)), V16F)
            first = b.mul(i, _const(I64, 256))
            bacc, boff = fzero, fzero  # the block's sums before d (and dmin)
            for n in range(2):
                isums = {}  # (h, j) -> <16 x i32>: sub-block 8 n + 2 j + h's quants . activations
                for h in range(2):
                    qs = []  # [k][j]: 4 weights of each row of sub-block 8 n + 2 j + h
                    for k in range(4):
                        if three:
                            hv = _load(b, blk, Q3_Q + 768 * h + 64 * k, V64)
                            qv = _load(b, blk, Q3_Q + 768 * h + 256 + 256 * n + 64 * k, V64)
                        else:
                            qv = _load(b, blk, Q2_Q + 64 * (8 * h + 4 * n + k), V64)
                        row = []
                        for j in range(4):
                            q = b.and_(shr(qv, 2 * j), c8(3))
                            if three:
                                q = b.or_(q, b.shl(b.and_(shr(hv, 4 * n + j), c8(1)), c8(2)))
                            row.append(q)
                        qs.append(row)
                    for j in range(4):  # high plane, x 256, then the low plane into the same sum
                        at = [b.add(first, _const(I64, 128 * n + 32 * j + 16 * h + 4 * k)) for k in range(4)]
                        s = zero
                        for k in range(4):
                            s = _dpbusd(b, s, qs[k][j], spread(hi_p, at[k]))
                        s = b.shl(s, ir.Constant(V16I, [8] * 16))
                        for k in range(4):
                            s = _dpbusd(b, s, spread(lo_p, at[k]), qs[k][j])
                        isums[h, j] = s
                for j in range(4):
                    sub = 8 * n + 2 * j  # (and sub + 1: h = 1)
                    s32 = b.add(b.mul(i, _const(I64, 8)), _const(I64, 4 * n + j))  # its block of 32
                    dx = _splat(b, _load(b, xd, s32, FLT, align=4), 16)
                    sx = [_load(b, xs, b.add(b.mul(i, _const(I64, 16)), _const(I64, sub + h)), FLT, align=4)
                          for h in range(2)]
                    if three:
                        t = zero
                        for h in range(2):
                            four_sx = _splat(b, b.fptosi(b.fmul(sx[h], ir.Constant(FLT, 4.0)), I32), 16)
                            t = b.add(t, b.mul(_q3_six(b, blk, sub + h), b.sub(isums[h, j], four_sx)))
                    else:
                        both = _load(b, blk, 64 + 16 * sub, V32B)  # the two sub-blocks' scale bytes
                        sc = b.and_(both, ir.Constant(V32B, [15] * 32))
                        mn = b.lshr(both, ir.Constant(V32B, [4] * 32))
                        half = lambda v, h: b.zext(b.shuffle_vector(  # noqa: E731
                            v, v, ir.Constant(_vec(I32, 16), list(range(16 * h, 16 * h + 16)))), V16I)
                        t = b.add(b.mul(isums[0, j], half(sc, 0)), b.mul(isums[1, j], half(sc, 1)))
                        m = b.fmul(b.uitofp(half(mn, 0), V16F), _splat(b, sx[0], 16))
                        m = b.fadd(m, b.fmul(b.uitofp(half(mn, 1), V16F), _splat(b, sx[1], 16), flags=FAST),
                                   flags=FAST)
                        boff = b.fadd(boff, b.fmul(m, dx, flags=FAST), flags=FAST)
                    bacc = b.fadd(bacc, b.fmul(b.sitofp(t, V16F), dx, flags=FAST), flags=FAST)
            b.store(b.fadd(b.load(acc), b.fmul(d, bacc, flags=FAST), flags=FAST), acc)
            if not three:
                dmin = b.fpext(_load(b, blk, 32, _vec(HALF, 16)), V16F)
                b.store(b.fadd(b.load(off), b.fmul(dmin, boff, flags=FAST), flags=FAST), off)
        store(b.load(acc) if three else b.fsub(b.load(acc), b.load(off)))
        return context.get_dummy_value()

    return codegen


dot16_q2_k_x16 = intrinsic(_x16_typer(_x16_q23_codegen(False)))
dot16_q2_k_x16.__doc__ = """`dot16_q4_k_x16` for Q2_K_X16 weights."""
dot16_q3_k_x16 = intrinsic(_x16_typer(_x16_q23_codegen(True)))
dot16_q3_k_x16.__doc__ = """`dot16_q4_k_x16` for Q3_K_X16 weights."""
