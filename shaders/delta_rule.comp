#version 450
// The gated delta rule, one workgroup per value head h, one invocation per value column j
// (local size = the head width D), the head's state column S[:, j] in registers, rows one
// after another (decode, verify rows and prompt chunks alike: R steps in one dispatch):
//   q, k l2-normalised (q also by 1/sqrt(D));  S = exp(g_t) S;  u = beta_t (v_t - S^T k);
//   S = S + k u^T;  o_t = S^T q
// Value head h reads key head h % Hk (TILED) or h / (Hv / Hk). The state is updated in place.
#include "common.glsl"

#define MAX_D 256

layout(local_size_x_id = 0) in;

layout(binding = 0, std430) readonly buffer Q { float q[]; };        // [R, Hk, D]
layout(binding = 1, std430) readonly buffer K { float k[]; };        // [R, Hk, D]
layout(binding = 2, std430) readonly buffer V { float v[]; };        // [R, Hv, D]
layout(binding = 3, std430) readonly buffer G { float g[]; };        // [R, Hv] log decay
layout(binding = 4, std430) readonly buffer Beta { float beta[]; };  // [R, Hv]
layout(binding = 5, std430) buffer State { float st[]; };            // [Hv, D, D] (key x value)
layout(binding = 6, std430) writeonly buffer Out { float o[]; };     // [R, Hv, D]

layout(push_constant) uniform Push {
    uint rows;
    uint hk;
    uint hv;
    uint d;
    uint tiled;
    float eps;
    uint row0;  // rows [row0, row0 + rows) of the buffers (a long chunk is split over dispatches)
} pc;

shared float ks[MAX_D];
shared float qs[MAX_D];

void main() {
    const uint h = gl_WorkGroupID.x;
    const uint j = gl_LocalInvocationID.x;
    const uint D = pc.d;
    const uint kh = pc.tiled != 0u ? h % pc.hk : h / (pc.hv / pc.hk);
    float s[MAX_D];
    for (uint i = 0u; i < D; i++) {
        s[i] = st[(h * D + i) * D + j];
    }
    const float qscale = 1.0 / sqrt(float(D));
    for (uint t = pc.row0; t < pc.row0 + pc.rows; t++) {
        ks[j] = k[(t * pc.hk + kh) * D + j];
        qs[j] = q[(t * pc.hk + kh) * D + j];
        barrier();
        float sk = 0.0, sq = 0.0;
        for (uint i = 0u; i < D; i++) {
            sk += ks[i] * ks[i];
            sq += qs[i] * qs[i];
        }
        const float kn = 1.0 / sqrt(sk + pc.eps);
        const float qn = qscale / sqrt(sq + pc.eps);
        const float decay = exp(g[t * pc.hv + h]);
        float kv = 0.0;
        for (uint i = 0u; i < D; i++) {
            s[i] *= decay;
            kv += ks[i] * kn * s[i];
        }
        const float u = beta[t * pc.hv + h] * (v[(t * pc.hv + h) * D + j] - kv);
        float acc = 0.0;
        for (uint i = 0u; i < D; i++) {
            s[i] += ks[i] * kn * u;
            acc += qs[i] * qn * s[i];
        }
        o[(t * pc.hv + h) * D + j] = acc;
        barrier();  // every invocation has read ks / qs before the next row writes them
    }
    for (uint i = 0u; i < D; i++) {
        st[(h * D + i) * D + j] = s[i];
    }
}
