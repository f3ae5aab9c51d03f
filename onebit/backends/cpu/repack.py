"""Repacking rows into the X16 layouts (x16.py): the numba repack kernels (on every thread, and
serial for a pool's reader threads), and `repack_x16` and its variants by type. Which tensors
the backend holds in an X16 layout is its memory policy's to say (backend.X16Policy)."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...formats.quants import QTYPES_BY_NAME, X16_Q5_BLOCK, X16_Q6_BLOCK, type_name, x16_bytes
from .base import cached
from .int_dots import VNNI
from .x16 import IQ4_XS_X16_BLOCK, NIBBLE_X16, Q2_Q, Q3_Q, Q6_Q, X16, X16_BLOCK, _q5_at_jit, transpose16


# The repacks index with unsigned 64-bit integers: a signed index makes numba test it for a
# negative value (numpy's wraparound) at every byte, which kept LLVM from joining four byte
# loads into one and held the MXFP4 and Q4_0 repacks to 1.7 GB/s on one thread (6.9 unsigned;
# Q4_K 6.1 -> 9.6): a pool's reader packs each expert it reads, and a resident load packs them all.
U = np.uint64
Q6_SCRATCH = 3 * 1024  # bytes: the Q6_K repack's transposed ql and qh words of one block of a group


@njit(inline="always")
def _word(r8, q):
    """The little-endian 32-bit word of bytes r8[q .. q + 3] (q unsigned, any alignment)."""
    return (np.uint32(r8[q]) | (np.uint32(r8[q + U(1)]) << 8) | (np.uint32(r8[q + U(2)]) << 16)
            | (np.uint32(r8[q + U(3)]) << 24))


@njit(inline="always")
def _repack_iq4xs_group(r8, rb, o, o32, g, nb):
    """Group g (unsigned; rows 16 g .. 16 g + 15) of IQ4_XS rows r8 (uint8, flat, rb bytes a row
    of nb blocks) into o (uint8, flat; o32: the same as words) as IQ4_XS_X16."""
    for r in range(X16):
        row = (g * U(X16) + U(r)) * rb
        for i in range(nb):
            base, s = (g * nb + U(i)) * U(IQ4_XS_X16_BLOCK), row + U(i) * U(136)
            o[base + U(2 * r)], o[base + U(2 * r + 1)] = r8[s], r8[s + U(1)]
            o[base + U(32 + 2 * r)], o[base + U(33 + 2 * r)] = r8[s + U(2)], r8[s + U(3)]
            for t in range(4):
                o[base + U(64 + 16 * t + r)] = r8[s + U(4 + t)]
            w0 = (base + U(128)) // U(4) + U(r)
            for jk in range(32):  # (sub-block j = jk // 4, k = jk % 4: bytes 8 + 4 jk ..)
                o32[w0 + U(X16 * jk)] = _word(r8, s + U(8 + 4 * jk))


@cached(parallel=True, nogil=True)
def repack_iq4_xs_x16(raw, out):
    """IQ4_XS rows raw (uint8 [N, K / 256 x 136], N a multiple of 16) -> out (the same shape) as
    IQ4_XS_X16, on every thread."""
    r8, rb, o = raw.reshape(-1), U(raw.shape[1]), out.reshape(-1)
    o32 = o.view(np.uint32)
    for g in prange(raw.shape[0] // X16):
        _repack_iq4xs_group(r8, rb, o, o32, U(g), rb // U(136))


@cached(nogil=True)
def repack_iq4_xs_x16_serial(raw, out):
    """`repack_iq4_xs_x16` on the calling thread."""
    r8, rb, o = raw.reshape(-1), U(raw.shape[1]), out.reshape(-1)
    o32 = o.view(np.uint32)
    for g in range(raw.shape[0] // X16):
        _repack_iq4xs_group(r8, rb, o, o32, U(g), rb // U(136))


@njit(inline="always")
def _repack_plain_group(r8, rb, o, o32, g, ts, qb):
    """Group g of MXFP4, Q4_0, IQ4_NL, Q5_0, Q4_1, Q5_1 or Q8_0 rows (`_repack_iq4xs_group`'s arguments;
    blocks of ts bytes: a scale, Q4_1's and Q5_1's minimum, Q5_0's and Q5_1's 4 bytes of fifth
    bits, then qb quant bytes) in their X16 layout: the 16 rows' scales, their minimums, their
    fifth bits, then the quants, 4 bytes (a 32-bit word) at a time."""
    sb, nb = ts - qb, rb // ts
    fb = min(sb, U(2))  # the scale's bytes (MXFP4's 1, the others' f16)
    mb = (sb - fb) % U(4)  # the minimum's (Q4_1's and Q5_1's f16); then the fifth bits
    for r in range(X16):
        row = (g * U(X16) + U(r)) * rb
        for i in range(nb):
            base, s = (g * nb + U(i)) * U(X16) * ts, row + U(i) * ts
            for j in range(fb):
                o[base + fb * U(r) + U(j)] = r8[s + U(j)]
            for j in range(mb):
                o[base + U(X16) * fb + mb * U(r) + U(j)] = r8[s + fb + U(j)]
            if sb > fb + mb:
                o32[(base + U(X16) * (fb + mb)) // U(4) + U(r)] = _word(r8, s + fb + mb)
            w0 = (base + U(X16) * sb) // U(4) + U(r)
            for k in range(qb // U(4)):
                o32[w0 + U(X16) * U(k)] = _word(r8, s + sb + U(4) * U(k))


@cached(parallel=True, nogil=True)
def repack_plain_x16(raw, out, ts, qb):
    """MXFP4 (ts = 17, qb = 16), Q4_0 and IQ4_NL (18, 16), Q5_0 (22, 16), Q4_1 (20, 16), Q5_1 (24, 16)
    or Q8_0 (34, 32) rows raw (uint8 [N, K / 32 x ts], N a multiple of 16) -> out (the same
    shape) in their X16 layout, on every thread."""
    r8, rb, o = raw.reshape(-1), U(raw.shape[1]), out.reshape(-1)
    o32 = o.view(np.uint32)
    for g in prange(raw.shape[0] // X16):
        _repack_plain_group(r8, rb, o, o32, U(g), U(ts), U(qb))


@cached(nogil=True)
def repack_plain_x16_serial(raw, out, ts, qb):
    """`repack_plain_x16` on the calling thread."""
    r8, rb, o = raw.reshape(-1), U(raw.shape[1]), out.reshape(-1)
    o32 = o.view(np.uint32)
    for g in range(raw.shape[0] // X16):
        _repack_plain_group(r8, rb, o, o32, U(g), U(ts), U(qb))


@njit(inline="always")
def _repack_group(r8, rb, o, o32, g, nb, ts, xb):
    """Group g of Q4_K rows (`_repack_iq4xs_group`'s arguments) in the X16 layout, the quants of
    each block by two `transpose16`s (16 rows at once); of Q5_K rows (ts = 176 bytes a block,
    xb = X16_Q5_BLOCK) in Q5_K_X16, a word at a time."""
    w = r8.view(np.uint32)  # (a row is 144 or 176 bytes a block: its quants are word aligned)
    for r in range(X16):
        row = (g * U(X16) + U(r)) * rb
        for i in range(nb):
            base, s = (g * nb + U(i)) * xb, row + U(i) * ts
            o[base + U(2 * r)], o[base + U(2 * r + 1)] = r8[s], r8[s + U(1)]
            o[base + U(32 + 2 * r)], o[base + U(33 + 2 * r)] = r8[s + U(2)], r8[s + U(3)]
            for t in range(8):
                if t < 4:
                    sc, mn = r8[s + U(4 + t)] & 63, r8[s + U(8 + t)] & 63
                else:
                    sc = (r8[s + U(8 + t)] & 15) | ((r8[s + U(t)] >> 6) << 4)
                    mn = (r8[s + U(8 + t)] >> 4) | ((r8[s + U(4 + t)] >> 6) << 4)
                o[base + U(64 + 16 * t + r)] = sc
                o[base + U(192 + 16 * t + r)] = mn
            if ts != U(144):  # Q5_K: the quants where _q5_at says, the fifth bits after pair 0's
                q0, h0 = (s + ts - U(128)) // U(4), (s + U(16)) // U(4)  # (4 weights a word)
                for jk in range(32):
                    o32[(base + U(_q5_at_jit(jk // 8, jk % 8))) // U(4) + U(r)] = w[q0 + U(jk)]
                for k in range(8):
                    o32[(base + U(_q5_at_jit(0, k) + 64)) // U(4) + U(r)] = w[h0 + U(k)]
    if ts == U(144):  # Q4_K: word jk of row r's quants at word 16 jk + r of the block's
        row = g * U(X16) * rb
        for i in range(nb):
            base, s = (g * nb + U(i)) * xb, row + U(i) * ts + U(16)
            transpose16(r8, s, rb, o, base + U(320))
            transpose16(r8, s + U(64), rb, o, base + U(320 + 1024))


@cached(parallel=True, nogil=True)
def repack_k_x16(raw, out, ts, xb):
    """Q4_K rows raw (uint8 [N, K / 256 x 144], N a multiple of 16; ts = 144, xb = X16_BLOCK) or
    Q5_K rows (ts = 176, xb = X16_Q5_BLOCK) -> out (uint8 [N, K / 256 x xb / 16]) in their X16
    layout, on every thread."""
    r8, rb, o = raw.reshape(-1), U(raw.shape[1]), out.reshape(-1)
    o32 = o.view(np.uint32)
    for g in prange(raw.shape[0] // X16):
        _repack_group(r8, rb, o, o32, U(g), rb // U(ts), U(ts), U(xb))


@cached(nogil=True)
def repack_k_x16_serial(raw, out, ts, xb):
    """`repack_k_x16` on the calling thread (an expert pool's reader threads: one expert each)."""
    r8, rb, o = raw.reshape(-1), U(raw.shape[1]), out.reshape(-1)
    o32 = o.view(np.uint32)
    for g in range(raw.shape[0] // X16):
        _repack_group(r8, rb, o, o32, U(g), rb // U(ts), U(ts), U(xb))


@njit(inline="always")
def _repack_q6_group(r8, rb, o, o32, g, nb, t8):
    """Group g of Q6_K rows (`_repack_iq4xs_group`'s arguments) as Q6_K_X16, each output word made
    from the row's words (ggml's Q6_K block: ql, 128 bytes of low nibbles; qh, 64 bytes of high
    bit pairs; 16 scales; d): the stored values u = q + 32 of weights 4 k .. 4 k + 3 and
    4 (k + 32) .. have their low 4 bits in the low nibbles of ql words k and 16 + k, those of
    4 (k + 16) .. and 4 (k + 48) .. in the high nibbles, and the high bit pairs of all four in qh
    words 32 + k % 8 and 40 + k % 8, at bits 2 (k // 8) and 2 (k // 8) + 4 of each byte. The 16
    rows' ql and qh words are first transposed (`transpose16`) into t8 (3072 bytes of scratch) so
    that each output line of 16 words is made by whole-line operations."""
    M4, M2 = np.uint32(0x0F0F0F0F), np.uint32(0x03030303)
    H4 = np.uint32(0xF0F0F0F0)
    t32 = t8.view(np.uint32)  # ql words 0-15, 16-31, qh words 0-15: [word][row]
    for i in range(nb):
        base = (g * nb + U(i)) * U(X16_Q6_BLOCK)
        for r in range(X16):
            s = (g * U(X16) + U(r)) * rb + U(i) * U(210)
            o[base + U(2 * r)], o[base + U(2 * r + 1)] = r8[s + U(208)], r8[s + U(209)]
            for t in range(16):
                o[base + U(32 + 16 * t + r)] = r8[s + U(192 + t)]
        s0 = g * U(X16) * rb + U(i) * U(210)
        for part in range(3):
            transpose16(r8, s0 + U(64 * part), rb, t8, U(1024 * part))
        w0 = (base + U(Q6_Q)) // U(4)
        for k in range(16):
            at, sh = w0 + U(48 * k), U(2 * (k // 8))
            for r in range(X16):
                a0, a1 = t32[U(16 * k + r)], t32[U(256 + 16 * k + r)]
                q0, q1 = t32[U(512 + 16 * (k % 8) + r)], t32[U(640 + 16 * (k % 8) + r)]
                o32[at + U(r)] = (a0 & M4) | ((a1 & M4) << 4)
                o32[at + U(16 + r)] = ((a0 >> 4) & M4) | (a1 & H4)
                o32[at + U(32 + r)] = (((q0 >> sh) & M2) | (((q0 >> (sh + U(4))) & M2) << 2)
                                       | (((q1 >> sh) & M2) << 4) | (((q1 >> (sh + U(4))) & M2) << 6))


@cached(parallel=True, nogil=True)
def repack_q6_k_x16(raw, out):
    """Q6_K rows raw (uint8 [N, K / 256 x 210], N a multiple of 16) -> out (the same shape) in the
    Q6_K_X16 layout, on every thread."""
    r8, rb, o = raw.reshape(-1), U(raw.shape[1]), out.reshape(-1)
    o32 = o.view(np.uint32)
    for g in prange(raw.shape[0] // X16):
        _repack_q6_group(r8, rb, o, o32, U(g), rb // U(210), np.empty(Q6_SCRATCH, np.uint8))


@cached(nogil=True)
def repack_q6_k_x16_serial(raw, out):
    """`repack_q6_k_x16` on the calling thread."""
    r8, rb, o = raw.reshape(-1), U(raw.shape[1]), out.reshape(-1)
    o32 = o.view(np.uint32)
    t8 = np.empty(Q6_SCRATCH, np.uint8)
    for g in range(raw.shape[0] // X16):
        _repack_q6_group(r8, rb, o, o32, U(g), rb // U(210), t8)


@njit(inline="always")
def _repack_q23_group(r8, rb, o, o32, g, nb, ts):
    """Group g of Q2_K rows (ts = 84 bytes a block) or Q3_K rows (ts = 110) (`_repack_iq4xs_group`'s
    arguments) as Q2_K_X16 / Q3_K_X16, 4 quant bytes (a 32-bit word) at a time."""
    for r in range(X16):
        row = (g * U(X16) + U(r)) * rb
        for i in range(nb):
            base, s = (g * nb + U(i)) * U(X16) * ts, row + U(i) * ts
            if ts == U(84):  # scales[16], qs[64], d, dmin
                o[base + U(2 * r)], o[base + U(2 * r + 1)] = r8[s + U(80)], r8[s + U(81)]
                o[base + U(32 + 2 * r)], o[base + U(33 + 2 * r)] = r8[s + U(82)], r8[s + U(83)]
                for t in range(16):
                    o[base + U(64 + 16 * t + r)] = r8[s + U(t)]
                w0 = (base + U(Q2_Q)) // U(4) + U(r)
                for h in range(2):
                    for n in range(2):
                        for k in range(4):
                            o32[w0 + U(16 * (8 * h + 4 * n + k))] = _word(r8, s + U(16 + 32 * n + 16 * h + 4 * k))
            else:  # hmask[32], qs[64], scales[12], d
                o[base + U(2 * r)], o[base + U(2 * r + 1)] = r8[s + U(108)], r8[s + U(109)]
                for t in range(12):
                    o[base + U(32 + 16 * t + r)] = r8[s + U(96 + t)]
                w0 = (base + U(Q3_Q)) // U(4) + U(r)
                for h in range(2):
                    for k in range(4):
                        o32[w0 + U(192 * h + 16 * k)] = _word(r8, s + U(16 * h + 4 * k))
                        for n in range(2):
                            o32[w0 + U(192 * h + 64 + 64 * n + 16 * k)] = _word(r8, s + U(32 + 32 * n + 16 * h + 4 * k))


@cached(parallel=True, nogil=True)
def repack_q23_k_x16(raw, out, ts):
    """Q2_K rows raw (uint8 [N, K / 256 x 84]; ts = 84) or Q3_K rows ([N, K / 256 x 110], ts = 110)
    -> out (the same shape) in their X16 layout, on every thread (the groups of 16 rows)."""
    r8, rb, o = raw.reshape(-1), U(raw.shape[1]), out.reshape(-1)
    o32 = o.view(np.uint32)
    for g in prange(raw.shape[0] // X16):
        _repack_q23_group(r8, rb, o, o32, U(g), rb // U(ts), U(ts))


@cached(nogil=True)
def repack_q23_k_x16_serial(raw, out, ts):
    """`repack_q23_k_x16` on the calling thread."""
    r8, rb, o = raw.reshape(-1), U(raw.shape[1]), out.reshape(-1)
    o32 = o.view(np.uint32)
    for g in range(raw.shape[0] // X16):
        _repack_q23_group(r8, rb, o, o32, U(g), rb // U(ts), U(ts))


def x16_type(qtype: int) -> int:
    """The type id of qtype's X16 layout (Q4_K_X16, Q6_K_X16, ...: X16_TYPES)."""
    return qtype + 256


def repack_x16(raw: np.ndarray, qtype: int = QTYPES_BY_NAME["Q4_K"].type_id) -> np.ndarray:
    """A read-only X16 copy of rows raw [..., N, row bytes] of type qtype (one of X16_TYPES), each
    [N, row bytes] on its own, on every thread."""
    out = np.empty((*raw.shape[:-1], x16_bytes(raw.shape[-1], qtype)), np.uint8)
    f = _repacker(qtype, False)
    if raw.shape[-2] % X16 == 0:  # (the groups of every matrix at once)
        f(raw.reshape(-1, raw.shape[-1]), out.reshape(-1, out.shape[-1]))
    else:
        for a, o in zip(raw.reshape(-1, *raw.shape[-2:]), out.reshape(-1, *out.shape[-2:])):
            f(a, o)
    out.flags.writeable = False
    return out


def repack_x16_into(raw: np.ndarray, out: np.ndarray, qtype: int) -> None:
    """`repack_x16` of one [N, row bytes] into out, on every thread."""
    _repacker(qtype, False)(raw, out)


def repack_x16_serial(raw: np.ndarray, out: np.ndarray, qtype: int) -> None:
    """`repack_x16` of one [N, row bytes] into out, on the calling thread."""
    _repacker(qtype, True)(raw, out)


def _repacker(qtype: int, serial: bool):
    """f(raw, out): the repack of qtype's X16 layout, serial or on every thread: the groups of 16
    rows by its kernel, then the last N % 16 rows as they are, one after another from the first
    one's place (the X16 row loops read them as rows, rows.py)."""
    kernel = _kernel_of(qtype, serial)

    def repack(raw, out):
        if out.shape != (raw.shape[0], x16_bytes(raw.shape[1], qtype)):  # (the kernels index without bounds checks)
            raise ValueError(f"{type_name(qtype)} rows {raw.shape} repack into {x16_bytes(raw.shape[1], qtype)} bytes "
                             f"a row, not into {out.shape}")
        full = raw.shape[0] // X16 * X16
        kernel(raw[:full], out[:full])  # (whole groups: a word view of their bytes)
        if full < raw.shape[0]:
            if not out.flags.c_contiguous:
                raise ValueError("an X16 layout's rows must be one C-ordered array")
            tail, rest = raw[full:].reshape(-1), out.reshape(-1)[full * out.shape[1] :]
            rest[: tail.size] = tail
            rest[tail.size :] = 0  # (Q4_K's and Q5_K's rows are shorter than their layout's)
    return repack


def _kernel_of(qtype: int, serial: bool):
    """f(raw, out): the repack kernel of qtype's X16 layout (its groups of 16 rows)."""
    name = type_name(qtype)
    if name in NIBBLE_X16 or name == "Q8_0":
        kernel, ts = (repack_plain_x16_serial if serial else repack_plain_x16), QTYPES_BY_NAME[name].type_size
        qb = 32 if name == "Q8_0" else 16
        return lambda raw, out: kernel(raw, out, ts, qb)
    if name == "Q6_K":
        return repack_q6_k_x16_serial if serial else repack_q6_k_x16
    if name == "IQ4_XS":
        return repack_iq4_xs_x16_serial if serial else repack_iq4_xs_x16
    if name in ("Q2_K", "Q3_K"):
        kernel, ts = (repack_q23_k_x16_serial if serial else repack_q23_k_x16), QTYPES_BY_NAME[name].type_size
        return lambda raw, out: kernel(raw, out, ts)
    kernel = repack_k_x16_serial if serial else repack_k_x16  # Q4_K, Q5_K
    ts, xb = (176, X16_Q5_BLOCK) if name == "Q5_K" else (144, X16_BLOCK)
    return lambda raw, out: kernel(raw, out, ts, xb)
