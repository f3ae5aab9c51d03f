#version 450
// argmax over each row (ties: the lowest index, like numpy). One workgroup per row.
#include "common.glsl"

layout(local_size_x_id = 0) in;

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) writeonly buffer Out { int o[]; };

layout(push_constant) uniform Push {
    uint n;
    uint stride;
} pc;

shared float best_v[gl_WorkGroupSize.x];
shared uint best_i[gl_WorkGroupSize.x];

void main() {
    const uint r = flat_group();
    const uint tid = gl_LocalInvocationID.x;
    float bv = -1.0 / 0.0;
    uint bi = 0xFFFFFFFFu;
    for (uint i = tid; i < pc.n; i += gl_WorkGroupSize.x) {
        const float v = x[r * pc.stride + i];
        if (v > bv || bi == 0xFFFFFFFFu) {
            bv = v;
            bi = i;
        }
    }
    best_v[tid] = bv;
    best_i[tid] = bi;
    barrier();
    for (uint s = gl_WorkGroupSize.x / 2u; s > 0u; s >>= 1) {
        if (tid < s) {
            const float ov = best_v[tid + s];
            const uint oi = best_i[tid + s];
            if (oi != 0xFFFFFFFFu && (best_i[tid] == 0xFFFFFFFFu || ov > best_v[tid] || (ov == best_v[tid] && oi < best_i[tid]))) {
                best_v[tid] = ov;
                best_i[tid] = oi;
            }
        }
        barrier();
    }
    if (tid == 0u) {
        o[r] = int(best_i[0]);
    }
}
