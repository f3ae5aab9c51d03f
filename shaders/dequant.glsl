// Dequantization of the weight binding A_BINDING, for the one type selected with -DTYPE_<name>.
//
// Every type exposes the same three things:
//   QK   weights per block (float types: 16-value "blocks" so one row is whole blocks),
//   QU   weights per unit (a run that shares one scale/offset; QU divides QK, 4 divides QU),
//   get_dm(ib, iu) -> (scale, offset) of unit iu of block ib: w = scale * q + offset,
//   get_q4(ib, iu, g) -> the raw quants q of weights 4g..4g+3 of that unit,
//   get_unit(ib, iu, q) -> get_q4 for every g of the unit (a type may define a cheaper one:
//                          HAS_UNIT_LOAD; the others get the loop at the end of this file).
// A_HAS_MIN is defined when the offset can be non-zero, so kernels can skip sum(x).
// Quants are read as 32-bit words where blocks are 4-byte aligned and as pairs of 16-bit
// words where they are only 2-byte aligned (MXFP4, 17 bytes, is read byte by byte).

#ifndef A_BINDING
#define A_BINDING 0
#endif

vec4 unpack_bytes(uint w) {
    return vec4(uvec4(w, w >> 8, w >> 16, w >> 24) & 0xFFu);
}

#if defined(TYPE_F32)
#define A_TYPE F32
#define QK 16u
#define QU 16u
layout(binding = A_BINDING, std430) readonly buffer WeightBlocks { A_TYPE data_a[]; };
layout(binding = A_BINDING, std430) readonly buffer WeightV4 { vec4 data_a_v4[]; };
vec2 get_dm(uint ib, uint iu) { return vec2(1.0, 0.0); }
vec4 get_q4(uint ib, uint iu, uint g) { return data_a_v4[ib * 4u + g]; }

#elif defined(TYPE_F16)
#define A_TYPE F16
#define QK 16u
#define QU 16u
layout(binding = A_BINDING, std430) readonly buffer WeightBlocks { A_TYPE data_a[]; };
layout(binding = A_BINDING, std430) readonly buffer WeightF16V4 { f16vec4 data_a_f16v4[]; };
vec2 get_dm(uint ib, uint iu) { return vec2(1.0, 0.0); }
vec4 get_q4(uint ib, uint iu, uint g) { return vec4(data_a_f16v4[ib * 4u + g]); }

#elif defined(TYPE_BF16)
#define A_TYPE BF16
#define QK 16u
#define QU 16u
layout(binding = A_BINDING, std430) readonly buffer WeightBlocks { A_TYPE data_a[]; };
layout(binding = A_BINDING, std430) readonly buffer WeightU2 { uvec2 data_a_u2[]; };
vec2 get_dm(uint ib, uint iu) { return vec2(1.0, 0.0); }
vec4 get_q4(uint ib, uint iu, uint g) {
    uvec2 w = data_a_u2[ib * 4u + g];
    return vec4(uintBitsToFloat(w.x << 16), uintBitsToFloat(w.x & 0xFFFF0000u),
                uintBitsToFloat(w.y << 16), uintBitsToFloat(w.y & 0xFFFF0000u));
}

#else  // block-quantized types: the struct view plus word views of the same binding

#if defined(TYPE_Q8_0)
#define A_TYPE Q8_0
#elif defined(TYPE_Q4_0)
#define A_TYPE Q4_0
#elif defined(TYPE_Q1_0)
#define A_TYPE Q1_0
#elif defined(TYPE_MXFP4)
#define A_TYPE MXFP4
#elif defined(TYPE_Q4_K)
#define A_TYPE Q4_K
#elif defined(TYPE_Q5_K)
#define A_TYPE Q5_K
#elif defined(TYPE_Q6_K)
#define A_TYPE Q6_K
#elif defined(TYPE_TQ1_0)
#define A_TYPE TQ1_0
#elif defined(TYPE_TQ2_0)
#define A_TYPE TQ2_0
#elif defined(TYPE_Q4_1)
#define A_TYPE Q4_1
#elif defined(TYPE_Q5_0)
#define A_TYPE Q5_0
#elif defined(TYPE_Q5_1)
#define A_TYPE Q5_1
#elif defined(TYPE_Q2_K)
#define A_TYPE Q2_K
#elif defined(TYPE_Q3_K)
#define A_TYPE Q3_K
#elif defined(TYPE_IQ1_S)
#define A_TYPE IQ1_S
#elif defined(TYPE_IQ1_M)
#define A_TYPE IQ1_M
#elif defined(TYPE_IQ2_XXS)
#define A_TYPE IQ2_XXS
#elif defined(TYPE_IQ2_XS)
#define A_TYPE IQ2_XS
#elif defined(TYPE_IQ2_S)
#define A_TYPE IQ2_S
#elif defined(TYPE_IQ3_XXS)
#define A_TYPE IQ3_XXS
#elif defined(TYPE_IQ3_S)
#define A_TYPE IQ3_S
#elif defined(TYPE_IQ4_NL)
#define A_TYPE IQ4_NL
#elif defined(TYPE_IQ4_XS)
#define A_TYPE IQ4_XS
#else
#error "define one TYPE_<name>"
#endif

layout(binding = A_BINDING, std430) readonly buffer WeightBlocks { A_TYPE data_a[]; };
layout(binding = A_BINDING, std430) readonly buffer WeightU32 { uint data_a32[]; };

#if defined(TYPE_IQ1_S) || defined(TYPE_IQ1_M) || defined(TYPE_IQ2_XXS) || defined(TYPE_IQ2_XS) || \
    defined(TYPE_IQ2_S) || defined(TYPE_IQ3_XXS) || defined(TYPE_IQ3_S) || defined(TYPE_IQ4_NL) || defined(TYPE_IQ4_XS)
