"""LLVM vector IR builders the dot products are written with: small helpers (vectors, loads,
splats, horizontal sums) and every quant type's block decoded 32 weights at a time into float
vectors (`_groups`; the legacy, K, ternary, 1-bit and codebook types in `_more_groups`), with
the codebooks placed as int8 tables in the kernel's module. float_dots.py, int_dots.py, x16.py
and decode.py build on them."""

from __future__ import annotations

from functools import cache

import numpy as np
from llvmlite import ir

from ...formats.quants import IQ1_DELTA, iq4_values, iq_grid


# -- LLVM vector IR helpers ------------------------------------------------------------------

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
FLT, HALF = ir.FloatType(), ir.HalfType()
FAST = ("contract",)  # fuse multiply-adds; no reassociation, no nnan/ninf (inputs may hold inf or nan)
W = 32  # weights per decoded group: one accumulator vector


def _vec(t, n=W):
    return ir.VectorType(t, n)


def _const(t, v):
    return ir.Constant(t, v)


def _splat(b, s, n=W):
    v = b.insert_element(ir.Constant(_vec(s.type, n), ir.Undefined), s, _const(I32, 0))
    return b.shuffle_vector(v, v, ir.Constant(_vec(I32, n), [0] * n))


def _two(b, s0, s1, n=W):
    """<s0 x n/2, s1 x n/2>: a scale per 16 weights (Q6_K; n = 16: per pair of weights)."""
    v = b.insert_element(ir.Constant(_vec(FLT, 2), ir.Undefined), s0, _const(I32, 0))
    v = b.insert_element(v, s1, _const(I32, 1))
    return b.shuffle_vector(v, v, ir.Constant(_vec(I32, n), [0] * (n // 2) + [1] * (n // 2)))


def _load(b, base, off, ty, align=1):
    p = b.gep(base, [_const(I64, off)]) if isinstance(off, int) else b.gep(base, [off])
    return b.load(b.bitcast(p, ir.PointerType(ty)), align=align)


def _byte(b, base, off):
    return b.zext(_load(b, base, off, I8), I32)


def _f16(b, base, off):
    """The f16 at byte `off` of base, as float: loaded with its neighbouring 2 bytes of the block
    (the 2 before it, or after where off is 0) as one 4-byte vector. A 2-byte load became
    vpinsrw, which merges into a register LLVM may give to a loop's accumulator: on AVX2 the Q8_0
    row dot's scale load waited on the last block's multiply-add (each block's work one chain)."""
    lane = 1 if off >= 2 else 0
    pair = _load(b, base, off - 2 * lane, _vec(HALF, 2))
    return b.fpext(b.extract_element(pair, _const(I32, lane)), FLT)


def _hsum(b, v, n=W):
    while n > 1:
        h = n // 2
        lo = b.shuffle_vector(v, v, ir.Constant(_vec(I32, h), list(range(h))))
        hi = b.shuffle_vector(v, v, ir.Constant(_vec(I32, h), list(range(h, n))))
        v = b.fadd(lo, hi, flags=FAST)
        n = h
    return b.extract_element(v, _const(I32, 0))


def _nibbles(b, q16):
    """16 bytes -> 32: the low nibbles, then the high ones (Q4_0, MXFP4)."""
    lo = b.and_(q16, ir.Constant(_vec(I8, 16), [15] * 16))
    hi = b.lshr(q16, ir.Constant(_vec(I8, 16), [4] * 16))
    return b.shuffle_vector(lo, hi, ir.Constant(_vec(I32), list(range(32))))


def _v8(v):
    return ir.Constant(_vec(I8), [v] * W)


def _ir_scale_min_k4(b, blk, j):
    """Q4_K/Q5_K: 6-bit scale and min of sub-block j from the 12 bytes at blk + 4, as float."""
    s = lambda i: _byte(b, blk, 4 + i)  # noqa: E731
    c63, c15 = _const(I32, 63), _const(I32, 15)
    if j < 4:
        sc, m = b.and_(s(j), c63), b.and_(s(j + 4), c63)
    else:
        sc = b.or_(b.and_(s(j + 4), c15), b.shl(b.lshr(s(j - 4), _const(I32, 6)), _const(I32, 4)))
        m = b.or_(b.lshr(s(j + 4), _const(I32, 4)), b.shl(b.lshr(s(j), _const(I32, 6)), _const(I32, 4)))
    return b.uitofp(sc, FLT), b.uitofp(m, FLT)


def _k_quants(b, name, blk):
    """Q4_K / Q5_K: (sub-block, <32 x i8> quants 0..15 / 0..31) of one block, in order."""
    qs = 16 if name == "Q4_K" else 48
    qh = _load(b, blk, 16, _vec(I8)) if name == "Q5_K" else None
    for j in range(4):
        q = _load(b, blk, qs + 32 * j, _vec(I8))
        for half, nib in enumerate((b.and_(q, _v8(15)), b.lshr(q, _v8(4)))):
            sub = 2 * j + half
            if qh is not None:
                nib = b.or_(nib, b.shl(b.and_(b.lshr(qh, _v8(sub)), _v8(1)), _v8(4)))
            yield sub, nib


def _q6_quants(b, blk, signed=True):
    """Q6_K: (first weight, <32 x i8> quants -32..31 (0..63, the stored values, if not `signed`),
    the two int8 scales of its halves as float) of one block, in order; the block's f16 scale is
    at blk + 208."""
    for half in range(2):
        a, c = _load(b, blk, 64 * half, _vec(I8)), _load(b, blk, 64 * half + 32, _vec(I8))
        qh = _load(b, blk, 128 + 32 * half, _vec(I8))
        for g, low in enumerate((b.and_(a, _v8(15)), b.and_(c, _v8(15)), b.lshr(a, _v8(4)), b.lshr(c, _v8(4)))):
            hi = b.shl(b.and_(b.lshr(qh, _v8(2 * g)), _v8(3)), _v8(4))
            q = b.sub(b.or_(low, hi), _v8(32)) if signed else b.or_(low, hi)
            s0, s1 = (b.sitofp(_load(b, blk, 192 + 8 * half + 2 * g + k, I8), FLT) for k in range(2))
            yield 128 * half + 32 * g, q, s0, s1


def _q5_quants(b, name, blk):
    """Q4_1 / Q5_0 / Q5_1: the block's <32 x i32> quants (0..15 / 0..31, no offset applied)."""
    return b.zext(_q5_bytes(b, name, blk), _vec(I32))


def _q5_bytes(b, name, blk):
    """Q4_1 / Q5_0 / Q5_1: the block's quants as <32 x i8> (0..15 / 0..31, no offset applied),
    the fifth bits from the 32-bit word as a <32 x i1> (one mask register on AVX-512)."""
    qs = {"Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[name]
    q = _nibbles(b, _load(b, blk, qs, _vec(I8, 16)))
    if name != "Q4_1":
        fifth = b.zext(b.bitcast(_u32i(b, blk, qs - 4), _vec(ir.IntType(1), W)), _vec(I8))
        q = b.or_(q, b.shl(fifth, _v8(4)))
    return q


def _e8m0_half(b, blk):
    """MXFP4's block scale (the e8m0 byte at blk), halved as ggml's e8m0_to_fp32_half."""
    e = _byte(b, blk, 0)
    small = b.shl(_const(I32, 0x00200000), e)
    big = b.shl(b.sub(e, _const(I32, 1)), _const(I32, 23))
    return b.bitcast(b.select(b.icmp_unsigned("<", e, _const(I32, 2)), small, big), FLT)

def _groups(b, name, blk):
    """The weight groups of one block at byte pointer blk: [(first weight, <32 x float>)]."""
    V = _vec(FLT)
    if name == "F32":
        return [(0, _load(b, blk, 0, V))]
    if name == "F16":
        return [(0, b.fpext(_load(b, blk, 0, _vec(HALF)), V))]
    if name == "BF16":
        u = b.shl(b.zext(_load(b, blk, 0, _vec(I16)), _vec(I32)), ir.Constant(_vec(I32), [16] * W))
        return [(0, b.bitcast(u, V))]
    if name == "Q8_0":
        q = b.sitofp(_load(b, blk, 2, _vec(I8)), V)
        return [(0, b.fmul(_splat(b, _f16(b, blk, 0)), q))]
    if name == "Q4_0":
        q = b.sub(_nibbles(b, _load(b, blk, 2, _vec(I8, 16))), _v8(8))
        return [(0, b.fmul(_splat(b, _f16(b, blk, 0)), b.sitofp(q, V)))]
    if name == "MXFP4":  # e2m1 magnitudes 0 1 2 3 4 6 8 12 (doubled, as ggml), sign in bit 3
        d = _e8m0_half(b, blk)
        n = b.zext(_nibbles(b, _load(b, blk, 1, _vec(I8, 16))), _vec(I32))
        c = lambda v: ir.Constant(_vec(I32), [v] * W)  # noqa: E731
        mag = b.and_(n, c(7))
        wide = b.shl(b.or_(c(2), b.and_(mag, c(1))), b.sub(b.lshr(mag, c(1)), c(1)))
        val = b.select(b.icmp_unsigned("<", mag, c(4)), mag, wide)
        val = b.select(b.icmp_unsigned("!=", b.and_(n, c(8)), c(0)), b.sub(c(0), val), val)
        return [(0, b.fmul(_splat(b, d), b.sitofp(val, V)))]
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b, blk, 0), _f16(b, blk, 2)
        out = []
        for sub, nib in _k_quants(b, name, blk):
            sc, m = _ir_scale_min_k4(b, blk, sub)
            ds, dm = b.fmul(d, sc), b.fmul(dmin, m)
            out.append((32 * sub, b.fsub(b.fmul(_splat(b, ds), b.uitofp(nib, V)), _splat(b, dm))))
        return out
    if name == "Q6_K":
        d = _f16(b, blk, 208)
        return [(off, b.fmul(_two(b, b.fmul(d, s0), b.fmul(d, s1)), b.sitofp(q, V)))
                for off, q, s0, s1 in _q6_quants(b, blk)]
    return _more_groups(b, name, blk)


# -- the other types: legacy, K, ternary, 1-bit and codebook (IQ) blocks ---------------------
# Codebooks (IQ grids) are int8 tables placed in the kernel's module as constants, read 4 or 8
# bytes per grid index; IQ4's 16 levels are selected in registers.


def _ivec(vals):
    return ir.Constant(_vec(I32, len(vals)), list(vals))


def _cat(b, parts):
    """Equal-length vectors (a power-of-two count of them) -> one vector, in order."""
    while len(parts) > 1:
        n = parts[0].type.count
        mask = ir.Constant(_vec(I32, 2 * n), list(range(2 * n)))
        parts = [b.shuffle_vector(parts[i], parts[i + 1], mask) for i in range(0, len(parts), 2)]
    return parts[0]


def _spread(b, scalars):
    """Floats s0..s(k-1) -> <32 x float>, each repeated 32 / k times."""
    k = len(scalars)
    v = ir.Constant(_vec(FLT, k), ir.Undefined)
    for i, s in enumerate(scalars):
        v = b.insert_element(v, s, _const(I32, i))
    return b.shuffle_vector(v, v, _ivec([i * k // W for i in range(W)]))


def _u16i(b, base, off):
    return b.zext(_load(b, base, off, I16), I32)


def _u32i(b, base, off):
    return _load(b, base, off, I32)


def _bits32(b, word):
    """Bit l of the i32 `word` as lane l of <32 x i1>."""
    v = b.and_(b.lshr(_splat(b, word), _ivec(range(W))), _ivec([1] * W))
    return b.icmp_unsigned("!=", v, _ivec([0] * W))


@cache
def _table_bytes(name: str) -> bytes:
    return iq_grid(name).astype(np.int8).tobytes()


def _table(b, name):
    """Pointer (i8*) to table `name` in the function's module."""
    mod = b.module
    g = mod.globals.get(f"onebit_{name}")
    if g is None:
        data = _table_bytes(name)
        ty = ir.ArrayType(I8, len(data))
        g = ir.GlobalVariable(mod, ty, f"onebit_{name}")
        g.initializer = ir.Constant(ty, bytearray(data))
        g.global_constant = True
        g.linkage = "internal"
    return b.bitcast(g, ir.PointerType(I8))


def _grid_rows(b, tab, idxs, k):
    """Rows idxs (i32 values) of a table of k-byte rows -> one <len * k x i8> vector."""
    return _cat(b, [_load(b, tab, b.mul(b.zext(i, I64), _const(I64, k)), _vec(I8, k)) for i in idxs])


def _levels(b, q):
    """<32 x i8> of IQ4's level[q[l]] for the nibbles q: a tree of selects on the index bits over
    constant vectors (four compares and 15 selects per 32 weights, no per-lane loads)."""
    level = [ir.Constant(_vec(I8), [int(v)] * W) for v in iq4_values()]
    for bit in range(4):
        m = b.icmp_unsigned("!=", b.and_(q, _v8(1 << bit)), _v8(0))
        level = [b.select(m, level[2 * i + 1], level[2 * i]) for i in range(len(level) // 2)]
    return level[0]


def _even_signs(b, fields):
    """IQ2_XXS / IQ2_XS / IQ3_XXS: the four sign bytes of a group of 32 weights (an i32, or each
    i32 lane of a vector) from its four 7-bit sign fields (field k in bits 8k .. 8k + 6, bit 8k +
    7 clear), each byte's 8th bit the parity of its 7 (an even count of negatives), by shifts and
    xors where a table load per field and its shifts had been a third of an IQ2_XXS group's
    instructions."""
    t = fields.type
    c = lambda v: ir.Constant(t, [v] * t.count if isinstance(t, ir.VectorType) else v)  # noqa: E731
    p = b.xor(fields, b.lshr(fields, c(4)))  # (bit 0 of each byte: its own bits only)
    p = b.xor(p, b.lshr(p, c(2)))
    p = b.xor(p, b.lshr(p, c(1)))
    return b.or_(fields, b.shl(b.and_(p, c(0x01010101)), c(7)))


IQ_INT = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")  # the codebook types `_iq_quants` decodes


def _iq_quants(b, name, blk):
    """A block of an IQ_INT type (256 weights) as ([(first weight, <32 x i8> signed grid values,
    lanes)], scales): every weight is its scale x its value (the grids' magnitudes are at most 62,
    so a value and its sign fit a byte). scales: the block's scales, <8 x float> (one per 32
    weights: lanes is the group's lane) or <16 x float> (IQ2_XS, IQ2_S: one per 16; lanes: 8
    pair lanes of each half's), computed for the block at once, as are IQ2_XS's sign words.
    What measured faster, one thread, 256 x 1024 rows in cache: the grid indices as scalars
    (computed in vectors and extracted, IQ2_S took 27 us against 19, IQ3_S 51 against 28: the
    extracts and inserts share one port), the XXS types' sign words per group as scalars
    (IQ2_XXS 26.5 us in a vector of 8, 23 as scalars), IQ2_XS's in a vector (23 against 26);
    no gathers (IQ3_S 25.5 us with vpgatherdd, 10% faster here, but gathers are slow on many
    CPUs people have)."""
    V8, V8F = _vec(I32, 8), _vec(FLT, 8)
    c = lambda v, n=8: ir.Constant(_vec(I32, n), [v] * n)  # noqa: E731
    d, tab = _f16(b, blk, 0), _table(b, name)
    if name in ("IQ2_XXS", "IQ3_XXS"):  # a u32 per 32 weights: 4 sign fields (7 bits each) + a 4-bit scale
        if name == "IQ2_XXS":  # (after each group's 4 index bytes)
            words = _load(b, blk, 2, _vec(I32, 16))
            aux = b.shuffle_vector(words, words, _ivec(range(1, 16, 2)))
        else:
            aux = _load(b, blk, 66, V8)
        div = 4.0 if name == "IQ2_XXS" else 2.0
        scales = b.fmul(b.fmul(_splat(b, d, 8), b.fadd(ir.Constant(V8F, [0.5] * 8), b.uitofp(b.lshr(aux, c(28)), V8F))),
                        ir.Constant(V8F, [1.0 / div] * 8))
    elif name in ("IQ2_XS", "IQ2_S"):  # 4-bit scales, two to a byte
        s = b.zext(_load(b, blk, 66 if name == "IQ2_XS" else 74, _vec(I8, 8)), V8)
        s = b.shuffle_vector(b.and_(s, c(15)), b.lshr(s, c(4)), _ivec([k // 2 + 8 * (k % 2) for k in range(16)]))
        V16F = _vec(FLT, 16)
        half = b.fadd(ir.Constant(V16F, [0.5] * 16), b.uitofp(s, V16F))
        scales = b.fmul(b.fmul(_splat(b, d, 16), half), ir.Constant(V16F, [0.25] * 16))
        if name == "IQ2_XS":  # u16s of a 9-bit grid index and a 7-bit sign field
            qs = _load(b, blk, 2, _vec(I16, 32))
            signs = _even_signs(b, b.bitcast(b.trunc(b.lshr(qs, ir.Constant(_vec(I16, 32), [9] * 32)), _vec(I8)), V8))
    else:  # IQ3_S: a 4-bit scale per 32 (s: d (1 + 2 s)), two to a byte; a sign bit per weight
        s = b.zext(_load(b, blk, 106, _vec(I8, 4)), _vec(I32, 4))
        s = b.shuffle_vector(b.and_(s, c(15, 4)), b.lshr(s, c(4, 4)), _ivec([k // 2 + 4 * (k % 2) for k in range(8)]))
        scales = b.fmul(_splat(b, d, 8), b.fadd(ir.Constant(V8F, [1.0] * 8),
                                                b.fmul(ir.Constant(V8F, [2.0] * 8), b.uitofp(s, V8F))))
    out = []
    for g in range(8):
        if name == "IQ2_XXS":
            vals = _grid_rows(b, tab, [_byte(b, blk, 2 + 8 * g + k) for k in range(4)], 8)
        elif name == "IQ3_XXS":
            vals = _grid_rows(b, tab, [_byte(b, blk, 2 + 8 * g + k) for k in range(8)], 4)
        elif name == "IQ2_XS":
            vals = _grid_rows(b, tab, [b.and_(_u16i(b, blk, 2 + 8 * g + 2 * k), _const(I32, 511)) for k in range(4)], 8)
        else:  # IQ2_S: 4 indices of 8-weight rows, 2 high bits each; IQ3_S: 8 of 4-weight rows, 1 each
            n, bits = (4, 2) if name == "IQ2_S" else (8, 1)
            qh = _byte(b, blk, 66 + g)
            idx = [b.or_(_byte(b, blk, 2 + n * g + k), b.shl(b.and_(b.lshr(qh, _const(I32, bits * k)),
                                                                     _const(I32, (1 << bits) - 1)), _const(I32, 8)))
                   for k in range(n)]
            vals = _grid_rows(b, tab, idx, 32 // n)
        if name in ("IQ2_XXS", "IQ3_XXS"):  # the group's aux word: its 4 sign fields one to a byte
            a = _u32i(b, blk, (2 + 8 * g + 4) if name == "IQ2_XXS" else (66 + 4 * g))
            fields = b.and_(a, _const(I32, 0x7F))
            for k in range(1, 4):
                fields = b.or_(fields, b.and_(b.shl(a, _const(I32, k)), _const(I32, 0x7F << (8 * k))))
            word = _even_signs(b, fields)
        elif name == "IQ2_XS":
            word = b.extract_element(signs, _const(I32, g))
        else:  # a sign bit per weight, stored
            word = _u32i(b, blk, (34 if name == "IQ2_S" else 74) + 4 * g)
        neg = b.bitcast(word, _vec(ir.IntType(1), W))
        lanes = g if scales.type.count == 8 else [2 * g] * 8 + [2 * g + 1] * 8
        out.append((32 * g, b.select(neg, b.sub(_v8(0), vals), vals), lanes))
    return out, scales


def _more_groups(b, name, blk):
    V = _vec(FLT)
    c = lambda v, t=I32: ir.Constant(_vec(t), [v] * W)  # noqa: E731
    if name in ("Q4_1", "Q5_0", "Q5_1"):
        d = _f16(b, blk, 0)
        m = _f16(b, blk, 2) if name != "Q5_0" else None
        q = _q5_quants(b, name, blk)
        if name == "Q5_0":
            return [(0, b.fmul(_splat(b, d), b.sitofp(b.sub(q, c(16)), V)))]
        return [(0, b.fadd(b.fmul(_splat(b, d), b.uitofp(q, V)), _splat(b, m)))]
    if name == "Q2_K":  # 16 bytes of 4-bit scale | 4-bit min per 16 weights, 64 of 2-bit quants
        d, dmin = _f16(b, blk, 80), _f16(b, blk, 82)
        out = []
        for half in range(2):
            q = _load(b, blk, 16 + 32 * half, _vec(I8))
            for j in range(4):
                v = b.uitofp(b.and_(b.lshr(q, _v8(2 * j)), _v8(3)), V)
                s = [_byte(b, blk, 8 * half + 2 * j + k) for k in range(2)]
                sc = _two(b, *(b.fmul(d, b.uitofp(b.and_(x, _const(I32, 15)), FLT)) for x in s))
                mn = _two(b, *(b.fmul(dmin, b.uitofp(b.lshr(x, _const(I32, 4)), FLT)) for x in s))
                out.append((128 * half + 32 * j, b.fsub(b.fmul(sc, v), mn)))
        return out
    if name == "Q3_K":  # 32 bytes of high bits, 64 of 2-bit quants, 12 of 6-bit scales, f16 d
        d = _f16(b, blk, 108)
        hm = _load(b, blk, 0, _vec(I8))
        out = []
        for g in range(8):
            half, j = divmod(g, 4)
            q = b.and_(b.lshr(_load(b, blk, 32 + 32 * half, _vec(I8)), _v8(2 * j)), _v8(3))
            hb = b.and_(b.lshr(hm, _v8(g)), _v8(1))
            v = b.sitofp(b.add(b.sub(q, _v8(4)), b.shl(hb, _v8(2))), V)  # q - 4 where the high bit is 0
            s = []
            for i in (2 * g, 2 * g + 1):
                lo = b.and_(b.lshr(_byte(b, blk, 96 + i % 8), _const(I32, 4 * (i // 8))), _const(I32, 15))
                hi = b.and_(b.lshr(_byte(b, blk, 104 + i % 4), _const(I32, 2 * (i // 4))), _const(I32, 3))
                s.append(b.fmul(d, b.sitofp(b.sub(b.or_(lo, b.shl(hi, _const(I32, 4))), _const(I32, 32)), FLT)))
            out.append((32 * g, b.fmul(_two(b, *s), v)))
        return out
    if name == "TQ2_0":  # 2-bit values - 1, four per byte at shifts 0, 2, 4, 6 of 32-byte rows
        d = _splat(b, _f16(b, blk, 64))
        out = []
        for half in range(2):
            q = _load(b, blk, 32 * half, _vec(I8))
            for s in range(4):
                v = b.sitofp(b.sub(b.and_(b.lshr(q, _v8(2 * s)), _v8(3)), _v8(1)), V)
                out.append((128 * half + 32 * s, b.fmul(d, v)))
        return out
    if name == "TQ1_0":  # base-3 digits: 5 per byte of qs, 4 per byte of qh; digit = (byte * 3^p * 3) >> 8
        d = _splat(b, _f16(b, blk, 52))

        def tern(v):  # <32 x i8> of byte * 3^p (mod 256) -> weights
            t = b.lshr(b.mul(b.zext(v, _vec(I32)), c(3)), c(8))
            return b.fmul(d, b.sitofp(b.sub(t, c(1)), V))

        def times(v, p):
            n = v.type.count
            return b.mul(v, ir.Constant(_vec(I8, n), p if isinstance(p, list) else [p] * n))

        q0 = _load(b, blk, 0, _vec(I8))
        q1 = _load(b, blk, 32, _vec(I8, 16))
        qh = _load(b, blk, 48, _vec(I8, 4))
        qh = times(b.shuffle_vector(qh, qh, _ivec([0, 1, 2, 3] * 4)), [1] * 4 + [3] * 4 + [9] * 4 + [27] * 4)
        out = [(32 * p, tern(times(q0, 3**p))) for p in range(5)]
        p1 = [times(q1, 3**p) for p in range(5)]
        out += [(160, tern(_cat(b, p1[0:2]))), (192, tern(_cat(b, p1[2:4]))), (224, tern(_cat(b, [p1[4], qh])))]
        return out
    if name == "Q1_0":  # sign bits: w = bit ? +d : -d
        d = _splat(b, _f16(b, blk, 0))
        return [(32 * g, b.select(_bits32(b, _u32i(b, blk, 2 + 4 * g)), d, b.fneg(d))) for g in range(4)]
    if name in ("IQ4_NL", "IQ4_XS"):
        d = _f16(b, blk, 0)

        def levels(off):
            return b.sitofp(_levels(b, _nibbles(b, _load(b, blk, off, _vec(I8, 16)))), V)

        if name == "IQ4_NL":
            return [(0, b.fmul(_splat(b, d), levels(2)))]
        sh = _u16i(b, blk, 2)
        out = []
        for g in range(8):
            lo = b.and_(b.lshr(_byte(b, blk, 4 + g // 2), _const(I32, 4 * (g % 2))), _const(I32, 15))
            hi = b.and_(b.lshr(sh, _const(I32, 2 * g)), _const(I32, 3))
            s = b.sub(b.or_(lo, b.shl(hi, _const(I32, 4))), _const(I32, 32))
            out.append((32 * g, b.fmul(_splat(b, b.fmul(d, b.sitofp(s, FLT))), levels(8 + 16 * g))))
        return out
    if name in IQ_INT:  # signed grid values x one scale per 32 weights, or per 16 (IQ2_XS, IQ2_S)
        groups, scales = _iq_quants(b, name, blk)
        lane = lambda i: b.extract_element(scales, _const(I32, i))  # noqa: E731
        return [(off, b.fmul(_splat(b, lane(t)) if isinstance(t, int) else _two(b, lane(t[0]), lane(t[-1])),
                             b.sitofp(q, V))) for off, q, t in groups]
    if name in ("IQ1_S", "IQ1_M"):  # 11-bit indices of 8-weight rows of -1/0/1, +- 1/8, d (2 s + 1)
        tab = _table(b, "IQ1_S")
        eighth = _const(FLT, float(IQ1_DELTA))
        if name == "IQ1_M":
            sc = [_u16i(b, blk, 48 + 2 * i) for i in range(4)]
            d16 = b.or_(b.or_(b.lshr(sc[0], _const(I32, 12)), b.and_(b.lshr(sc[1], _const(I32, 8)), _const(I32, 0xF0))),
                        b.or_(b.and_(b.lshr(sc[2], _const(I32, 4)), _const(I32, 0xF00)), b.and_(sc[3], _const(I32, 0xF000))))
            d = b.fpext(b.bitcast(b.trunc(d16, I16), HALF), FLT)
        else:
            d = _f16(b, blk, 0)
        out = []
        for g in range(8):
            if name == "IQ1_S":
                qh = _u16i(b, blk, 34 + 2 * g)
                idx = [b.or_(_byte(b, blk, 2 + 4 * g + k),
                             b.shl(b.and_(b.lshr(qh, _const(I32, 3 * k)), _const(I32, 7)), _const(I32, 8)))
                       for k in range(4)]
                neg = b.icmp_unsigned("!=", b.and_(qh, _const(I32, 0x8000)), _const(I32, 0))
                delta = _splat(b, b.select(neg, b.fneg(eighth), eighth))
                s = b.and_(b.lshr(qh, _const(I32, 12)), _const(I32, 7))
                dl = _splat(b, b.fmul(d, b.uitofp(b.add(b.shl(s, _const(I32, 1)), _const(I32, 1)), FLT)))
            else:
                nib = [b.and_(b.lshr(_byte(b, blk, 32 + (4 * g + k) // 2), _const(I32, 4 * (k % 2))), _const(I32, 15))
                       for k in range(4)]
                idx = [b.or_(_byte(b, blk, 4 * g + k), b.shl(b.and_(n, _const(I32, 7)), _const(I32, 8)))
                       for k, n in enumerate(nib)]
                delta = _spread(b, [b.select(b.icmp_unsigned("!=", b.and_(n, _const(I32, 8)), _const(I32, 0)),
                                             b.fneg(eighth), eighth) for n in nib])
                dls = []
                for i in (2 * g, 2 * g + 1):
                    s = b.and_(b.lshr(sc[i // 4], _const(I32, 3 * (i % 4))), _const(I32, 7))
                    dls.append(b.fmul(d, b.uitofp(b.add(b.shl(s, _const(I32, 1)), _const(I32, 1)), FLT)))
                dl = _two(b, *dls)
            vals = b.fadd(b.sitofp(_grid_rows(b, tab, idx, 8), V), delta)
            out.append((32 * g, b.fmul(dl, vals)))
        return out
    raise KeyError(name)
