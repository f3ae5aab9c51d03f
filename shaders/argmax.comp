#version 450
// argmax over each row (ties: the lowest index, like numpy). One workgroup per row.
// GREEDY_NEXT: a greedy decode step's tail over one row of logits: NaN / inf are skipped and
// flagged, the argmax becomes the next step's token (tok[0]), its position moves on by one
// (pos[0] += 1), and the host gets (token, any NaN / inf) in o[0..1].
#include "common.glsl"

layout(local_size_x_id = 0) in;

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) writeonly buffer Out { int o[]; };
#ifdef GREEDY_NEXT
layout(binding = 2, std430) writeonly buffer Tok { int tok[]; };
layout(binding = 3, std430) buffer Pos { int pos[]; };
shared uint bad[gl_WorkGroupSize.x];
#endif

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
#ifdef GREEDY_NEXT
    uint nf = 0u;
#endif
    for (uint i = tid; i < pc.n; i += gl_WorkGroupSize.x) {
        const float v = x[r * pc.stride + i];
#ifdef GREEDY_NEXT
        if ((floatBitsToUint(v) & 0x7F800000u) == 0x7F800000u) {  // (NaN / inf: as nonfinite.comp tests)
            nf = 1u;
            continue;
        }
#endif
        if (v > bv || bi == 0xFFFFFFFFu) {
            bv = v;
            bi = i;
        }
    }
    best_v[tid] = bv;
    best_i[tid] = bi;
#ifdef GREEDY_NEXT
    bad[tid] = nf;
#endif
    barrier();
    for (uint s = gl_WorkGroupSize.x / 2u; s > 0u; s >>= 1) {
        if (tid < s) {
            const float ov = best_v[tid + s];
            const uint oi = best_i[tid + s];
            if (oi != 0xFFFFFFFFu && (best_i[tid] == 0xFFFFFFFFu || ov > best_v[tid] || (ov == best_v[tid] && oi < best_i[tid]))) {
                best_v[tid] = ov;
                best_i[tid] = oi;
            }
#ifdef GREEDY_NEXT
            bad[tid] |= bad[tid + s];
#endif
        }
        barrier();
    }
    if (tid == 0u) {
#ifdef GREEDY_NEXT
        // (every logit non-finite: token 0, so the step queued after this one reads in bounds)
        const int t = best_i[0] == 0xFFFFFFFFu ? 0 : int(best_i[0]);
        tok[0] = t;
        pos[0] = pos[0] + 1;
        o[0] = t;
        o[1] = int(bad[0]);
#else
        o[r] = int(best_i[0]);
#endif
    }
}