// The IQ types' codebook, bound after the kernel's own buffers (GRID_BINDING, set by each
// .comp) and packed by kernels.grid_words: IQ2 grids two words of four magnitude bytes per
// entry, IQ3 grids one word, IQ1 grids one word of eight nibbles (value + 1), IQ4 the 16
// int8 levels in four words. A buffer, not a GLSL constant array: lavapipe's compile time grows
// steeply with constant arrays of this size.
#define A_GRID
#if defined(TYPE_IQ4_NL) || defined(TYPE_IQ4_XS)
layout(binding = GRID_BINDING, std430) readonly buffer Grid { uint grid[]; };
#else
// IQ1/2/3: a uniform buffer (kernels.GRID_UBO_BYTES, the largest grid: 2048 words). Its
// per-lane reads are what these decoders spend on; lavapipe gathers from a uniform buffer
// with plain loads, but from a storage buffer with a bounds-checked branch per lane.
layout(binding = GRID_BINDING, std140) uniform Grid { uvec4 grid4[512]; };
uint grid_word(uint i) { return grid4[i >> 2u][i & 3u]; }
#endif
#endif

// Word j of a field starting at byte b (any alignment), from the one or two aligned words that
// hold it, little endian. On lavapipe every storage-buffer read (byte, u16 or word) is a branch
// per lane, so blocks whose size is not a multiple of 4 read fewer, wider words this way; both
// words are always read (no branch).
// kernels.bound_bytes binds every weight part with a word to spare, so word j + 1 is in range.
uint field_word(uint b, uint j) {
    const uint w = (b >> 2) + j, sh = 8u * (b & 3u);
    const uint lo = data_a32[w], hi = data_a32[w + 1u];
    return sh == 0u ? lo : (lo >> sh) | (hi << (32u - sh));
}
// Words j0 .. j0 + n - 1 of that field (n <= 8, a constant where it is called), from n + 1 word
// reads where n field_word calls make 2n. Q6_K's units read this way measured 1.25-1.31x faster
// on lavapipe (grouped experts and dense rows; one-row decode unchanged); Q8_0, Q4_0, Q5_0 and
// MXFP4 measured slower or no faster, so they keep field_word
// (bench/results/execution-modes-2026-12-01.md).
void field_words(uint b, uint j0, uint n, out uint w[8]) {
    const uint a = (b >> 2) + j0, sh = 8u * (b & 3u);
    uint raw[9];
    [[unroll]] for (uint i = 0u; i <= n; i++) {
        raw[i] = data_a32[a + i];
    }
    [[unroll]] for (uint i = 0u; i < n; i++) {
        w[i] = sh == 0u ? raw[i] : (raw[i] >> sh) | (raw[i + 1u] << (32u - sh));
    }
}

#if defined(TYPE_IQ1_S) || defined(TYPE_IQ1_M) || defined(TYPE_IQ2_XXS) || defined(TYPE_IQ2_XS) || defined(TYPE_IQ2_S)
// Block windows, for mul_mv's whole-unit dots (UNIT_QDOT). Read as single words (IQ1_M's 56
// bytes are whole words; the others are only 2-byte aligned, read by field_word), a block costs
// a per-lane bounds-checked loop per word on lavapipe (about 17 instructions a lane). Read as
// the WIN_Q uvec4s around it, it costs one loop per uvec4 (~38 instructions a lane for 4 words);
// its words are then selected at the block's offset within 16 bytes. When every row is a whole
// number of 16-byte runs and the binding starts on one (the host sets W_ALIGNED:
// kernels.Kernels._w_aligned), that offset depends on the block's index in its row only, the
// same in every lane, which measured 1.05-1.25x faster than the per-lane offset. Same words,
// same sums.
#if defined(TYPE_IQ1_S)
#define BLOCK_BYTES 50u
#define WIN_Q 4u
#define WIN_W 13u
#elif defined(TYPE_IQ1_M)
#define BLOCK_BYTES 56u
#define WIN_Q 5u
#define WIN_W 14u
#elif defined(TYPE_IQ2_XXS)
#define BLOCK_BYTES 66u
#define WIN_Q 5u
#define WIN_W 17u
#elif defined(TYPE_IQ2_XS)
#define BLOCK_BYTES 74u
#define WIN_Q 6u
#define WIN_W 19u
#else
#define BLOCK_BYTES 82u
#define WIN_Q 6u
#define WIN_W 21u
#endif
// (WIN_W words from the block's first 4-byte boundary cover it and the word after; the selects
// below read words up to WIN_W + 2 < 4 WIN_Q of those loaded)
layout(binding = A_BINDING, std430) readonly buffer WeightU128 { uvec4 data_a128[]; };
layout(constant_id = 3) const uint W_ALIGNED = 0u;
struct Window {
    uint v[WIN_W];  // word i of the block's 4-byte-aligned span
    uint r;         // the block's first byte within v[0]: 0 or 2
};
// Block b (index in the binding); ibr: its index within its row.
Window block_window(uint b, uint ibr) {
    const uint q0 = (b * BLOCK_BYTES) >> 4;
    const uint m = ((W_ALIGNED != 0u ? ibr : b) * BLOCK_BYTES) & 15u;
    uint w[4u * WIN_Q];
    [[unroll]] for (uint i = 0u; i < WIN_Q; i++) {
#if defined(TYPE_IQ1_M)
        // the fifth only for offsets 12 (not under W_ALIGNED: an even block count a row puts
        // every block at 0 or 8)
        const uvec4 t = i < 4u || W_ALIGNED == 0u ? data_a128[q0 + i] : uvec4(0u);
#else
        const uvec4 t = data_a128[q0 + i];
#endif
        w[4u * i] = t.x;
        w[4u * i + 1u] = t.y;
        w[4u * i + 2u] = t.z;
        w[4u * i + 3u] = t.w;
    }
    const uint k0 = m >> 2;
    Window win;
    [[unroll]] for (uint i = 0u; i < WIN_W; i++) {
        win.v[i] = k0 == 0u ? w[i] : k0 == 1u ? w[i + 1u] : k0 == 2u ? w[i + 2u] : w[i + 3u];
    }
    win.r = m & 3u;  // (IQ1_M: 0)
    return win;
}
// The 32 bits at byte o (even) of the block.
uint win_word(Window win, uint o) {
    const uint a = o >> 2, p = win.r + (o & 3u);  // 0, 2 or 4
    return p == 0u ? win.v[a] : p == 4u ? win.v[a + 1u] : (win.v[a] >> 16) | (win.v[a + 1u] << 16);
}
#endif


#if defined(TYPE_Q8_0)
// 34 bytes = 17 halfwords: d, then 32 signed bytes.
#define QK 32u
#define QU 32u
vec2 get_dm(uint ib, uint iu) { return vec2(float(data_a[ib].d), 0.0); }
vec4 get_q4(uint ib, uint iu, uint g) {
    uint w = field_word(ib * 34u + 2u, g);
    return vec4(ivec4(uvec4(w << 24, w << 16, w << 8, w)) >> 24);
}

