#version 450
// RMSNorm over rows: out[r, i] = x[r, i] / sqrt(mean(x[r, :]^2) + eps) * w[i].
// A per-head norm is the same kernel over rows of head_dim.
#include "common.glsl"

layout(local_size_x_id = 0) in;

#ifdef VEC4
// four floats a read (n and the strides multiples of 4): a quarter of the reads
layout(binding = 0, std430) readonly buffer X { vec4 x[]; };
layout(binding = 1, std430) readonly buffer W { vec4 w[]; };
layout(binding = 2, std430) buffer Out { vec4 o[]; };
#define V 4u
#else
layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) readonly buffer W { float w[]; };
layout(binding = 2, std430) buffer Out { float o[]; };
#define V 1u
#endif

layout(push_constant) uniform Push {
    uint n;           // row length
    uint x_stride;    // floats between rows of x
    uint out_stride;  // floats between rows of out
    float eps;
    uint flags;       // 1: multiply by w
} pc;

#include "reduce.glsl"

void main() {
    const uint r = flat_group();
    const uint tid = gl_LocalInvocationID.x;
    const uint n = pc.n / V, xs = pc.x_stride / V, os = pc.out_stride / V;
    float ss = 0.0;
    for (uint i = tid; i < n; i += gl_WorkGroupSize.x) {
#ifdef VEC4
        const vec4 v = x[r * xs + i];
        ss += dot(v, v);
#else
        const float v = x[r * xs + i];
        ss += v * v;
#endif
    }
    ss = wg_sum(ss);
    const float scale = 1.0 / sqrt(ss / float(pc.n) + pc.eps);
    for (uint i = tid; i < n; i += gl_WorkGroupSize.x) {
        if ((pc.flags & 1u) != 0u) {
            o[r * os + i] = x[r * xs + i] * scale * w[i];
        } else {
            o[r * os + i] = x[r * xs + i] * scale;
        }
    }
}
