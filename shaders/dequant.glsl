// Dequantization of the weight binding A_BINDING, for the one type selected with -DTYPE_<name>.
//
// Every type exposes the same three things:
//   QK   weights per block (float types: 16-value "blocks" so one row is whole blocks),
//   QU   weights per unit (a run that shares one scale/offset; QU divides QK, 4 divides QU),
//   get_dm(ib, iu) -> (scale, offset) of unit iu of block ib: w = scale * q + offset,
//   get_q4(ib, iu, g) -> the raw quants q of weights 4g..4g+3 of that unit.
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
#else
#error "define one TYPE_<name>"
#endif

layout(binding = A_BINDING, std430) readonly buffer WeightBlocks { A_TYPE data_a[]; };
layout(binding = A_BINDING, std430) readonly buffer WeightU16 { uint16_t data_a16[]; };
layout(binding = A_BINDING, std430) readonly buffer WeightU32 { uint data_a32[]; };

// Four bytes starting at 16-bit word hw (2-byte aligned), little endian.
uint load_u32_at16(uint hw) {
    return uint(data_a16[hw]) | (uint(data_a16[hw + 1u]) << 16);
}

#if defined(TYPE_Q8_0)
// 34 bytes = 17 halfwords: d, then 32 signed bytes.
#define QK 32u
#define QU 32u
vec2 get_dm(uint ib, uint iu) { return vec2(float(data_a[ib].d), 0.0); }
vec4 get_q4(uint ib, uint iu, uint g) {
    uint w = load_u32_at16(ib * 17u + 1u + 2u * g);
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
    uint w = load_u32_at16(ib * 9u + 1u + 2u * (g & 3u));
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
    uint b = load_u32_at16(ib * 9u + 1u + 2u * iu) >> (4u * g);
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
    uint j = (g & 3u) * 4u;
    uvec4 b = uvec4(data_a[ib].qs[j], data_a[ib].qs[j + 1u], data_a[ib].qs[j + 2u], data_a[ib].qs[j + 3u]);
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
vec2 get_dm(uint ib, uint iu) {
    // the 12 scale bytes are words 1..3 of the block (both types are 4-byte multiples)
    const uint wpb = sizeof_block / 4u;
    const uint s0 = data_a32[ib * wpb + 1u], s1 = data_a32[ib * wpb + 2u], s2 = data_a32[ib * wpb + 3u];
    const uint j = (iu & 3u) * 8u;
    uint sc, m;
    if (iu < 4u) {
        sc = (s0 >> j) & 63u;
        m = (s1 >> j) & 63u;
    } else {
        sc = ((s2 >> j) & 0xFu) | (((s0 >> j) >> 6) & 3u) << 4;
        m = ((s2 >> (j + 4u)) & 0xFu) | (((s1 >> j) >> 6) & 3u) << 4;
    }
    vec2 dm = vec2(data_a[ib].dm);
    return vec2(dm.x * float(sc), -dm.y * float(m));
}
#if defined(TYPE_Q4_K)
// 144 bytes = 36 words; quants at word 4: sub-block iu is nibble (iu & 1) of bytes 32 * (iu >> 1) + l.
vec4 get_q4(uint ib, uint iu, uint g) {
    uint w = data_a32[ib * 36u + 4u + (iu >> 1) * 8u + g];
    return unpack_bytes(((iu & 1u) != 0u ? (w >> 4) : w) & 0x0F0F0F0Fu);
}
#else
// 176 bytes = 44 words; high bits at word 4 (bit iu of byte l), low nibbles at word 12.
vec4 get_q4(uint ib, uint iu, uint g) {
    uint ql = data_a32[ib * 44u + 12u + (iu >> 1) * 8u + g];
    ql = ((iu & 1u) != 0u ? (ql >> 4) : ql) & 0x0F0F0F0Fu;
    uint qh = (data_a32[ib * 44u + 4u + g] >> iu) & 0x01010101u;
    return unpack_bytes(ql | (qh << 4));
}
#endif

#elif defined(TYPE_Q6_K)
// 210 bytes = 105 halfwords: ql[128], qh[64], 16 int8 scales, d. Unit iu (16 weights) uses
// scale iu; within a 128-weight half n, quarter q takes nibble (q >> 1) of ql and bits 2q of qh.
#define QK 256u
#define QU 16u
#define A_HAS_MIN
vec2 get_dm(uint ib, uint iu) {
    float d = float(data_a[ib].d) * float(int(data_a[ib].scales[iu]));
    return vec2(d, -32.0 * d);
}
vec4 get_q4(uint ib, uint iu, uint g) {
    uint n = iu >> 3;
    uint quarter = (iu & 7u) >> 1;
    uint l = (iu & 1u) * 16u + g * 4u;
    uint base = ib * 105u;
    uint ql = load_u32_at16(base + (64u * n + l + 32u * (quarter & 1u)) / 2u);
    uint qh = load_u32_at16(base + (128u + 32u * n + l) / 2u);
    ql = (ql >> (4u * (quarter >> 1))) & 0x0F0F0F0Fu;
    qh = ((qh >> (2u * quarter)) & 0x03030303u) << 4;
    return unpack_bytes(ql | qh);
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
    uint w = load_u32_at16(ib * 27u + hw);
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
    uint w = load_u32_at16(ib * 33u + 16u * (iu >> 2) + 2u * g);
    return unpack_bytes((w >> (2u * (iu & 3u))) & 0x03030303u);
}
#endif

#endif  // block-quantized types

// The four dequantized weights 4g..4g+3 of unit iu of block ib.
vec4 dequant4(uint ib, uint iu, uint g) {
    vec2 dm = get_dm(ib, iu);
    return dm.x * get_q4(ib, iu, g) + dm.y;
}

// The four dequantized weights at column k (a multiple of 4) of the row starting at block rb.
vec4 dequant4_at(uint rb, uint k) {
    return dequant4(rb + k / QK, (k % QK) / QU, (k % QU) / 4u);
}