#elif defined(TYPE_Q4_0)
// 18 bytes: d, 16 bytes; weight j < 16 is the low nibble of byte j, j >= 16 the high one of j-16.
#define QK 32u
#define QU 32u
#define A_HAS_MIN
vec2 get_dm(uint ib, uint iu) {
    float d = float(data_a[ib].d);
    return vec2(d, -8.0 * d);
}
vec4 get_q4(uint ib, uint iu, uint g) {
    uint w = field_word(ib * 18u + 2u, g & 3u);
    return unpack_bytes((g >= 4u ? (w >> 4) : w) & 0x0F0F0F0Fu);
}

#elif defined(TYPE_Q1_0)
// 18 bytes: d, 128 sign bits LSB first; w = bit ? +d : -d = 2d * bit - d.
#define QK 128u
#define QU 32u
#define A_HAS_MIN
vec2 get_dm(uint ib, uint iu) {
    float d = float(data_a[ib].d);
    return vec2(2.0 * d, -d);
}
vec4 get_q4(uint ib, uint iu, uint g) {
    uint b = field_word(ib * 18u + 2u, iu) >> (4u * g);
    return vec4(uvec4(b, b >> 1, b >> 2, b >> 3) & 1u);
}

#elif defined(TYPE_MXFP4)
// 17 bytes: an E8M0 exponent, 16 bytes of E2M1 nibbles (low nibbles first, like Q4_0).
// Values are kvalues_mxfp4 = 2 * E2M1, so the scale is 2^(e - 128).
#define QK 32u
#define QU 32u
vec2 get_dm(uint ib, uint iu) {
    uint e = uint(data_a[ib].e);
    float d = e < 2u ? uintBitsToFloat(0x00200000u << e) : uintBitsToFloat((e - 1u) << 23);
    return vec2(d, 0.0);
}
vec4 e2m1x2(uvec4 n) {  // 2 * E2M1 value of each nibble: 0 1 2 3 4 6 8 12, sign in bit 3
    uvec4 m = n & 7u;
    vec4 big = vec4((m & 1u) + 2u) * vec4(uvec4(1u) << (max(m >> 1, uvec4(1u)) - 1u));
    vec4 mag = mix(vec4(m), big, greaterThanEqual(m, uvec4(4u)));
    return mix(mag, -mag, notEqual(n & 8u, uvec4(0u)));
}
vec4 get_q4(uint ib, uint iu, uint g) {
    // qs[4j .. 4j + 3] (j = g & 3): five word reads per block, shared by the 8 calls, not 16 bytes
    uint w = field_word(ib * 17u + 1u, g & 3u);
    uvec4 b = uvec4(w, w >> 8, w >> 16, w >> 24) & 0xFFu;
    return e2m1x2((g >= 4u ? (b >> 4) : b) & 0xFu);
}

#elif defined(TYPE_Q4_K) || defined(TYPE_Q5_K)
// 8 sub-blocks of 32 weights, each with a 6-bit scale and min packed in 12 bytes:
// j < 4: scale = scales[j] & 63, min = scales[j + 4] & 63; j >= 4: low 4 bits from
// scales[j + 4] (scale: low nibble, min: high nibble), high 2 bits from the top of scales[j - 4]
// (scale) and scales[j] (min).
#if defined(TYPE_Q4_K)
const uint sizeof_block = 144u;
#else
const uint sizeof_block = 176u;
#endif
#define QK 256u
#define QU 32u
#define A_HAS_MIN
// Both block sizes are whole 16-byte words, so the header and a unit's quants are read as uvec4s:
// on lavapipe each storage read is a loop over the lanes with a bounds-checked load per
// component, so one uvec4 read costs far less than four word reads (the decoded values are the
// same; bench/results/execution-modes-2026-12-01.md).
layout(binding = A_BINDING, std430) readonly buffer WeightU128 { uvec4 data_a128[]; };
const uint vpb = sizeof_block / 16u;
vec2 get_dm(uint ib, uint iu) {
    // word 0: d and dmin (f16); the 12 scale bytes are words 1..3
    const uvec4 h = data_a128[ib * vpb];
    const uint s0 = h.y, s1 = h.z, s2 = h.w;
    const uint j = (iu & 3u) * 8u;
    uint sc, m;
    if (iu < 4u) {
        sc = (s0 >> j) & 63u;
        m = (s1 >> j) & 63u;
    } else {
        sc = ((s2 >> j) & 0xFu) | (((s0 >> j) >> 6) & 3u) << 4;
        m = ((s2 >> (j + 4u)) & 0xFu) | (((s1 >> j) >> 6) & 3u) << 4;
    }
    const vec2 dm = unpackHalf2x16(h.x);
    return vec2(dm.x * float(sc), -dm.y * float(m));
}
#define HAS_UNIT_LOAD  // get_unit(ib, iu, q): get_q4(ib, iu, g) for every g, from whole uvec4 reads
#if defined(TYPE_Q4_K)
// 144 bytes = 36 words; quants at word 4: sub-block iu is nibble (iu & 1) of bytes 32 * (iu >> 1) + l.
vec4 get_q4(uint ib, uint iu, uint g) {
    uint w = data_a32[ib * 36u + 4u + (iu >> 1) * 8u + g];
    return unpack_bytes(((iu & 1u) != 0u ? (w >> 4) : w) & 0x0F0F0F0Fu);
}
void get_unit(uint ib, uint iu, out vec4 q[QU / 4u]) {
    const uint v = ib * 9u + 1u + (iu >> 1) * 2u, sh = (iu & 1u) * 4u;
    const uvec4 a = data_a128[v], b = data_a128[v + 1u];
    [[unroll]] for (uint g = 0u; g < 4u; g++) {
        q[g] = unpack_bytes((a[g] >> sh) & 0x0F0F0F0Fu);
        q[g + 4u] = unpack_bytes((b[g] >> sh) & 0x0F0F0F0Fu);
    }
}
#else
// 176 bytes = 44 words; high bits at word 4 (bit iu of byte l), low nibbles at word 12.
vec4 get_q4(uint ib, uint iu, uint g) {
    uint ql = data_a32[ib * 44u + 12u + (iu >> 1) * 8u + g];
    ql = ((iu & 1u) != 0u ? (ql >> 4) : ql) & 0x0F0F0F0Fu;
    uint qh = (data_a32[ib * 44u + 4u + g] >> iu) & 0x01010101u;
    return unpack_bytes(ql | (qh << 4));
}
void get_unit(uint ib, uint iu, out vec4 q[QU / 4u]) {
    const uint v = ib * 11u + 3u + (iu >> 1) * 2u, sh = (iu & 1u) * 4u;
    const uvec4 la = data_a128[v], lb = data_a128[v + 1u];
    const uvec4 ha = data_a128[ib * 11u + 1u], hb = data_a128[ib * 11u + 2u];
    [[unroll]] for (uint g = 0u; g < 4u; g++) {
        q[g] = unpack_bytes(((la[g] >> sh) & 0x0F0F0F0Fu) | (((ha[g] >> iu) & 0x01010101u) << 4));
        q[g + 4u] = unpack_bytes(((lb[g] >> sh) & 0x0F0F0F0Fu) | (((hb[g] >> iu) & 0x01010101u) << 4));
    }
}
#endif

