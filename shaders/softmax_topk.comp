#version 450
// MoE router: softmax over a row's expert logits, keep the k largest (ties: lower expert id),
// optionally renormalise the kept weights to sum to 1. One workgroup per token row.
// Ranking uses the logits themselves (softmax is monotonic), so no rounding can reorder them.
// SLOT_LUT (streamed experts, no pause): also table[r, j] = lut[lut_base + id], the pool slot
// holding that expert (see slot_lut.glsl).
#include "common.glsl"

layout(local_size_x_id = 0) in;
#define MAX_EXPERTS 1024u

layout(binding = 0, std430) readonly buffer Logits { float logits[]; };
layout(binding = 1, std430) writeonly buffer Ids { int ids[]; };
layout(binding = 2, std430) writeonly buffer Wts { float wts[]; };
#define LUT_BINDING 3
#include "slot_lut.glsl"

layout(push_constant) uniform Push {
    uint n_experts;
    uint k;
    uint stride;   // floats between rows of logits
    uint flags;    // 1: renormalise the top k
#ifdef SLOT_LUT
    uint lut_base; // the layer's first entry in lut
#endif
} pc;

#include "reduce.glsl"

shared float vals[MAX_EXPERTS];
shared float best_v[gl_WorkGroupSize.x];
shared uint best_i[gl_WorkGroupSize.x];
shared float kept[32];

void main() {
    const uint r = flat_group();
    const uint tid = gl_LocalInvocationID.x;
    const uint WG = gl_WorkGroupSize.x;
    float m = -1.0 / 0.0;
    for (uint i = tid; i < pc.n_experts; i += WG) {
        const float v = logits[r * pc.stride + i];
        vals[i] = v;
        m = max(m, v);
    }
    m = wg_max(m);
    float s = 0.0;
    for (uint i = tid; i < pc.n_experts; i += WG) {
        s += exp(vals[i] - m);
    }
    s = wg_sum(s);
    float total = 0.0;
    for (uint j = 0u; j < pc.k; j++) {
        float bv = -1.0 / 0.0;
        uint bi = 0xFFFFFFFFu;
        for (uint i = tid; i < pc.n_experts; i += WG) {
            const float v = vals[i];
            if (v > bv || (v == bv && i < bi)) {
                bv = v;
                bi = i;
            }
        }
        best_v[tid] = bv;
        best_i[tid] = bi;
        barrier();
        for (uint st = WG / 2u; st > 0u; st >>= 1) {
            if (tid < st) {
                const float ov = best_v[tid + st];
                const uint oi = best_i[tid + st];
                if (ov > best_v[tid] || (ov == best_v[tid] && oi < best_i[tid])) {
                    best_v[tid] = ov;
                    best_i[tid] = oi;
                }
            }
            barrier();
        }
        const uint sel = best_i[0];
        const float p = exp(best_v[0] - m) / s;
        total += p;
        if (tid == 0u) {
            ids[r * pc.k + j] = int(sel);
            SLOT_OF(r * pc.k + j, sel);
            kept[j] = p;
            vals[sel] = -1.0 / 0.0;
        }
        barrier();
    }
    for (uint j = tid; j < pc.k; j += WG) {  // (a workgroup may be narrower than k)
        wts[r * pc.k + j] = (pc.flags & 1u) != 0u ? kept[j] / total : kept[j];
    }
}
