#version 450
// A greedy decode step's tail, on the device: the argmax of the logits row (ties: the lowest
// index, as numpy's) becomes the next step's token, its position moves on by one, and the
// host gets (token, whether any logit is NaN or inf). One workgroup.
#include "common.glsl"

layout(local_size_x_id = 0) in;

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) writeonly buffer Tok { int tok[]; };
layout(binding = 2, std430) buffer Pos { int pos[]; };
layout(binding = 3, std430) writeonly buffer Out { int o[]; };

layout(push_constant) uniform Push {
    uint n;
} pc;

shared float best_v[gl_WorkGroupSize.x];
shared uint best_i[gl_WorkGroupSize.x];
shared uint bad[gl_WorkGroupSize.x];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    float bv = 0.0;
    uint bi = 0xFFFFFFFFu;
    uint nf = 0u;
    for (uint i = tid; i < pc.n; i += gl_WorkGroupSize.x) {
        const float v = x[i];
        if (isnan(v) || isinf(v)) {
            nf = 1u;
        } else if (bi == 0xFFFFFFFFu || v > bv) {
            bv = v;
            bi = i;
        }
    }
    best_v[tid] = bv;
    best_i[tid] = bi;
    bad[tid] = nf;
    barrier();
    for (uint s = gl_WorkGroupSize.x / 2u; s > 0u; s >>= 1) {
        if (tid < s) {
            const float ov = best_v[tid + s];
            const uint oi = best_i[tid + s];
            if (oi != 0xFFFFFFFFu && (best_i[tid] == 0xFFFFFFFFu || ov > best_v[tid] || (ov == best_v[tid] && oi < best_i[tid]))) {
                best_v[tid] = ov;
                best_i[tid] = oi;
            }
            bad[tid] |= bad[tid + s];
        }
        barrier();
    }
    if (tid == 0u) {
        // (every logit non-finite: token 0, so the step queued after this one still reads in bounds)
        const int t = best_i[0] == 0xFFFFFFFFu ? 0 : int(best_i[0]);
        tok[0] = t;
        pos[0] = pos[0] + 1;
        o[0] = t;
        o[1] = int(bad[0]);
    }
}