#elif defined(TYPE_Q6_K)
// 210 bytes = 105 halfwords: ql[128], qh[64], 16 int8 scales, d. Unit iu (16 weights) uses
// scale iu; within a 128-weight half n, quarter q takes nibble (q >> 1) of ql and bits 2q of qh.
#define QK 256u
#define QU 16u
#define A_HAS_MIN
vec2 get_dm(uint ib, uint iu) {
    // int8 scale iu: byte 192 + iu of the block (word 48 + iu / 4)
    int sc = bitfieldExtract(int(field_word(ib * 210u, 48u + (iu >> 2))), int(8u * (iu & 3u)), 8);
    float d = float(data_a[ib].d) * float(sc);
    return vec2(d, -32.0 * d);
}
vec4 get_q4(uint ib, uint iu, uint g) {
    uint n = iu >> 3;
    uint quarter = (iu & 7u) >> 1;
    uint l = (iu & 1u) * 16u + g * 4u;
    uint ql = field_word(ib * 210u, (64u * n + l + 32u * (quarter & 1u)) / 4u);
    uint qh = field_word(ib * 210u, (128u + 32u * n + l) / 4u);
    ql = (ql >> (4u * (quarter >> 1))) & 0x0F0F0F0Fu;
    qh = ((qh >> (2u * quarter)) & 0x03030303u) << 4;
    return unpack_bytes(ql | qh);
}
#define HAS_UNIT_LOAD  // get_unit(ib, iu, q): get_q4(ib, iu, g) for every g, each word read once
void get_unit(uint ib, uint iu, out vec4 q[QU / 4u]) {
    const uint n = iu >> 3, quarter = (iu & 7u) >> 1, l0 = (iu & 1u) * 16u;
    uint lw[8], hw[8];
    field_words(ib * 210u, (64u * n + l0 + 32u * (quarter & 1u)) / 4u, 4u, lw);
    field_words(ib * 210u, (128u + 32u * n + l0) / 4u, 4u, hw);
    [[unroll]] for (uint g = 0u; g < 4u; g++) {
        q[g] = unpack_bytes(((lw[g] >> (4u * (quarter >> 1))) & 0x0F0F0F0Fu) | (((hw[g] >> (2u * quarter)) & 0x03030303u) << 4));
    }
}

#elif defined(TYPE_TQ1_0)
// 54 bytes = 27 halfwords: qs[48], qh[4], d. Each byte packs base-3 digits: the n-th digit is
// ((byte * 3^n) mod 256) * 3 >> 8. Weights 0..159: digit iu/2 of bytes 0..31; 160..239: digit
// iu-10 of bytes 32..47; 240..255: digit g of qh[0..3].
#define QK 256u
#define QU 16u
#define A_HAS_MIN
vec2 get_dm(uint ib, uint iu) {
    float d = float(data_a[ib].d);
    return vec2(d, -d);
}
uint pow3(uint n) {
    return n == 0u ? 1u : n == 1u ? 3u : n == 2u ? 9u : n == 3u ? 27u : 81u;
}
vec4 get_q4(uint ib, uint iu, uint g) {
    uint hw, p;
    if (iu < 10u) {
        hw = (iu & 1u) * 8u + 2u * g;
        p = pow3(iu >> 1);
    } else if (iu < 15u) {
        hw = 16u + 2u * g;
        p = pow3(iu - 10u);
    } else {
        hw = 24u;
        p = pow3(g);
    }
    uint w = field_word(ib * 54u, hw >> 1);  // hw is even
    uvec4 q = ((uvec4(w, w >> 8, w >> 16, w >> 24) & 0xFFu) * p) & 0xFFu;
    return vec4((q * 3u) >> 8);
}

#elif defined(TYPE_TQ2_0)
// 66 bytes = 33 halfwords: qs[64], d. Weight 128j + 32l + m is bits 2l of byte 32j + m; w = (q - 1) d.
#define QK 256u
#define QU 32u
#define A_HAS_MIN
vec2 get_dm(uint ib, uint iu) {
    float d = float(data_a[ib].d);
    return vec2(d, -d);
}
vec4 get_q4(uint ib, uint iu, uint g) {
    uint w = field_word(ib * 66u, 8u * (iu >> 2) + g);
    return unpack_bytes((w >> (2u * (iu & 3u))) & 0x03030303u);
}

#elif defined(TYPE_Q4_1)
// 20 bytes = 5 words: f16 d, f16 m, 16 bytes of nibbles laid out as Q4_0's; w = d q + m.
#define QK 32u
#define QU 32u
#define A_HAS_MIN
vec2 get_dm(uint ib, uint iu) { return vec2(data_a[ib].dm); }
vec4 get_q4(uint ib, uint iu, uint g) {
    uint w = data_a32[ib * 5u + 1u + (g & 3u)];
    return unpack_bytes((g >= 4u ? (w >> 4) : w) & 0x0F0F0F0Fu);
}

