#version 450
// Scatter rows into a KV cache stored as ggml blocks (KV_F16, KV_Q8_0 or KV_Q4_0): row r of src
// (floats) goes to row pos[r] of dst (row pos[r] % dst_rows with dst_rows > 0, a ring), each 32
// values one block as ggml's reference quantizer writes it (numpy twin: quants.<T>.quantize).
// One thread a block (F16: 32 values, fewer at the end of a row). Blocks of 34 and 18 bytes
// straddle 32-bit words: the words a block fills are stored, the ones it shares with a
// neighbouring block take its bytes by atomicAnd / atomicOr.
#include "common.glsl"

layout(local_size_x_id = 0) in;

layout(binding = 0, std430) readonly buffer Src { float src[]; };
layout(binding = 1, std430) readonly buffer Pos { int pos[]; };
layout(binding = 2, std430) buffer Dst { uint dst[]; };

layout(push_constant) uniform Push {
    uint n;            // floats per row (a multiple of 32)
    uint src_stride;   // floats between src rows
    uint row_bytes;    // bytes of a dst row
    uint dst_rows;     // 0: no wrap
} pc;

#if defined(KV_Q8_0)
#define BLOCK_BYTES 34u
#elif defined(KV_Q4_0)
#define BLOCK_BYTES 18u
#else
#define BLOCK_BYTES 64u
#endif

uint bytes[BLOCK_BYTES];

// C's roundf (halves away from zero), as gguf's numpy twin computes it
float roundf_(float v) {
    const float a = abs(v);
    const float f = floor(a);
    return sign(v) * (f + floor(2.0 * (a - f)));
}

void put_half(uint at, float v) {
    const uint h = packHalf2x16(vec2(v, 0.0)) & 0xFFFFu;
    bytes[at] = h & 0xFFu;
    bytes[at + 1u] = h >> 8;
}

void main() {
    const uint b = gl_GlobalInvocationID.x;
    const uint r = gl_WorkGroupID.y;
    if (b * 32u >= pc.n) {
        return;
    }
    const uint len = min(32u, pc.n - b * 32u);  // (32 but at the end of an F16 row)
    float x[32];
    const uint s0 = r * pc.src_stride + b * 32u;
    for (uint i = 0u; i < 32u; i++) {
        x[i] = i < len ? src[s0 + i] : 0.0;
    }
#if defined(KV_Q8_0)
    float amax = 0.0;
    for (uint i = 0u; i < 32u; i++) {
        amax = max(amax, abs(x[i]));
    }
    const float d = amax / 127.0;
    const float id = d != 0.0 ? 1.0 / d : 0.0;
    put_half(0u, d);
    for (uint i = 0u; i < 32u; i++) {
        bytes[2u + i] = uint(int(roundf_(x[i] * id))) & 0xFFu;
    }
#elif defined(KV_Q4_0)
    float amax = 0.0;
    float m = 0.0;
    for (uint i = 0u; i < 32u; i++) {
        if (amax < abs(x[i])) {  // the first value of the largest magnitude, with its sign
            amax = abs(x[i]);
            m = x[i];
        }
    }
    const float d = m / -8.0;
    const float id = d != 0.0 ? 1.0 / d : 0.0;
    put_half(0u, d);
    for (uint j = 0u; j < 16u; j++) {
        const uint lo = min(15u, uint(int(x[j] * id + 8.5)));
        const uint hi = min(15u, uint(int(x[j + 16u] * id + 8.5)));
        bytes[2u + j] = lo | (hi << 4);
    }
#else
    for (uint i = 0u; i < len; i++) {
        put_half(2u * i, x[i]);
    }
#endif
#ifdef KV_F16
    const uint nbytes = 2u * len;
#else
    const uint nbytes = BLOCK_BYTES;
#endif
    const uint row = pc.dst_rows > 0u ? uint(pos[r]) % pc.dst_rows : uint(pos[r]);
    const uint at = row * pc.row_bytes + b * BLOCK_BYTES;  // the block's first byte
    for (uint w = at / 4u; w * 4u < at + nbytes; w++) {
        uint bits = 0u;
        uint mask = 0u;
        for (uint k = 0u; k < 4u; k++) {
            const uint g = w * 4u + k;
            if (g >= at && g < at + nbytes) {
                bits |= bytes[g - at] << (8u * k);
                mask |= 0xFFu << (8u * k);
            }
        }
        if (mask == 0xFFFFFFFFu) {
            dst[w] = bits;
        } else {
            atomicAnd(dst[w], ~mask);
            atomicOr(dst[w], bits);
        }
    }
}
