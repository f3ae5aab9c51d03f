#version 450
// The gated delta rule in its chunked (WY) form, for prompt chunks: one workgroup per value
// head h, one invocation per value column j (local size = the head width D), the head's state
// column S[:, j] in registers as in delta_rule.comp, but the rows taken in blocks of n <= pc.chunk:
// per block (G: the log decays summed within the block, s <= t, k and q l2-normalised, q also
// by 1/sqrt(D)), with the block's pair terms computed once, shared by the workgroup:
//   A_ts = beta_t exp(G_t - G_s) k_t.k_s (s < t),   P_ts = exp(G_t - G_s) q_t.k_s (s <= t)
//   u_t  = beta_t (v_t - exp(G_t) k_t.S0) - sum_{s<t} A_ts u_s          (forward substitution)
//   o_t  = exp(G_t) q_t.S0 + sum_{s<=t} P_ts u_s
//   S    = exp(G_n) S0 + sum_s exp(G_n - G_s) k_s u_s
// Two barriers per block instead of two per row. Value head h reads key head h % Hk (TILED)
// or h / (Hv / Hk). The state is updated in place. Numpy twin: reference.delta_chunk.
#include "common.glsl"

#define MAX_D 256
#define MAX_C 32
#define MAX_CD 4096  // rows per block x head width: the block's keys in shared memory

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
    uint chunk;  // rows per block, <= MAX_C and <= MAX_CD / D
    uint row0;   // rows [row0, row0 + rows) of the buffers (a long chunk is split over dispatches)
} pc;

shared float kb[MAX_CD];  // the block's keys, kb[t * D + i], l2-normalised

shared float kn[MAX_C];   // 1 / |k_t|
shared float qn[MAX_C];   // 1 / (sqrt(D) |q_t|)
shared float cg[MAX_C];   // G_t
shared float bt[MAX_C];   // beta_t
shared float A[MAX_C * MAX_C];
shared float P[MAX_C * MAX_C];

void main() {
    const uint h = gl_WorkGroupID.x;
    const uint j = gl_LocalInvocationID.x;
    const uint D = pc.d;
    const uint kh = pc.tiled != 0u ? h % pc.hk : h / (pc.hv / pc.hk);
    float s[MAX_D];
    float u[MAX_C];
    for (uint i = 0u; i < D; i++) {
        s[i] = st[(h * D + i) * D + j];
    }
    const float qscale = 1.0 / sqrt(float(D));
    for (uint t0 = pc.row0; t0 < pc.row0 + pc.rows; t0 += pc.chunk) {
        const uint n = min(pc.chunk, pc.row0 + pc.rows - t0);
        // the block's keys, norms, gates and running log decay
        for (uint t = 0u; t < n; t++) {
            kb[t * D + j] = k[((t0 + t) * pc.hk + kh) * D + j];
        }
        barrier();
        for (uint t = j; t < n; t += D) {
            const uint base = ((t0 + t) * pc.hk + kh) * D;
            float sk = 0.0, sq = 0.0;
            for (uint i = 0u; i < D; i++) {
                sk += kb[t * D + i] * kb[t * D + i];
                sq += q[base + i] * q[base + i];
            }
            kn[t] = 1.0 / sqrt(sk + pc.eps);
            qn[t] = qscale / sqrt(sq + pc.eps);
            bt[t] = beta[(t0 + t) * pc.hv + h];
        }
        if (j == 0u) {
            float acc = 0.0;
            for (uint t = 0u; t < n; t++) {
                acc += g[(t0 + t) * pc.hv + h];
                cg[t] = acc;
            }
        }
        barrier();
        for (uint t = 0u; t < n; t++) {
            kb[t * D + j] *= kn[t];
        }
        barrier();
        // the pair terms A and P, spread over the workgroup
        for (uint idx = j; idx < n * n; idx += D) {
            const uint t = idx / n, r = idx % n;
            float a = 0.0, p = 0.0;
            if (r <= t) {
                const uint bq = ((t0 + t) * pc.hk + kh) * D;
                float kk = 0.0, qk = 0.0;
                for (uint i = 0u; i < D; i++) {
                    kk += kb[t * D + i] * kb[r * D + i];
                    qk += q[bq + i] * kb[r * D + i];
                }
                const float dec = exp(min(cg[t] - cg[r], 0.0));
                a = r < t ? bt[t] * dec * kk : 0.0;
                p = dec * qk * qn[t];
            }
            A[t * MAX_C + r] = a;
            P[t * MAX_C + r] = p;
        }
        barrier();
        // this column: u by forward substitution, then o, then the state
        for (uint t = 0u; t < n; t++) {
            float kv = 0.0;
            for (uint i = 0u; i < D; i++) {
                kv += kb[t * D + i] * s[i];
            }
            float ut = bt[t] * (v[((t0 + t) * pc.hv + h) * D + j] - exp(cg[t]) * kv);
            for (uint r = 0u; r < t; r++) {
                ut -= A[t * MAX_C + r] * u[r];
            }
            u[t] = ut;
        }
        for (uint t = 0u; t < n; t++) {
            const uint base = ((t0 + t) * pc.hk + kh) * D;
            float qv = 0.0;
            for (uint i = 0u; i < D; i++) {
                qv += q[base + i] * s[i];
            }
            float acc = exp(cg[t]) * qn[t] * qv;
            for (uint r = 0u; r <= t; r++) {
                acc += P[t * MAX_C + r] * u[r];
            }
            o[((t0 + t) * pc.hv + h) * D + j] = acc;
        }
        const float last = cg[n - 1u];
        const float tot = exp(last);
        for (uint i = 0u; i < D; i++) {
            s[i] *= tot;
        }
        for (uint t = 0u; t < n; t++) {
            const float w = exp(last - cg[t]) * u[t];
            for (uint i = 0u; i < D; i++) {
                s[i] += w * kb[t * D + i];
            }
        }
        barrier();  // every invocation has read this block's shared terms before the next writes them
    }
    for (uint i = 0u; i < D; i++) {
        st[(h * D + i) * D + j] = s[i];
    }
}