#elif defined(TYPE_Q5_0) || defined(TYPE_Q5_1)
// Q5_0: 22 bytes = 11 halfwords: f16 d, 32 high bits qh, nibbles as Q4_0's; w = d (q - 16).
// Q5_1: 24 bytes = 12 halfwords: f16 d, f16 m, qh, nibbles; w = d q + m. Bit j of qh is
// weight j's fifth bit.
#if defined(TYPE_Q5_0)
#define Q5_HW 11u
#define Q5_QH 1u
#else
#define Q5_HW 12u
#define Q5_QH 2u
#endif
#define QK 32u
#define QU 32u
#define A_HAS_MIN
vec2 get_dm(uint ib, uint iu) {
#if defined(TYPE_Q5_0)
    float d = float(data_a[ib].d);
    return vec2(d, -16.0 * d);
#else
    return vec2(data_a[ib].dm);
#endif
}
vec4 get_q4(uint ib, uint iu, uint g) {
    // qh and the nibbles as words from qh's byte
    uint ql = field_word(ib * (2u * Q5_HW) + 2u * Q5_QH, 1u + (g & 3u));
    uint h = field_word(ib * (2u * Q5_HW) + 2u * Q5_QH, 0u) >> (4u * g);
    return unpack_bytes((g >= 4u ? (ql >> 4) : ql) & 0x0F0F0F0Fu) + 16.0 * vec4(uvec4(h, h >> 1, h >> 2, h >> 3) & 1u);
}

#elif defined(TYPE_Q2_K)
// 84 bytes = 21 words: 16 scale bytes (low nibble scale, high nibble min, one per 16 weights),
// 64 bytes of 2-bit quants, f16 d, f16 dmin. Weight 128n + 32j + 16h + l is bits 2j of byte
// 32n + 16h + l and uses scale 8n + 2j + h (= its unit); w = d sc q - dmin m.
#define QK 256u
#define QU 16u
#define A_HAS_MIN
vec2 get_dm(uint ib, uint iu) {
    uint sc = (data_a32[ib * 21u + (iu >> 2)] >> (8u * (iu & 3u))) & 255u;
    vec2 dm = vec2(data_a[ib].dm);
    return vec2(dm.x * float(sc & 15u), -dm.y * float(sc >> 4));
}
vec4 get_q4(uint ib, uint iu, uint g) {
    uint byte = 32u * (iu >> 3) + 16u * (iu & 1u) + 4u * g;
    uint w = data_a32[ib * 21u + 4u + byte / 4u];
    return unpack_bytes((w >> (2u * ((iu >> 1) & 3u))) & 0x03030303u);
}

#elif defined(TYPE_Q3_K)
// 110 bytes = 55 halfwords: hmask[32], qs[64], 12 bytes of 6-bit scales, f16 d. Weight
// 128n + 32j + 16h + l: low 2 bits are bits 2j of qs[32n + 16h + l], the third is bit 4n + j of
// hmask[16h + l]; unit s = 8n + 2j + h has scale (low nibble of scales[s % 8], nibble s / 8) |
// (bits 2 (s / 4) of scales[8 + s % 4]) << 4, minus 32; w = d sc (q - 4).
#define QK 256u
#define QU 16u
#define A_HAS_MIN
vec2 get_dm(uint ib, uint iu) {
    // scales[iu & 7] and scales[8 + (iu & 3)]: bytes 96.. of the block (words 24..26)
    uint lo = (field_word(ib * 110u, 24u + ((iu & 7u) >> 2)) >> (8u * (iu & 3u) + 4u * (iu >> 3))) & 15u;
    uint hi = (field_word(ib * 110u, 26u) >> (8u * (iu & 3u) + 2u * (iu >> 2))) & 3u;
    float d = float(data_a[ib].d) * float(int(lo | (hi << 4)) - 32);
    return vec2(d, -4.0 * d);
}
vec4 get_q4(uint ib, uint iu, uint g) {
    uint n = iu >> 3, j = (iu >> 1) & 3u, h = iu & 1u;
    uint ql = field_word(ib * 110u, 8u + 8u * n + 4u * h + g);
    uint hm = field_word(ib * 110u, 4u * h + g);
    return unpack_bytes(((ql >> (2u * j)) & 0x03030303u) | (((hm >> (4u * n + j)) & 0x01010101u) << 2));
}

#elif defined(TYPE_IQ2_XXS) || defined(TYPE_IQ2_XS) || defined(TYPE_IQ2_S) || defined(TYPE_IQ3_XXS) || defined(TYPE_IQ3_S)
// Codebook types: get_q4 returns grid magnitudes times signs, get_dm the
// run's scale. Sign fields of 7 bits imply an 8th that makes the count of negatives even.
vec4 signs4(uint bits) {  // +-1 for bits 0..3 (set: negative)
    return vec4(1.0) - 2.0 * vec4(uvec4(bits, bits >> 1, bits >> 2, bits >> 3) & 1u);
}
vec4 signed4(vec4 v, uint bits) {  // v with its sign flipped where bits 0..3 are set
    return uintBitsToFloat(floatBitsToUint(v) ^ ((uvec4(bits, bits >> 1, bits >> 2, bits >> 3) & 1u) << 31));
}
uint even_signs(uint s7) {
    return s7 | ((bitCount(s7) & 1u) << 7);
}
// even_signs of up to four 7-bit fields at once: u holds them in bits 0..6 of its bytes; each
// byte's parity folded into its bit 0 by xor (no bit crosses into the next byte's result) and
// set as its bit 7. lavapipe's LLVM (no vector popcount here) spends ~10 operations per
// bitCount; this is 9 for all four.
uint even_signs_bytes(uint u) {
    uint p = u ^ (u >> 4);
    p ^= p >> 2;
    p ^= p >> 1;
    return u | ((p & 0x01010101u) << 7);
}
#define QK 256u

