#version 450
// The slots of each token added (the grouped expert mat-vec's "sum" mode, shaders/mul_mv.comp
// XROWS + MUL_ID, which writes each slot's weighted product to its own row):
//   y[t, c] (+)= sum over s < k with e_lo <= ids[t, s] < e_hi of p[(t * k + s) * n + c]
// Slots whose expert is outside [e_lo, e_hi) were not written (an expert in no part).
#include "common.glsl"

layout(local_size_x_id = 0) in;

layout(binding = 1, std430) readonly buffer Ids { int ids[]; };
#ifdef VEC4
// four columns per thread (n and y_stride multiples of 4): a quarter of the reads, each a vec4
layout(binding = 0, std430) readonly buffer P { vec4 p[]; };
layout(binding = 2, std430) buffer Y { vec4 y[]; };
#define W 4u
#define ZERO vec4(0.0)
#else
layout(binding = 0, std430) readonly buffer P { float p[]; };
layout(binding = 2, std430) buffer Y { float y[]; };
#define W 1u
#define ZERO 0.0
#endif

layout(push_constant) uniform Push {
    uint n;         // floats per row
    uint n_tokens;
    uint k;         // slots per token
    uint y_stride;  // floats between rows of y
    uint flags;     // 1: add to y
    int e_lo;
    int e_hi;
} pc;

void main() {
    const uint n = pc.n / W;  // (vectors of) columns per row
    const uint i = flat_group() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (i >= n * pc.n_tokens) {
        return;
    }
    const uint t = i / n, c = i % n;
#ifdef VEC4
    vec4 v = vec4(0.0);
#else
    float v = 0.0;
#endif
    for (uint s = 0u; s < pc.k; s++) {
        const int e = ids[t * pc.k + s];
        if (e >= pc.e_lo && e < pc.e_hi) {
            v += p[(t * pc.k + s) * n + c];
        }
    }
    const uint o = t * (pc.y_stride / W) + c;
    y[o] = ((pc.flags & 1u) != 0u ? y[o] : ZERO) + v;
}
