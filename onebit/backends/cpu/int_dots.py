"""Integer dot products on int16 activations (IDOT1 / .. / IDOT8[type], for INT_TYPES): the
activations rounded to int16 per block of 32 (`quantize_acts`), the weights' integer products
summed exactly in int32 and scaled once per block; on AVX-512 VNNI (VNNI, VNNI_TYPES) through
the activations' byte planes and vpdpbusd; the others (and every type without VNNI: AVX2) through
pmaddwd, with the pair sums folded (FOLD) and the weights prefetched (PREFETCH_AHEAD), and
without VNNI Q4_K's quants read as words (EO_TYPES). The comments below say why 16-bit and what each path measured."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils

from ...formats.quants import QTYPES_BY_NAME, iq4_values
from .base import cached
from .ir_blocks import (FAST, FLT, I16, I32, I64, I8, IQ_INT, W, _const, _e8m0_half, _f16, _hsum, _iq_quants,
                        _ivec, _k_quants, _load, _nibbles, _q5_bytes, _q6_quants, _splat, _two, _u32i, _v8, _vec)
from .float_dots import _intrinsic_of
from .target import has_vnni


# -- integer dot products on 16-bit activations ----------------------------------------------
# For the common quantized types (INT_TYPES: the legacy 32-weight blocks and the K types people
# run) a weight row is dotted with activations rounded to int16 per block of 32 (a
# float32 scale d = max|x| / 32767 per block, and m = d * sum of the block's int16 values for
# the types whose weights carry an offset): the integer products of 32 weights
# sum exactly in int32 (pairs of 16-bit products: x86's pmaddwd, which LLVM selects from the IR
# below), then one float multiply-add per 32 weights applies the weight's and the activation's
# scales. Per 32 weights that is 5-6 vector operations where the float32 path (`_groups`) takes
# 10-12 (convert every weight to float, scale it, subtract the minimum, fused multiply-add).
# Why 16-bit and not 8-bit activations (what llama.cpp does): an activation rounded to 1/32767
# of its block's largest value moves a dot product by about 1e-5 of its size, as close to the
# float32 results as float32 summation order is, so every oracle bar held to float32 still
# holds; 8-bit rounding moves llama.cpp's logits to cosine 0.988-0.999 against float32
# (tests/test_oracle.py, BELOW_BAR). Measured on the 2-core VM (one thread, 1 MiB of Q4_K
# rows, so compute-bound): float32 6.6 GB/s, int16 11.3, int8 (AVX-512 VNNI) 15.3. The codebook
# types stay on the float32 path, and MXFP4 does without VNNI: its int16 form (selects over 32
# lanes) measured 0.82-0.94x its float32 decode (bench/bench_roofline.py); on VNNI see below.

A = 32  # activations per int16 block (one float32 scale each)
# Where a group's 32 products share one scale (every INT_TYPES type but Q6_K), the
# 16 pair sums of pmaddwd fold to 8 in int32 (4 products a lane, exact, below 2^24 so exact
# as float too) before the conversion and the multiply-add, each half the vector work, into
# two accumulators a row (a block's even and odd groups: two dependency chains, as the 16
# lanes' two registers were). On VNNI too (the int16 path: Q8_0, Q4_1, Q5_1), with the weights
# asked for ahead (PREFETCH_AHEAD) below FOLD_ROWS rows (decode; prefetching changes no bits):
# Gemma 3 270M's tied Q8_0 output head (262144 x 640 rows), `bench_roofline.py --types Q8_0`,
# decode 12.2 -> 6.6 ms, 0.48 -> 0.91 of memory (the AVX2 build ran it in 6.9 ms).
FOLD = True
FOLD_ROWS = 8
# Without VNNI, Q4_K (EO_TYPES) takes its weights as 16-bit words: the word of bytes 2m and
# 2m + 1 gives the even byte's nibbles and the odd byte's with shifts and masks alone (vpsrlw,
# vpand: any ALU port), where widening bytes to int16 lanes (vpmovzxbw, vextracti128) ran on
# the one shuffle port of Intel cores (about 36 of the 130 instructions of a block of the AVX2
# row dot). The weights of a block of 32 then come as the 16 even ones and the 16 odd ones, and
# so do the activations of `quantize_acts`' second copy (EO order: a block's values 0, 2, ..,
# 30, then 1, 3, .., 31): the same integer products, summed exactly. AVX2, one thread, 256 x
# 1024 rows in cache: 14.9 -> 13.7 us. Q8_0 (sign-extending shifts) and Q6_K (its fifth and
# sixth bits shifted in 16-bit lanes: twice the byte lanes' work) measured 9% and 5% slower
# this way and keep their bytes widened.
EO_TYPES = () if has_vnni() else ("Q4_K",)
# Without VNNI the int16 row dots ask for the weights PREFETCH_AHEAD bytes ahead of the block
# they read: the hardware prefetcher alone left one thread's row dot waiting on memory (AVX2,
# one thread, Q4_K rows of a 147 KiB matrix not in cache, a different one each call: 25.9 us
# against 13.7 in cache; with 2048 bytes ahead 14.9; 512: 17.4, 1024: 16.1, 4096: 16.8).
PREFETCH_AHEAD = 2048
# int16 slots after each row of quantize_acts' q, never read: rows a power of two of bytes apart
# put the same column of 8 rows (a prompt's group) in one set of the 8-way L1 cache, and with
# the byte planes 16 lines took turns in one set (K = 4096: the prompt's products ran at 45-75
# GFLOP/s against 110-130 at K = 2048)
ROW_PAD = 32
ACT_MAX = 32767.0


# Q4_K and Q5_K on AVX-512 VNNI: the int16 activation v is split exactly as v = 256 hi + lo
# (hi: its signed high byte, lo: its unsigned low byte; `quantize_acts` stores both planes
# after the int16 values), and a weight vector of 64 unsigned quants meets each plane in one
# vpdpbusd (64 byte products summed four to an int32 lane): sum q v = 256 sum q hi + sum q lo,
# the same integer as the int16 path's, in half the vector operations, and the float
# conversion once per 64 weights (two sub-blocks, a scale per half of the lanes) instead of
# per 32. Q6_K's quants are stored unsigned (q = u - 32): the products take u, and the 32 x
# sum of each 16 activations it owes (`quantize_acts` keeps those sums) comes off with the
# scales. Q8_0's weights are signed (vpdpbusd wants one unsigned side): int16 path.
VNNI = has_vnni()  # (the compile target's features, target.py: not the host's)
VNNI_TYPES = ("Q4_K", "Q5_K", "Q6_K", "MXFP4", "Q4_0", "Q5_0", "IQ4_NL", "IQ4_XS") if VNNI else ()


# The 32-weight nibble types on VNNI (PAIRS), two blocks (64 weights) to a step: each quant
# becomes an unsigned byte, the level it stands for plus a constant c (MXFP4: its doubled
# e2m1 value + 12 through a vpshufb table; IQ4_NL: its level + 128 through a table; Q4_0 and
# Q5_0: the stored 0..15 / 0..31 as they are, c = 8 / 16), and c x each block's activation sum
# comes off with the scales. IQ4_XS is IQ4_NL's levels in 256-weight blocks with a 6-bit scale
# per 32. Without VNNI these types keep the paths above.
PAIRS = {"MXFP4": 12, "Q4_0": 8, "Q5_0": 16, "IQ4_NL": 128}  # type -> c
INT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K") + (
    ("MXFP4", "IQ4_NL", "IQ4_XS") if VNNI else ()) + IQ_INT
# The types whose groups of 32 weights take two scales (one per 16): their pair sums keep 16 lanes.
TWO_SCALES = ("Q6_K", "IQ2_XS", "IQ2_S")
MXFP4_PLUS12 = [int(v) + 12 for v in (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)]
IQ4_PLUS128 = [int(v) + 128 - (256 if int(v) + 128 > 127 else 0) for v in iq4_values()]  # (as signed bytes)


def _pshufb(b, table16, idx):
    """<64 x i8>: table16[idx[i]] for indices 0..15 (vpshufb, the 16-byte table in every lane)."""
    ty = _vec(I8, 64)
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ty, [ty, ty]), "llvm.x86.avx512.pshuf.b.512")
    return b.call(fn, [ir.Constant(ty, table16 * 4), idx])


def _dpbusd(b, acc, u8, s8):
    """<16 x i32> acc + (sums of 4 products of unsigned bytes u8 and signed bytes s8)."""
    fnty = ir.FunctionType(_vec(I32, 16), [_vec(I32, 16), _vec(I8, 64), _vec(I8, 64)])
    fn = cgutils.get_or_insert_function(b.module, fnty, "llvm.x86.avx512.vpdpbusd.512")
    return b.call(fn, [acc, u8, s8])


def _plane_dot(b, w64, lo_p, hi_p, k):
    """<16 x i32>: 64 unsigned weight quants w64 . the int16 activations k.. k + 63, through their
    byte planes at lo_p, hi_p: 256 (w . hi) + (w . lo), four products to a lane (see VNNI)."""
    lo, hi = _load(b, lo_p, k, _vec(I8, 64)), _load(b, hi_p, k, _vec(I8, 64))
    high = _dpbusd(b, ir.Constant(_vec(I32, 16), [0] * 16), w64, hi)
    return _dpbusd(b, b.shl(high, ir.Constant(_vec(I32, 16), [8] * 16)), lo, w64)


def _pairs(b, w16, x16):
    """<32 x i16> . <32 x i16> -> <16 x i32>, lane k = w[2k] x[2k] + w[2k+1] x[2k+1] (pmaddwd)."""
    p = b.mul(b.sext(w16, _vec(I32)), b.sext(x16, _vec(I32)))
    even = b.shuffle_vector(p, p, _ivec(range(0, W, 2)))
    odd = b.shuffle_vector(p, p, _ivec(range(1, W, 2)))
    return b.add(even, odd)


def _k_scales(b, blk):
    """Q4_K / Q5_K: the 6-bit scales and mins of the 8 sub-blocks (12 bytes at blk + 4), as
    <8 x float> each (`_ir_scale_min_k4`, all 8 at once)."""
    s = b.zext(_load(b, blk, 4, _vec(I8, 12)), _vec(I32, 12))
    pick = lambda idx: b.shuffle_vector(s, s, _ivec(idx))  # noqa: E731
    c = lambda v: _ivec([v] * 8)  # noqa: E731
    first = ir.Constant(_vec(ir.IntType(1), 8), [1] * 4 + [0] * 4)  # sub-blocks 0-3
    a, a_hi = pick([0, 1, 2, 3, 8, 9, 10, 11]), pick([0, 0, 0, 0, 0, 1, 2, 3])
    m, m_hi = pick([4, 5, 6, 7, 8, 9, 10, 11]), pick([0, 0, 0, 0, 4, 5, 6, 7])
    sc = b.select(first, b.and_(a, c(63)), b.or_(b.and_(a, c(15)), b.shl(b.lshr(a_hi, c(6)), c(4))))
    mn = b.select(first, b.and_(m, c(63)), b.or_(b.lshr(m, c(4)), b.shl(b.lshr(m_hi, c(6)), c(4))))
    return b.uitofp(sc, _vec(FLT, 8)), b.uitofp(mn, _vec(FLT, 8))


def _igroups(b, name, blk):
    """One block of an INT_TYPES type at byte pointer blk, as integers: ([(first weight, <32 x
    i16> weights, scale)], scales, offsets). scale: a float (the group's), or, where `scales` is
    given (<8 x float>, Q4_K and Q5_K: the 8 sub-blocks' scales; <16 x float>, Q6_K: the 16
    scales of its groups of 16), the group's lane in it (Q4_K, Q5_K) or the lane of each of the
    16 pair lanes (Q6_K: two scales per group); offsets: what each block of 32 adds to
    every weight (weight = scale * q + offset), a float (one block) or <8 x float> (Q4_K, Q5_K:
    minus the 8 sub-blocks' minimums), or None."""
    V16 = _vec(I16)
    if name in EO_TYPES:
        return _eo_groups(b, name, blk)
    if name in ("Q4_1", "Q5_0", "Q5_1"):
        q = b.zext(_q5_bytes(b, name, blk), V16)
        if name == "Q5_0":
            return [(0, b.sub(q, ir.Constant(V16, [16] * W)), _f16(b, blk, 0))], None, None
        return [(0, q, _f16(b, blk, 0))], None, _f16(b, blk, 2)
    if name == "Q8_0":
        return [(0, b.sext(_load(b, blk, 2, _vec(I8)), V16), _f16(b, blk, 0))], None, None
    if name == "Q4_0":
        q = b.sub(_nibbles(b, _load(b, blk, 2, _vec(I8, 16))), _v8(8))
        return [(0, b.sext(q, V16), _f16(b, blk, 0))], None, None
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b, blk, 0), _f16(b, blk, 2)
        sc, mn = _k_scales(b, blk)
        scales = b.fmul(_splat(b, d, 8), sc)
        out = [(32 * sub, b.zext(nib, V16), sub) for sub, nib in _k_quants(b, name, blk)]
        return out, scales, b.fneg(b.fmul(_splat(b, dmin, 8), mn))
    if name == "Q6_K":  # d x the 16 int8 scales in one vector (16 scalar conversions were a quarter of the work)
        sc = b.fmul(_splat(b, _f16(b, blk, 208), 16), b.sitofp(_load(b, blk, 192, _vec(I8, 16)), _vec(FLT, 16)))
        return [(off, b.sext(q, V16), [off // 16] * 8 + [off // 16 + 1] * 8)
                for off, q, _, _ in _q6_quants(b, blk)], sc, None
    if name in IQ_INT:  # a block's 8 scales (IQ2_XS, IQ2_S: 16, as Q6_K's) at once
        groups, scales = _iq_quants(b, name, blk)
        return [(off, b.sext(q, V16), lanes) for off, q, lanes in groups], scales, None
    raise ValueError(name)


def _prefetch(b, blk, ts):
    """Ask for the cache lines of the block PREFETCH_AHEAD bytes after the one at blk (a row's
    next rows follow it: past the matrix's end a prefetch reads nothing and cannot fault)."""
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ir.VoidType(), [ir.PointerType(I8), I32, I32, I32]),
                                        "llvm.prefetch.p0i8")
    for line in range(0, ts, 64):
        b.call(fn, [b.gep(blk, [_const(I64, PREFETCH_AHEAD + line)]), _const(I32, 0), _const(I32, 3), _const(I32, 1)])


def _eo_groups(b, name, blk):
    """`_igroups` of an EO_TYPES type (Q4_K), each group's <32 x i16> weights in EO order (the
    even bytes' quants, then the odd bytes'), from the quant bytes read as 16-bit words: 32
    bytes hold sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles)."""
    assert name == "Q4_K"
    V16 = _vec(I16, 16)
    c = lambda v: ir.Constant(V16, [v] * 16)  # noqa: E731
    d, dmin = _f16(b, blk, 0), _f16(b, blk, 2)
    sc, mn = _k_scales(b, blk)
    out = []
    for j in range(4):
        w = _load(b, blk, 16 + 32 * j, V16)
        low = b.shuffle_vector(b.and_(w, c(15)), b.and_(b.lshr(w, c(8)), c(15)), _ivec(range(32)))
        high = b.shuffle_vector(b.and_(b.lshr(w, c(4)), c(15)), b.lshr(w, c(12)), _ivec(range(32)))
        out += [(64 * j, low, 2 * j), (64 * j + 32, high, 2 * j + 1)]
    return out, b.fmul(_splat(b, d, 8), sc), b.fneg(b.fmul(_splat(b, dmin, 8), mn))


def _vnni_k_block(b, name, blk, i, planes, xd, xm, accs, oaccs):
    """One Q4_K / Q5_K block (blk, the i-th of the row) into the rows' accumulators, through the
    activations' byte planes: 4 x 64 weights, two sub-blocks each (see VNNI)."""
    V16F, V8F = _vec(FLT, 16), _vec(FLT, 8)
    d, dmin = _f16(b, blk, 0), _f16(b, blk, 2)
    sc, mn = _k_scales(b, blk)
    scales, offsets = b.fmul(_splat(b, d, 8), sc), b.fneg(b.fmul(_splat(b, dmin, 8), mn))
    quants = dict(_k_quants(b, name, blk))  # sub-block -> <32 x i8>, 0..15 / 0..31
    first, sub0 = b.mul(i, _const(I64, 256)), b.mul(i, _const(I64, 8))
    sdx = [b.fmul(scales, _load(b, dx, sub0, V8F, align=4)) for dx in xd]
    for j in range(4):
        wv = b.shuffle_vector(quants[2 * j], quants[2 * j + 1], _ivec(range(64)))  # <64 x i8>
        k = b.add(first, _const(I64, 64 * j))
        for r, ((lo_p, hi_p), acc) in enumerate(zip(planes, accs)):
            isum = _plane_dot(b, wv, lo_p, hi_p, k)
            sv = b.shuffle_vector(sdx[r], sdx[r], _ivec([2 * j] * 8 + [2 * j + 1] * 8))
            b.store(b.fadd(b.load(acc), b.fmul(b.sitofp(isum, V16F), sv, flags=FAST), flags=FAST), acc)
    for mx, oacc in zip(xm, oaccs):
        b.store(b.fadd(b.load(oacc), b.fmul(offsets, _load(b, mx, sub0, V8F, align=4))), oacc)


def _nibble_weights(b, name, q32, fifth=None):
    """32 quant bytes of two blocks (low nibbles: weights 0-15, high: 16-31 of each) -> <64 x i8>
    unsigned weights in order (see PAIRS); fifth: Q5_0's <64 x i1> fifth bits."""
    lo, hi = b.and_(q32, _v8(15)), b.lshr(q32, _v8(4))
    v = b.shuffle_vector(lo, hi, _ivec(list(range(16)) + list(range(32, 48)) + list(range(16, 32)) + list(range(48, 64))))
    if name == "MXFP4":
        return _pshufb(b, MXFP4_PLUS12, v)
    if name in ("IQ4_NL", "IQ4_XS"):
        return _pshufb(b, IQ4_PLUS128, v)
    if fifth is not None:
        v = b.or_(v, b.shl(b.zext(fifth, _vec(I8, 64)), ir.Constant(_vec(I8, 64), [4] * 64)))
    return v


def _pair_step(b, k, s, wv, ds, loads, planes, xd, xm, accs, oaccs, wide=False):
    """64 weights wv (two blocks of 32 with scales ds; one block, ds of one, and zero padding)
    against the activations from index k (block s) of each row: the integer products through
    the byte planes into accs, each block's weight scale x activation sum into oaccs. `wide`:
    weights over 127 (IQ4's level + 128), which the low plane's unsigned bytes cannot meet as
    the signed side: it meets them as lo - 128 (signed), and 128 x each lane's weights come back."""
    V16I = _vec(I32, 16)
    zero, eight = ir.Constant(V16I, [0] * 16), ir.Constant(V16I, [8] * 16)
    V2F, two = _vec(FLT, 2), len(ds) == 2
    wsc = _two(b, ds[0], ds[-1], 16)  # the weight scale of each lane
    dsv = b.insert_element(b.insert_element(ir.Constant(V2F, [0.0, 0.0]), ds[0], _const(I32, 0)),
                           ds[-1] if two else ir.Constant(FLT, 0.0), _const(I32, 1))
    if wide:
        back = b.shl(_dpbusd(b, zero, wv, ir.Constant(_vec(I8, 64), [1] * 64)), ir.Constant(V16I, [7] * 16))
    for r, ((lo_p, hi_p), dx, mx, acc, oacc) in enumerate(zip(planes, xd, xm, accs, oaccs)):
        lo, hi = loads(lo_p, k), loads(hi_p, k)
        high = b.shl(_dpbusd(b, zero, wv, hi), eight)
        if wide:
            isum = b.add(_dpbusd(b, high, wv, b.xor(lo, ir.Constant(_vec(I8, 64), [-128] * 64))), back)
        else:
            isum = _dpbusd(b, high, lo, wv)
        if two:  # both blocks' activation scales and sums in one load each
            dxv, mv = _load(b, dx, s, V2F, align=4), _load(b, mx, s, V2F, align=4)
        else:
            dxv = b.insert_element(ir.Constant(V2F, [0.0, 0.0]), _load(b, dx, s, FLT, align=4), _const(I32, 0))
            mv = b.insert_element(ir.Constant(V2F, [0.0, 0.0]), _load(b, mx, s, FLT, align=4), _const(I32, 0))
        sv = b.fmul(wsc, b.shuffle_vector(dxv, dxv, _ivec([0] * 8 + [1] * 8)))
        b.store(b.fadd(b.load(acc), b.fmul(b.sitofp(isum, _vec(FLT, 16)), sv, flags=FAST), flags=FAST), acc)
        b.store(b.fadd(b.load(oacc), b.fmul(dsv, mv)), oacc)  # <2 x float>: each block's scale x sum


def _vnni_pairs(b, name, wdata, nb, planes, xd, xm, accs, oaccs):
    """A row of nb blocks of a PAIRS type at wdata into the rows' accumulators, two blocks a
    step, an odd last block alone; oaccs gather each block's weight scale x its activations'
    scale x sum, which the caller multiplies by -PAIRS[name]."""
    ts = QTYPES_BY_NAME[name].type_size
    qs = {"MXFP4": 1, "Q4_0": 2, "Q5_0": 6, "IQ4_NL": 2}[name]
    scale = (lambda blk: _e8m0_half(b, blk)) if name == "MXFP4" else (lambda blk: _f16(b, blk, 0))  # noqa: E731
    bits = lambda blk: b.bitcast(_u32i(b, blk, 2), _vec(ir.IntType(1), 32))  # noqa: E731  (Q5_0's fifth bits)
    wide = name == "IQ4_NL"
    with cgutils.for_range(b, b.udiv(nb, _const(I64, 2))) as loop:
        blk = b.gep(wdata, [b.mul(loop.index, _const(I64, 2 * ts))])
        blk2 = b.gep(blk, [_const(I64, ts)])
        q = b.shuffle_vector(_load(b, blk, qs, _vec(I8, 16)), _load(b, blk2, qs, _vec(I8, 16)), _ivec(range(32)))
        fifth = b.shuffle_vector(bits(blk), bits(blk2), _ivec(range(64))) if name == "Q5_0" else None
        _pair_step(b, b.mul(loop.index, _const(I64, 64)), b.mul(loop.index, _const(I64, 2)),
                   _nibble_weights(b, name, q, fifth), [scale(blk), scale(blk2)],
                   lambda p, k: _load(b, p, k, _vec(I8, 64)), planes, xd, xm, accs, oaccs, wide)
    last = b.sub(nb, _const(I64, 1))
    with b.if_then(b.icmp_unsigned("!=", b.and_(nb, _const(I64, 1)), _const(I64, 0))):
        blk = b.gep(wdata, [b.mul(last, _const(I64, ts))])
        q = b.shuffle_vector(_load(b, blk, qs, _vec(I8, 16)), ir.Constant(_vec(I8, 16), [0] * 16), _ivec(range(32)))
        none = ir.Constant(_vec(ir.IntType(1), 32), [0] * 32)
        fifth = b.shuffle_vector(bits(blk), none, _ivec(range(64))) if name == "Q5_0" else None
        pad = ir.Constant(_vec(I8, 32), [0] * 32)  # (the padding's activations are zero)
        _pair_step(b, b.mul(last, _const(I64, 32)), last, _nibble_weights(b, name, q, fifth), [scale(blk)],
                   lambda p, k: b.shuffle_vector(_load(b, p, k, _vec(I8, 32)), pad, _ivec(range(64))),
                   planes, xd, xm, accs, oaccs, wide)


def _vnni_iq4xs_block(b, blk, i, planes, xd, xm, accs, oaccs):
    """One IQ4_XS block (256 weights: f16 d, the 6-bit scales' high bits in a u16 and low
    nibbles in 4 bytes, then 8 x 16 quant bytes) as four pair steps, sub-block j's scale
    d x (its 6-bit scale - 32) (see PAIRS)."""
    d = _f16(b, blk, 0)
    high = b.zext(_load(b, blk, 2, I16), I32)
    scales = []
    for j in range(8):
        low = b.and_(b.lshr(b.zext(_load(b, blk, 4 + j // 2, I8), I32), _const(I32, 4 * (j % 2))), _const(I32, 15))
        ls = b.or_(low, b.shl(b.and_(b.lshr(high, _const(I32, 2 * j)), _const(I32, 3)), _const(I32, 4)))
        scales.append(b.fmul(d, b.sitofp(b.sub(ls, _const(I32, 32)), FLT)))
    for t in range(4):
        q = _load(b, blk, 8 + 32 * t, _vec(I8))
        k = b.add(b.mul(i, _const(I64, 256)), _const(I64, 64 * t))
        s = b.add(b.mul(i, _const(I64, 8)), _const(I64, 2 * t))
        _pair_step(b, k, s, _nibble_weights(b, "IQ4_XS", q), scales[2 * t : 2 * t + 2],
                   lambda p, k: _load(b, p, k, _vec(I8, 64)), planes, xd, xm, accs, oaccs, True)


def _vnni_q6_block(b, blk, i, planes, xd, xs, accs, oaccs):
    """One Q6_K block into the rows' accumulators through the byte planes (see VNNI): the
    stored quants u = q + 32, 64 to an instruction; oaccs gather d x scale x dx x (sum of the
    16 activations) per group of 16, which the caller multiplies by -32."""
    V16F = _vec(FLT, 16)
    d = _f16(b, blk, 208)
    sc = b.fmul(_splat(b, d, 16), b.sitofp(_load(b, blk, 192, _vec(I8, 16)), V16F))  # d x the 16 scales
    first, sub0 = b.mul(i, _const(I64, 256)), b.mul(i, _const(I64, 8))
    groups = list(_q6_quants(b, blk, signed=False))  # (first weight, u, ..) of the 8 groups of 32, in order
    dx8 = [_load(b, dx, sub0, _vec(FLT, 8), align=4) for dx in xd]
    for j in range(4):  # weights 64 j .. 64 j + 63: groups of 16 number 4 j .. 4 j + 3
        (o0, u0, _, _), (o1, u1, _, _) = groups[2 * j], groups[2 * j + 1]
        assert (o0, o1) == (64 * j, 64 * j + 32)
        uv = b.shuffle_vector(u0, u1, _ivec(range(64)))
        k = b.add(first, _const(I64, 64 * j))
        lane_sc = b.shuffle_vector(sc, sc, _ivec([4 * j + t // 4 for t in range(16)]))  # a scale per 16 weights = 4 lanes
        for r, ((lo_p, hi_p), acc) in enumerate(zip(planes, accs)):
            isum = _plane_dot(b, uv, lo_p, hi_p, k)
            dxv = b.shuffle_vector(dx8[r], dx8[r], _ivec([2 * j] * 8 + [2 * j + 1] * 8))
            b.store(b.fadd(b.load(acc), b.fmul(b.sitofp(isum, V16F), b.fmul(lane_sc, dxv), flags=FAST), flags=FAST),
                    acc)
    for r, (x16, oacc) in enumerate(zip(xs, oaccs)):
        dxg = b.shuffle_vector(dx8[r], dx8[r], _ivec([g // 2 for g in range(16)]))  # dx of each group's block of 32
        sums = _load(b, x16, b.mul(i, _const(I64, 16)), V16F, align=4)
        b.store(b.fadd(b.load(oacc), b.fmul(b.fmul(sc, dxg), sums)), oacc)


def _make_idot(name: str, rows: int):
    """Intrinsic idot(w, q, d, m, r0, ..): weight row w (raw bytes of type `name`) . activation
    rows r0.. of (q, d, m) = quantize_acts(x), each as float32. A row's sum is the same whatever
    rows share the call."""
    qt = QTYPES_BY_NAME[name]
    bs, ts = qt.block_size, qt.type_size
    subs = bs // A

    def codegen(context, builder, sig, args):
        b = builder
        w = context.make_array(sig.args[0])(context, b, args[0])
        qa, da, ma = (context.make_array(t)(context, b, a) for t, a in zip(sig.args[1:4], args[1:4]))
        k_len = b.extract_value(qa.shape, 1)
        nblk = b.extract_value(da.shape, 1)
        xq = [b.gep(qa.data, [b.mul(r, k_len)]) for r in args[4:]]
        xd = [b.gep(da.data, [b.mul(r, nblk)]) for r in args[4:]]
        mrow = b.extract_value(ma.shape, 1)  # 3 nblk: the blocks' scale x sum, then each 16's sum
        xm = [b.gep(ma.data, [b.mul(r, mrow)]) for r in args[4:]]
        xs = [b.gep(m, [nblk]) for m in xm]
        nb = b.udiv(b.extract_value(w.shape, 0), _const(I64, ts))
        V16F, V8F = _vec(FLT, 16), _vec(FLT, 8)
        per_block = name in ("Q4_1", "Q5_1")  # one offset per block of 32; Q4_K, Q5_K: 8 per block
        accs = [cgutils.alloca_once_value(b, ir.Constant(V16F, [0.0] * 16)) for _ in xq]
        vq6 = name == "Q6_K" and name in VNNI_TYPES  # (its offsets: a <16 x float> per row)
        vpair = name in VNNI_TYPES and (name in PAIRS or name == "IQ4_XS")  # (a float offset per row)
        if per_block:
            zero = ir.Constant(FLT, 0.0)
        elif vpair:  # (a pair of blocks' offsets)
            zero = ir.Constant(_vec(FLT, 2), [0.0, 0.0])
        else:
            zero = ir.Constant(_vec(FLT, 16 if vq6 else 8), [0.0] * (16 if vq6 else 8))
        oaccs = [cgutils.alloca_once_value(b, zero) for _ in xq]
        # (Q6_K: two scales to a group)
        fold = FOLD and name not in VNNI_TYPES and name not in TWO_SCALES
        if fold:  # a row's two accumulators, of a block's even and odd groups
            halves = [[cgutils.alloca_once_value(b, ir.Constant(V8F, [0.0] * 8)) for _ in range(2)] for _ in xq]
        if name in EO_TYPES:  # the values in EO order (quantize_acts): K values into the row
            xeo = [b.gep(x, [b.mul(nblk, _const(I64, A))]) for x in xq]
        if name in VNNI_TYPES:  # the byte planes (quantize_acts): lo at 2K bytes into the row, hi at 3K
            kk = b.mul(nblk, _const(I64, A))
            xb = [b.bitcast(x, ir.PointerType(I8)) for x in xq]
            planes = [(b.gep(x, [b.mul(kk, _const(I64, 2))]), b.gep(x, [b.mul(kk, _const(I64, 3))])) for x in xb]

        def int16_block(i, parity):  # block i of the row, its groups' accumulators from parity on
            # (parity: 0 or 1, or an i1 value, block i's own: a row's sums then take the same
            # order whatever the rows dotted with it, two blocks a step or one)
            blk = b.gep(w.data, [b.mul(i, _const(I64, ts))])
            if not VNNI or rows < FOLD_ROWS:  # (see PREFETCH_AHEAD)
                _prefetch(b, blk, ts)
            groups, scales, offsets = _igroups(b, name, blk)
            first = b.mul(i, _const(I64, bs))
            sub0 = b.mul(i, _const(I64, subs))
            if scales is not None:  # each scale x its block's activation scale, 8 or 16 at once
                n = scales.type.count  # (Q6_K: two scales to each block of 32)
                sdx = [b.fmul(scales, b.shuffle_vector(x8, x8, _ivec([k * 8 // n for k in range(n)])))
                       for x8 in (_load(b, dx, sub0, V8F, align=4) for dx in xd)]
            for g, (off, wq, scale) in enumerate(groups):
                k = b.add(first, _const(I64, off))
                s = b.add(sub0, _const(I64, off // A))
                for r, (x, dx, acc) in enumerate(zip(xq, xd, accs)):
                    isum = _pairs(b, wq, _load(b, xeo[r] if name in EO_TYPES else x, k, _vec(I16), align=2))
                    if scales is not None:
                        lanes = scale if isinstance(scale, list) else [scale] * 16
                        sv = b.shuffle_vector(sdx[r], sdx[r], _ivec(lanes[:8] if fold else lanes))
                    else:
                        sv = _splat(b, b.fmul(scale, _load(b, dx, s, FLT, align=4)), 8 if fold else 16)
                    if fold:
                        isum = b.add(b.shuffle_vector(isum, isum, _ivec(range(8))),
                                     b.shuffle_vector(isum, isum, _ivec(range(8, 16))))
                        acc = (halves[r][(g + parity) % 2] if isinstance(parity, int)
                               else b.select(parity, halves[r][(g + 1) % 2], halves[r][g % 2]))
                    fsum = b.sitofp(isum, _vec(FLT, sv.type.count))
                    b.store(b.fadd(b.load(acc), b.fmul(fsum, sv, flags=FAST), flags=FAST), acc)
            if offsets is not None:
                for mx, oacc in zip(xm, oaccs):
                    mv = _load(b, mx, sub0, FLT if per_block else V8F, align=4)
                    b.store(b.fadd(b.load(oacc), b.fmul(offsets, mv)), oacc)

        if vpair and name != "IQ4_XS":
            _vnni_pairs(b, name, w.data, nb, planes, xd, xm, accs, oaccs)
        elif fold and subs == 1 and rows < 8:  # one group a block: two blocks a step, one on each
            # accumulator (8 rows are 8 chains already: with 16 accumulators Gemma 3 270M's prompt
            # of 32 took 339-359 ms of one thread, against 319-335 with 8, alternating)
            with cgutils.for_range(b, b.udiv(nb, _const(I64, 2))) as loop:
                for parity in range(2):
                    int16_block(b.add(b.mul(loop.index, _const(I64, 2)), _const(I64, parity)), parity)
            with b.if_then(b.icmp_unsigned("!=", b.and_(nb, _const(I64, 1)), _const(I64, 0))):
                int16_block(b.sub(nb, _const(I64, 1)), 0)
        else:
            with cgutils.for_range(b, nb) as loop:
                i = loop.index
                blk = b.gep(w.data, [b.mul(i, _const(I64, ts))])
                if vq6:
                    _vnni_q6_block(b, blk, i, planes, xd, xs, accs, oaccs)
                elif vpair:
                    _vnni_iq4xs_block(b, blk, i, planes, xd, xm, accs, oaccs)
                elif name in VNNI_TYPES:
                    _vnni_k_block(b, name, blk, i, planes, xd, xm, accs, oaccs)
                else:  # (one group a block: even blocks on one accumulator, odd on the other, as above)
                    int16_block(i, b.trunc(i, ir.IntType(1)) if fold and subs == 1 else 0)
        if fold:
            sums = [_hsum(b, b.fadd(b.load(h0), b.load(h1), flags=FAST), 8) for h0, h1 in halves]
        else:
            sums = [_hsum(b, b.load(acc), 16) for acc in accs]
        if name in ("Q4_1", "Q5_1"):
            sums = [b.fadd(s, b.load(oacc)) for s, oacc in zip(sums, oaccs)]
        elif name in ("Q4_K", "Q5_K"):
            sums = [b.fadd(s, _hsum(b, b.load(oacc), 8)) for s, oacc in zip(sums, oaccs)]
        elif vpair:  # weights + c: minus c x each block's scaled activation sum
            c = _const(FLT, float(PAIRS.get(name, 128)))
            sums = [b.fsub(s, b.fmul(c, _hsum(b, b.load(oacc), 2))) for s, oacc in zip(sums, oaccs)]
        elif vq6:  # q = u - 32: minus 32 x each group's scaled activation sum
            sums = [b.fsub(s, b.fmul(_const(FLT, 32.0), _hsum(b, b.load(oacc), 16))) for s, oacc in zip(sums, oaccs)]
        return sums[0] if rows == 1 else context.make_tuple(b, sig.return_type, sums)

    def typer(typingctx, w, q, d, m, *rs):
        ok = (isinstance(w, types.Array) and w.ndim == 1 and w.dtype == types.uint8 and w.layout == "C"
              and isinstance(q, types.Array) and q.ndim == 2 and q.dtype == types.int16 and q.layout == "C"
              and all(isinstance(a, types.Array) and a.ndim == 2 and a.dtype == types.float32 and a.layout == "C"
                      for a in (d, m))
              and all(isinstance(r, types.Integer) for r in rs))
        if not ok:
            return None
        ret = types.float32 if rows == 1 else types.UniTuple(types.float32, rows)
        return ret(w, q, d, m, *([types.int64] * rows)), codegen

    return _intrinsic_of(typer, "w, q, d, m", [f"r{i}" for i in range(rows)], f"idot{rows}_{name.lower()}")


IDOT1 = {n: _make_idot(n, 1) for n in INT_TYPES}
IDOT2 = {n: _make_idot(n, 2) for n in INT_TYPES}
IDOT4 = {n: _make_idot(n, 4) for n in INT_TYPES}
IDOT8 = {n: _make_idot(n, 8) for n in INT_TYPES}


@cached(nogil=True)
def quantize_acts(x):
    """float32 rows x [R, K] (K a multiple of 32) -> (q, d, m) of `_make_idot`: per block of 32,
    d = max|x| / 32767, q = round(x / d), m = d * sum(q). A block holding inf or nan gets d = nan
    (its products come out nan, as float32 ones would be inf or nan). With VNNI, q is [R, 2K +
    ROW_PAD]: the int16 values, then (as bytes) every value's low byte and high byte, two planes
    of K (without, [R, 2K + ROW_PAD]: the values, then the same in EO order, see EO_TYPES); m
    is [R, 4 K / 32]: the blocks' d x sum(q), then the sum of q over each 16 values, then (with
    VNNI) the blocks' d x the sum of their high bytes (IQ4_XS_X16's correction, see there)."""
    R, K = x.shape
    nb = K // A
    q = np.empty((R, 2 * K + ROW_PAD), np.int16)  # [R, K] values, then their byte planes (VNNI) or EO order
    planes = q.view(np.uint8)  # lo = v & 255 at byte 2K + k of a row, hi = v >> 8 at 3K + k
    d = np.empty((R, nb), np.float32)
    m = np.empty((R, 4 * nb), np.float32)  # [R, nb] scale x sum, [R, 2 nb] each 16 values' sum (exact), [R, nb]
    for r in range(R):
        for j in range(nb):
            xb = x[r, j * A : (j + 1) * A]
            amax = np.float32(0)
            finite = True
            for t in range(A):
                v = abs(xb[t])
                if not v <= np.float32(3.0e38):
                    finite = False
                elif v > amax:
                    amax = v
            s = 0
            sh = 0  # (the high bytes' sum)
            if finite and amax > 0:
                inv = np.float32(ACT_MAX) / amax
                for t in range(A):
                    v = np.int16(np.rint(xb[t] * inv))
                    q[r, j * A + t] = v
                    if VNNI:
                        planes[r, 2 * K + j * A + t] = np.uint8(v & 255)
                        planes[r, 3 * K + j * A + t] = np.uint8((v >> 8) & 255)
                        sh += v >> 8
                    else:
                        q[r, K + j * A + t // 2 + A // 2 * (t % 2)] = v
                    s += v
                    if t == A // 2 - 1:
                        m[r, nb + 2 * j] = np.float32(s)
                m[r, nb + 2 * j + 1] = np.float32(s) - m[r, nb + 2 * j]
                d[r, j] = amax / np.float32(ACT_MAX)
            else:
                q[r, j * A : (j + 1) * A] = 0
                if VNNI:
                    planes[r, 2 * K + j * A : 2 * K + (j + 1) * A] = 0
                    planes[r, 3 * K + j * A : 3 * K + (j + 1) * A] = 0
                else:
                    q[r, K + j * A : K + (j + 1) * A] = 0
                d[r, j] = np.float32(0) if finite else np.float32(np.nan)
                m[r, nb + 2 * j] = m[r, nb + 2 * j + 1] = np.float32(0)
            m[r, j] = d[r, j] * np.float32(s)
            m[r, 3 * nb + j] = d[r, j] * np.float32(sh)
    return q, d, m