#if defined(TYPE_IQ2_XXS)
// 66 bytes = 33 halfwords: f16 d; per 32 weights (unit iu) a u32 of 4 grid indices (8 weights
// each) and a u32 of four 7-bit sign fields with a 4-bit scale s on top; w = d (0.5 + s) / 4 * g.
#define QU 32u
// Words from byte 2 of the block: 2 iu (indices), 2 iu + 1 (signs and scale).
vec2 get_dm(uint ib, uint iu) {
    uint aux = field_word(ib * 66u + 2u, 2u * iu + 1u);
    return vec2(float(data_a[ib].d) * (0.5 + float(aux >> 28)) * 0.25, 0.0);
}
vec4 get_q4(uint ib, uint iu, uint g) {
    uint l = g >> 1;
    uint gi = (field_word(ib * 66u + 2u, 2u * iu) >> (8u * l)) & 255u;
    uint s = even_signs((field_word(ib * 66u + 2u, 2u * iu + 1u) >> (7u * l)) & 127u);
    return unpack_bytes(grid_word(2u * gi + (g & 1u))) * signs4(s >> (4u * (g & 1u)));
}
// mul_mv's whole-unit dot (UNIT_QDOT): q . x over the unit and its scale, with the block read
// as a window (block_window) and the signs xor'ed into x's sign bits.
#define UNIT_QDOT
float unit_qdot(uint ib, uint ibr, uint iu, vec4 xv[QU / 4u], out vec2 dm) {
    const Window win = block_window(ib, ibr);
    const uint qw = win_word(win, 2u + 8u * iu), aux = win_word(win, 6u + 8u * iu);
    dm = vec2(unpackHalf2x16(win_word(win, 0u)).x * (0.5 + float(aux >> 28)) * 0.25, 0.0);
    // the four 7-bit sign fields, one a byte, with their eighth (parity) bits
    const uint s8 = even_signs_bytes((aux & 0x7Fu) | ((aux << 1) & 0x7F00u) | ((aux << 2) & 0x7F0000u)
                                     | ((aux << 3) & 0x7F000000u));
    float q = 0.0;
    [[unroll]] for (uint l = 0u; l < 4u; l++) {
        uint gi = (qw >> (8u * l)) & 255u;
        uint s = s8 >> (8u * l);  // signed4 reads bits 0..3 (and s >> 4 bits 4..7) only
        q += dot(unpack_bytes(grid_word(2u * gi)), signed4(xv[2u * l], s));
        q += dot(unpack_bytes(grid_word(2u * gi + 1u)), signed4(xv[2u * l + 1u], s >> 4));
    }
    return q;
}

#elif defined(TYPE_IQ2_XS)
// 74 bytes = 37 halfwords: f16 d; 32 u16 (9-bit grid index, 7-bit sign field), one per 8
// weights; 8 bytes of 4-bit scales, one per 16 weights (the unit); w = d (0.5 + s) / 4 * g.
#define QU 16u
// Words from byte 2 of the block: iu (the unit's two u16s), 16 and 17 (the scales).
vec2 get_dm(uint ib, uint iu) {
    uint s = (field_word(ib * 74u + 2u, 16u + (iu >> 3)) >> (4u * (iu & 7u))) & 15u;
    return vec2(float(data_a[ib].d) * (0.5 + float(s)) * 0.25, 0.0);
}
vec4 get_q4(uint ib, uint iu, uint g) {
    uint q = (field_word(ib * 74u + 2u, iu) >> (16u * (g >> 1))) & 0xFFFFu;
    uint s = even_signs(q >> 9);
    return unpack_bytes(grid_word(2u * (q & 511u) + (g & 1u))) * signs4(s >> (4u * (g & 1u)));
}
#define UNIT_QDOT  // as IQ2_XXS's: the unit's two u16s read as one word
float unit_qdot(uint ib, uint ibr, uint iu, vec4 xv[QU / 4u], out vec2 dm) {
    const Window win = block_window(ib, ibr);
    const uint w = win_word(win, 2u + 4u * iu);
    const uint s = (win_word(win, 66u + 4u * (iu >> 3)) >> (4u * (iu & 7u))) & 15u;
    dm = vec2(unpackHalf2x16(win_word(win, 0u)).x * (0.5 + float(s)) * 0.25, 0.0);
    float q = 0.0;
    [[unroll]] for (uint l = 0u; l < 2u; l++) {
        uint qq = (w >> (16u * l)) & 0xFFFFu;
        uint gi = qq & 511u, s = even_signs(qq >> 9);
        q += dot(unpack_bytes(grid_word(2u * gi)), signed4(xv[2u * l], s));
        q += dot(unpack_bytes(grid_word(2u * gi + 1u)), signed4(xv[2u * l + 1u], s >> 4));
    }
    return q;
}

#elif defined(TYPE_IQ2_S)
// 82 bytes: f16 d; 32 low bytes of 10-bit grid indices; 32 sign bytes; 8 bytes of the indices'
// high 2 bits; 8 bytes of 4-bit scales, one per 16 weights (the unit).
#define QU 16u
// Words from byte 2 of the block: 0..7 index bytes, 8..15 sign bytes, 16..17 qh, 18..19 scales.
uint iq2s_byte(uint ib, uint word0, uint i) {  // byte i of the field at word word0
    return (field_word(ib * 82u + 2u, word0 + (i >> 2)) >> (8u * (i & 3u))) & 255u;
}
vec2 get_dm(uint ib, uint iu) {
    uint s = (iq2s_byte(ib, 18u, iu >> 1) >> (4u * (iu & 1u))) & 15u;
    return vec2(float(data_a[ib].d) * (0.5 + float(s)) * 0.25, 0.0);
}
vec4 get_q4(uint ib, uint iu, uint g) {
    uint l = 2u * (iu & 1u) + (g >> 1);  // 8-weight group within the 32
    uint q = (field_word(ib * 82u + 2u, iu >> 1) >> (8u * l)) & 255u;
    uint gi = q | (((iq2s_byte(ib, 16u, iu >> 1) >> (2u * l)) & 3u) << 8);
    uint s = (field_word(ib * 82u + 2u, 8u + (iu >> 1)) >> (8u * l)) & 255u;
    return unpack_bytes(grid_word(2u * gi + (g & 1u))) * signs4(s >> (4u * (g & 1u)));
}
#define UNIT_QDOT  // as IQ2_XXS's
float unit_qdot(uint ib, uint ibr, uint iu, vec4 xv[QU / 4u], out vec2 dm) {
    // word j of the fields from byte 2 is at byte 2 + 4j of the block
    const Window win = block_window(ib, ibr);
    const uint qw = win_word(win, 2u + 4u * (iu >> 1)), sw = win_word(win, 34u + 4u * (iu >> 1));
    const uint qh = (win_word(win, 66u + 4u * (iu >> 3)) >> (8u * ((iu >> 1) & 3u))) & 255u;
    const uint s = (win_word(win, 74u + 4u * (iu >> 3)) >> (8u * ((iu >> 1) & 3u) + 4u * (iu & 1u))) & 15u;
    dm = vec2(unpackHalf2x16(win_word(win, 0u)).x * (0.5 + float(s)) * 0.25, 0.0);
    float q = 0.0;
    [[unroll]] for (uint h = 0u; h < 2u; h++) {
        uint l = 2u * (iu & 1u) + h;
        uint gi = ((qw >> (8u * l)) & 255u) | (((qh >> (2u * l)) & 3u) << 8);
        uint s = (sw >> (8u * l)) & 255u;
        q += dot(unpack_bytes(grid_word(2u * gi)), signed4(xv[2u * h], s));
        q += dot(unpack_bytes(grid_word(2u * gi + 1u)), signed4(xv[2u * h + 1u], s >> 4));
    }
    return q;
}

