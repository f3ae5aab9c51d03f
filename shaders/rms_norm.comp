#version 450
// RMSNorm over rows: out[r, i] = x[r, i] / sqrt(mean(x[r, :]^2) + eps) * w[i].
// A per-head norm is the same kernel over rows of head_dim.
#include "common.glsl"

layout(local_size_x_id = 0) in;

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) readonly buffer W { float w[]; };
layout(binding = 2, std430) buffer Out { float o[]; };

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
    float ss = 0.0;
    for (uint i = tid; i < pc.n; i += gl_WorkGroupSize.x) {
        const float v = x[r * pc.x_stride + i];
        ss += v * v;
    }
    ss = wg_sum(ss);
    const float scale = 1.0 / sqrt(ss / float(pc.n) + pc.eps);
    for (uint i = tid; i < pc.n; i += gl_WorkGroupSize.x) {
        float v = x[r * pc.x_stride + i] * scale;
        if ((pc.flags & 1u) != 0u) {
            v *= w[i];
        }
        o[r * pc.out_stride + i] = v;
    }
}
