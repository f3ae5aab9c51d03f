#version 450
// MoE router with sigmoid scores (GLM-4.5): s = sigmoid(logit) per expert. The top k are chosen
// by s + bias (the expert-score correction bias; flag 2, else no bias), among the groups_used of
// n_groups equal groups whose two best biased scores sum highest (ties: the lower group, the
// lower expert); their weights are the unbiased s, renormalised to sum 1 (flag 1; the sum
// clamped below at 2^-14 as llama.cpp does), times scale. One workgroup per token row.
// SLOT_LUT: also the slot table, as softmax_topk.comp.
#include "common.glsl"

layout(local_size_x_id = 0) in;
#define MAX_EXPERTS 1024u
#define MAX_GROUPS 64u

layout(binding = 0, std430) readonly buffer Logits { float logits[]; };
layout(binding = 1, std430) readonly buffer Bias { float bias[]; };
layout(binding = 2, std430) writeonly buffer Ids { int ids[]; };
layout(binding = 3, std430) writeonly buffer Wts { float wts[]; };
#define LUT_BINDING 4
#include "slot_lut.glsl"

layout(push_constant) uniform Push {
    uint n_experts;
    uint k;
    uint stride;      // floats between rows of logits
    uint flags;       // 1: renormalise the top k; 2: add bias for the choice
    uint n_groups;    // 1: no groups
    uint groups_used;
    float scale;
#ifdef SLOT_LUT
    uint lut_base;
#endif
} pc;

shared float vals[MAX_EXPERTS];
shared float gsum[MAX_GROUPS];
shared uint gkeep[MAX_GROUPS];
shared float best_v[gl_WorkGroupSize.x];
shared uint best_i[gl_WorkGroupSize.x];
shared float kept[32];

float sigmoid(float x) {
    return 1.0 / (1.0 + exp(-x));
}

void main() {
    const uint r = flat_group();
    const uint tid = gl_LocalInvocationID.x;
    const uint WG = gl_WorkGroupSize.x;
    const float NEG_INF = -1.0 / 0.0;
    for (uint i = tid; i < pc.n_experts; i += WG) {
        const float s = sigmoid(logits[r * pc.stride + i]);
        vals[i] = (pc.flags & 2u) != 0u ? s + bias[i] : s;
    }
    barrier();
    if (pc.n_groups > 1u) {
        const uint per = pc.n_experts / pc.n_groups;
        for (uint g = tid; g < pc.n_groups; g += WG) {
            float a = NEG_INF, b = NEG_INF;
            for (uint j = 0u; j < per; j++) {
                const float v = vals[g * per + j];
                if (v > a) {
                    b = a;
                    a = v;
                } else if (v > b) {
                    b = v;
                }
            }
            gsum[g] = a + b;
            gkeep[g] = 0u;
        }
        barrier();
        if (tid == 0u) {
            for (uint j = 0u; j < pc.groups_used; j++) {
                uint bi = 0xFFFFFFFFu;
                for (uint g = 0u; g < pc.n_groups; g++) {
                    if (gkeep[g] == 0u && (bi == 0xFFFFFFFFu || gsum[g] > gsum[bi])) {
                        bi = g;
                    }
                }
                gkeep[bi] = 1u;
            }
        }
        barrier();
        for (uint i = tid; i < pc.n_experts; i += WG) {
            if (gkeep[i / per] == 0u) {
                vals[i] = NEG_INF;
            }
        }
        barrier();
    }
    float total = 0.0;
    for (uint j = 0u; j < pc.k; j++) {
        float bv = NEG_INF;
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
        const float p = sigmoid(logits[r * pc.stride + sel]);
        total += p;
        barrier();  // every thread has read best_i[0] before the next round writes it
        if (tid == 0u) {
            ids[r * pc.k + j] = int(sel);
            SLOT_OF(r * pc.k + j, sel);
            kept[j] = p;
            vals[sel] = NEG_INF;
        }
        barrier();
    }
    for (uint j = tid; j < pc.k; j += WG) {  // (a workgroup may be narrower than k)
        float w = kept[j];
        if ((pc.flags & 1u) != 0u) {
            w /= max(total, 6.103515625e-5);
        }
        wts[r * pc.k + j] = w * pc.scale;
    }
}