#elif defined(TYPE_IQ3_XXS)
// 98 bytes = 49 halfwords: f16 d; 64 grid indices (4 weights each); per 32 weights (the unit)
// a u32 of four 7-bit sign fields and a 4-bit scale s on top; w = d (0.5 + s) / 2 * g.
#define QU 32u
// Words from byte 2 of the block: 0..15 index bytes, 16 + iu the unit's signs and scale.
vec2 get_dm(uint ib, uint iu) {
    uint aux = field_word(ib * 98u + 2u, 16u + iu);
    return vec2(float(data_a[ib].d) * (0.5 + float(aux >> 28)) * 0.5, 0.0);
}
vec4 get_q4(uint ib, uint iu, uint g) {
    uint gi = (field_word(ib * 98u + 2u, 2u * iu + (g >> 2)) >> (8u * (g & 3u))) & 255u;
    uint s = even_signs((field_word(ib * 98u + 2u, 16u + iu) >> (7u * (g >> 1))) & 127u);
    return unpack_bytes(grid_word(gi)) * signs4(s >> (4u * (g & 1u)));
}

#else  // IQ3_S
// 110 bytes: f16 d; 64 low bytes of 9-bit grid indices (4 weights each); 8 bytes of high
// bits; 32 sign bytes (a bit per weight); 4 bytes of 4-bit scales, one per 32 weights (the
// unit); w = d (1 + 2 s) * g.
#define QU 32u
// Words from byte 2 of the block: 0..15 index bytes, 16..17 qh, 18..25 signs, 26 scales.
vec2 get_dm(uint ib, uint iu) {
    uint s = (field_word(ib * 110u + 2u, 26u) >> (4u * iu)) & 15u;
    return vec2(float(data_a[ib].d) * float(1u + 2u * s), 0.0);
}
vec4 get_q4(uint ib, uint iu, uint g) {
    uint q = field_word(ib * 110u + 2u, 2u * iu + (g >> 2));
    uint qh = field_word(ib * 110u + 2u, 16u + (iu >> 2)) >> (8u * (iu & 3u));
    uint gi = ((q >> (8u * (g & 3u))) & 255u) | (((qh >> g) & 1u) << 8);
    uint s = (field_word(ib * 110u + 2u, 18u + iu) >> (8u * (g >> 1))) & 255u;
    return unpack_bytes(grid_word(gi)) * signs4(s >> (4u * (g & 1u)));
}
#endif

#elif defined(TYPE_IQ1_S)
// 50 bytes = 25 halfwords: f16 d; 32 low bytes of 11-bit grid indices (8 weights each); per 32
// weights (the unit) a u16: four 3-bit index highs, a 3-bit scale s, the delta's sign on top.
// Grid words hold value + 1 per nibble: w = dl (v + delta) = dl * nibble + dl (delta - 1).
#define QK 256u
#define QU 32u
#define A_HAS_MIN
// Words from byte 2 of the block: iu (the unit's index bytes), 8 + iu / 2 (two units' qh).
uint iq1s_qh(uint ib, uint iu) {
    return (field_word(ib * 50u + 2u, 8u + (iu >> 1)) >> (16u * (iu & 1u))) & 0xFFFFu;
}
vec2 get_dm(uint ib, uint iu) {
    uint qh = iq1s_qh(ib, iu);
    float dl = float(data_a[ib].d) * float(2u * ((qh >> 12) & 7u) + 1u);
    float delta = (qh & 0x8000u) != 0u ? -0.125 : 0.125;
    return vec2(dl, dl * (delta - 1.0));
}
vec4 get_q4(uint ib, uint iu, uint g) {
    uint l = g >> 1;
    uint q = (field_word(ib * 50u + 2u, iu) >> (8u * l)) & 255u;
    uint gi = q | (((iq1s_qh(ib, iu) >> (3u * l)) & 7u) << 8);
    uint n = grid_word(gi) >> (16u * (g & 1u));
    return vec4(uvec4(n, n >> 4, n >> 8, n >> 12) & 15u);
}
#define UNIT_QDOT  // the unit's index word and qh read once
float unit_qdot(uint ib, uint ibr, uint iu, vec4 xv[QU / 4u], out vec2 dm) {
    const Window win = block_window(ib, ibr);
    const uint qh = (win_word(win, 34u + 4u * (iu >> 1)) >> (16u * (iu & 1u))) & 0xFFFFu;
    const uint qw = win_word(win, 2u + 4u * iu);
    float dl = unpackHalf2x16(win_word(win, 0u)).x * float(2u * ((qh >> 12) & 7u) + 1u);
    dm = vec2(dl, dl * (((qh & 0x8000u) != 0u ? -0.125 : 0.125) - 1.0));
    float q = 0.0;
    [[unroll]] for (uint l = 0u; l < 4u; l++) {
        uint n = grid_word(((qw >> (8u * l)) & 255u) | (((qh >> (3u * l)) & 7u) << 8));
        q += dot(vec4(uvec4(n, n >> 4, n >> 8, n >> 12) & 15u), xv[2u * l]);
        q += dot(vec4(uvec4(n >> 16, n >> 20, n >> 24, n >> 28) & 15u), xv[2u * l + 1u]);
    }
    return q;
}

#elif defined(TYPE_IQ1_M)
// 56 bytes = 14 words: 32 low bytes of 11-bit grid indices (8 weights each); 16 bytes of
// nibbles, one per index (3 high index bits, the delta's sign in bit 3); four u16 of four
// 3-bit scales (one per 16 weights, the unit) whose top nibbles make the f16 d. The delta
// changes every 8 weights, inside a unit, so get_q4 returns v + delta.
#define QK 256u
#define QU 16u
// (scale, 0) of unit iu from the block's two scale words and its 3-bit scale s
vec2 iq1m_dm(uint w01, uint w23, uint s) {
    uint d16 = ((w01 >> 12) & 0xFu) | ((w01 >> 24) & 0xF0u) | ((w23 >> 4) & 0xF00u) | ((w23 >> 16) & 0xF000u);
    return vec2(unpackHalf2x16(d16).x * float(2u * s + 1u), 0.0);
}
// weights 4g..4g+3 of unit iu from the block's qs word (i >> 2) and qh word (8 + (i >> 3)), i = 2 iu + g / 2
vec4 iq1m_q4(uint qs, uint qh, uint iu, uint g) {
    uint i = 2u * iu + (g >> 1);
    uint nib = (qh >> (4u * (i & 7u))) & 15u;
    uint gi = ((qs >> (8u * (i & 3u))) & 255u) | ((nib & 7u) << 8);
    uint n = grid_word(gi) >> (16u * (g & 1u));
    float delta = (nib & 8u) != 0u ? -0.125 : 0.125;
    return vec4(uvec4(n, n >> 4, n >> 8, n >> 12) & 15u) + (delta - 1.0);
}
vec2 get_dm(uint ib, uint iu) {
    // d from the four u16 scales read as two words (a block is 14 words, so word-aligned)
    uint s = (uint(data_a[ib].scales[iu >> 2]) >> (3u * (iu & 3u))) & 7u;
    return iq1m_dm(data_a32[ib * 14u + 12u], data_a32[ib * 14u + 13u], s);
}
vec4 get_q4(uint ib, uint iu, uint g) {
    uint i = 2u * iu + (g >> 1);
    // qs[i] and qh[i / 2] from words (qs: words 0..7, qh: words 8..11)
    return iq1m_q4(data_a32[ib * 14u + (i >> 2)], data_a32[ib * 14u + 8u + (i >> 3)], iu, g);
}
// mul_mv's one-row dot: the unit from the block's window (block_window), summed term for term
// as unit_dot's get_q4 loop and the many-row XROWS kernel (a row gets the same bits from
// either), so IQ1_M keeps the many-row kernel.
#define UNIT_QDOT
float unit_qdot(uint ib, uint ibr, uint iu, vec4 xv[QU / 4u], out vec2 dm) {
    float q = 0.0;
    const Window win = block_window(ib, ibr);  // r = 0: the block is whole words
    const uint sw = win.v[12u + (iu >> 3)];  // scales[iu >> 2]: half (iu >> 2) & 1 of word 12 + iu / 8
    dm = iq1m_dm(win.v[12], win.v[13], (sw >> (16u * ((iu >> 2) & 1u) + 3u * (iu & 3u))) & 7u);
    [[unroll]] for (uint g = 0u; g < QU / 4u; g++) {
        const uint i = 2u * iu + (g >> 1);
        q += dot(iq1m_q4(win.v[i >> 2], win.v[8u + (i >> 3)], iu, g), xv[g]);
    }
    return q;
}

#elif defined(TYPE_IQ4_NL) || defined(TYPE_IQ4_XS)
// Nibbles select one of 16 non-linear levels. IQ4_NL: 18 bytes = 9 halfwords, f16 d, nibbles
// laid out as Q4_0's; w = d * level. IQ4_XS: 136 bytes = 34 words: f16 d, u16 of the 6-bit
// scales' high 2 bits, 4 bytes of their low nibbles, 128 bytes of nibbles laid out per 32
// weights (the unit) as IQ4_NL's; w = d (s - 32) * level.
// The levels are int8s packed four to a word in grid[0..3]: every lane reads the same four
// words (no per-lane gathers) and selects its level with compares and shifts.
vec4 levels4(uint w) {
    const uvec4 lv = uvec4(grid[0], grid[1], grid[2], grid[3]);
    uvec4 n = uvec4(w, w >> 8, w >> 16, w >> 24) & 15u;
    uvec4 word = mix(mix(uvec4(lv.x), uvec4(lv.y), greaterThanEqual(n, uvec4(4u))),
                     mix(uvec4(lv.z), uvec4(lv.w), greaterThanEqual(n, uvec4(12u))), greaterThanEqual(n, uvec4(8u)));
    return vec4(ivec4(word << (24u - 8u * (n & 3u))) >> 24);
}
#if defined(TYPE_IQ4_NL)
#define QK 32u
#define QU 32u
vec2 get_dm(uint ib, uint iu) { return vec2(float(data_a[ib].d), 0.0); }
vec4 get_q4(uint ib, uint iu, uint g) {
    uint w = field_word(ib * 18u + 2u, g & 3u);
    return levels4(g >= 4u ? (w >> 4) : w);
}
#else
#define QK 256u
#define QU 32u
vec2 get_dm(uint ib, uint iu) {
    uint lo = (data_a32[ib * 34u + 1u] >> (4u * iu)) & 15u;  // scales_l: word 1
    uint hi = (data_a32[ib * 34u] >> (16u + 2u * iu)) & 3u;  // scales_h: the top of word 0
    return vec2(float(data_a[ib].d) * float(int(lo | (hi << 4)) - 32), 0.0);
}
vec4 get_q4(uint ib, uint iu, uint g) {
    uint w = data_a32[ib * 34u + 2u + 4u * iu + (g & 3u)];
    return levels4(g >= 4u ? (w >> 4) : w);
}
#endif
#endif

#endif  // block-quantized types

#ifndef HAS_UNIT_LOAD
// A unit's get_q4 values, for the types without a cheaper read of a whole unit.
void get_unit(uint ib, uint iu, out vec4 q[QU / 4u]) {
    [[unroll]] for (uint g = 0u; g < QU / 4u; g++) {
        q[g] = get_q4(ib, iu, g);
    }
}
#endif

// The four dequantized weights 4g..4g+3 of unit iu of block ib.
vec4 dequant4(uint ib, uint iu, uint g) {
    vec2 dm = get_dm(ib, iu);
    return dm.x * get_q4(ib, iu, g) + dm.y;
}

// The four dequantized weights at column k (a multiple of 4) of the row starting at block rb.
vec4 dequant4_at(uint rb, uint k) {
    return dequant4(rb + k / QK, (k % QK) / QU, (k % QU) / 4u);
}
