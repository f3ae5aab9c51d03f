#version 450
#ifdef ROWS
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#endif
// Causal GQA attention over the KV cache, for decode (one row) and prefill (rows at pos[r]).
//   q: [R, H, D]   k: [S, Hkv, D]   v: [S, Hkv, Dv]   out: [R, H * Dv]
// Position p of k and v is row p % S (S > every position, or a sliding-window layer's ring).
//   sinks: [H] (with has_sinks, gpt-oss): a logit per head that joins the softmax's
//   denominator and weights no value.
// One workgroup per (head, row). Two ways to split it:
// - default (GPUs): keys in chunks of CH positions, scores in shared memory, an online softmax
//   across chunks; each thread owns output dims tid + WG * j.
// - REDUCE_NONE (CPU devices): each thread owns keys tid + WG * j with its own running max, sum
//   and output row (registers, no barriers in the loop); the threads' states merge at the end.
//   Best with one subgroup per workgroup: on lavapipe a lane is a SIMD slot, and per-lane state
//   beyond the vector registers spills on every key.
#include "common.glsl"

layout(local_size_x_id = 0) in;
#define CH 256u
#define MAX_D 256u
#define DV_PER_THREAD 4u

layout(binding = 0, std430) readonly buffer Q { float q[]; };
layout(binding = 1, std430) readonly buffer K { float kc[]; };
layout(binding = 2, std430) readonly buffer V { float vc[]; };
layout(binding = 1, std430) readonly buffer K4 { vec4 k4[]; };
layout(binding = 2, std430) readonly buffer V4 { vec4 v4[]; };
layout(binding = 3, std430) readonly buffer Pos { int pos[]; };
layout(binding = 4, std430) writeonly buffer Out { float o[]; };
layout(binding = 5, std430) readonly buffer Sinks { float sinks[]; };

layout(push_constant) uniform Push {
    uint n_heads;
    uint n_kv_heads;
    uint head_dim;     // D
    uint head_dim_v;   // Dv
    uint n_kv;         // S: rows of k and v (position p in row p % S)
    uint q_stride;     // floats between rows of q
    uint k_stride;     // floats between positions of k
    uint v_stride;     // floats between positions of v
    uint out_stride;   // floats between rows of out
    float scale;       // 1 / sqrt(D)
    uint window;       // > 0: a row at pos attends to positions pos - window + 1 .. pos only
    uint has_sinks;    // 1: sinks[h] joins the softmax's denominator
#ifdef ROWS
    uint rows;         // R
#endif
} pc;

// The first position row r attends to (sliding-window layers start later than 0).
uint first_key(uint p) {
    return (pc.window > 0u && p + 1u > pc.window) ? p + 1u - pc.window : 0u;
}

#include "reduce.glsl"

#ifdef ROWS
// Many rows (prefill, verify rows; CPU devices): a workgroup of one subgroup takes GH heads of
// one KV head and WG consecutive rows, lane i row r0 + i. The lanes walk the keys together, so
// each key's K and V rows are read once for all of them: lane l reads vec4s l, l + WG, ... and
// a subgroupShuffle hands each to every lane, used at once (on lavapipe a storage-buffer read
// is a loop over the lanes: the K and V reads were most of the one-row kernel's time; a
// subgroupShuffle from a constant lane measured 3-4x faster there than subgroupBroadcast, and
// keeping the row in an array rather than using each vec4 as it arrives, slower again). Lanes
// whose row does not take a key add 0 x its V (every key a row group walks was written:
// finite). Each row and head sums its keys in order with an online softmax: its result does
// not depend on the rows or heads it shares a workgroup with (but its sums run in another order
// than the one-row kernel's).
layout(constant_id = 1) const uint HD = 128u;   // head_dim
layout(constant_id = 2) const uint HDV = 128u;  // head_dim_v
layout(constant_id = 3) const uint GH = 1u;     // heads per workgroup (dividing n_heads / n_kv_heads)
// vec4s of a K (V) row each lane reads: n / 4 over the subgroup, rounded up
#define KV_READS(n) (((n) / 4u + gl_WorkGroupSize.x - 1u) / gl_WorkGroupSize.x)
void main() {
    const uint h0 = gl_WorkGroupID.x * GH;
    const uint WG = gl_WorkGroupSize.x;
    const uint tid = gl_LocalInvocationID.x;
    const uint r = min(gl_WorkGroupID.y * WG + tid, pc.rows - 1u);  // lanes past the last row redo it
    const uint kvh = h0 / (pc.n_heads / pc.n_kv_heads);
    const uint p_r = uint(pos[r]);
    const uint lo = first_key(p_r);
    const uint j0 = subgroupMin(lo), j1 = subgroupMax(p_r + 1u);
    vec4 qv[GH * (HD / 4u)];
    float m[GH];
    float l[GH];
    vec4 acc[GH * (HDV / 4u)];
    [[unroll]] for (uint g = 0u; g < GH; g++) {
        [[unroll]] for (uint d = 0u; d < HD / 4u; d++) {
            const uint qb = r * pc.q_stride + (h0 + g) * HD + 4u * d;
            qv[g * (HD / 4u) + d] = vec4(q[qb], q[qb + 1u], q[qb + 2u], q[qb + 3u]) * pc.scale;
        }
        m[g] = -1.0 / 0.0;
        l[g] = 0.0;
        [[unroll]] for (uint d = 0u; d < HDV / 4u; d++) {
            acc[g * (HDV / 4u) + d] = vec4(0.0);
        }
    }
    for (uint j = j0; j < j1; j++) {
        const bool live = j >= lo && j <= p_r;
        const uint kb = ((j % pc.n_kv) * pc.k_stride + kvh * HD) / 4u;
        float sc[GH];
        [[unroll]] for (uint g = 0u; g < GH; g++) {
            sc[g] = 0.0;
        }
        [[unroll]] for (uint t = 0u; t < KV_READS(HD); t++) {
            const vec4 mine = k4[kb + min(t * WG + tid, HD / 4u - 1u)];
            [[unroll]] for (uint c = 0u; c < gl_WorkGroupSize.x; c++) {
                const uint d = t * gl_WorkGroupSize.x + c;
                if (d < HD / 4u) {
                    const vec4 kv = subgroupShuffle(mine, c);
                    [[unroll]] for (uint g = 0u; g < GH; g++) {
                        sc[g] += dot(qv[g * (HD / 4u) + d], kv);
                    }
                }
            }
        }
        float p[GH];
        [[unroll]] for (uint g = 0u; g < GH; g++) {
            const float s = sc[g];
            if (live && s > m[g]) {  // a new running max: rescale what was summed so far
                const float c = exp(m[g] - s);
                l[g] *= c;
                [[unroll]] for (uint d = 0u; d < HDV / 4u; d++) {
                    acc[g * (HDV / 4u) + d] *= c;
                }
                m[g] = s;
            }
            p[g] = live ? exp(s - m[g]) : 0.0;
            l[g] += p[g];
        }
        const uint vb = ((j % pc.n_kv) * pc.v_stride + kvh * HDV) / 4u;
        [[unroll]] for (uint t = 0u; t < KV_READS(HDV); t++) {
            const vec4 mine = v4[vb + min(t * WG + tid, HDV / 4u - 1u)];
            [[unroll]] for (uint c = 0u; c < gl_WorkGroupSize.x; c++) {
                const uint d = t * gl_WorkGroupSize.x + c;
                if (d < HDV / 4u) {
                    const vec4 vv = subgroupShuffle(mine, c);
                    [[unroll]] for (uint g = 0u; g < GH; g++) {
                        acc[g * (HDV / 4u) + d] += p[g] * vv;
                    }
                }
            }
        }
    }
    if (gl_WorkGroupID.y * WG + tid < pc.rows) {
        [[unroll]] for (uint g = 0u; g < GH; g++) {
            const uint h = h0 + g;
            const float mx = pc.has_sinks != 0u ? max(m[g], sinks[h]) : m[g];
            const float f = exp(m[g] - mx);
            const float total = l[g] * f + (pc.has_sinks != 0u ? exp(sinks[h] - mx) : 0.0);
            [[unroll]] for (uint d = 0u; d < HDV / 4u; d++) {
                const vec4 a = acc[g * (HDV / 4u) + d] * f / total;
                const uint ob = r * pc.out_stride + h * HDV + 4u * d;
                o[ob] = a.x;
                o[ob + 1u] = a.y;
                o[ob + 2u] = a.z;
                o[ob + 3u] = a.w;
            }
        }
    }
}
#elif defined(REDUCE_NONE)
// Head dims are specialization constants here, so the per-dim loops unroll and q and the
// output row live in registers.
layout(constant_id = 1) const uint HD = 128u;   // head_dim
layout(constant_id = 2) const uint HDV = 128u;  // head_dim_v
#define DC 32u  // output dims merged per round
shared float merge[DC * gl_WorkGroupSize.x];

void main() {
    const uint h = gl_WorkGroupID.x;
    const uint r = gl_WorkGroupID.y;
    const uint tid = gl_LocalInvocationID.x;
    const uint WG = gl_WorkGroupSize.x;
    const uint kvh = h / (pc.n_heads / pc.n_kv_heads);
    const uint n_valid = uint(pos[r]) + 1u;
    const uint j0 = first_key(uint(pos[r]));
    vec4 qv[HD / 4u];
    [[unroll]] for (uint d = 0u; d < HD / 4u; d++) {
        const uint qb = r * pc.q_stride + h * HD + 4u * d;
        qv[d] = vec4(q[qb], q[qb + 1u], q[qb + 2u], q[qb + 3u]) * pc.scale;
    }
    float m = -1.0 / 0.0;
    float l = 0.0;
    vec4 acc[HDV / 4u];
    [[unroll]] for (uint d = 0u; d < HDV / 4u; d++) {
        acc[d] = vec4(0.0);
    }
    for (uint j = j0 + tid; j < n_valid; j += WG) {
        const uint kb = ((j % pc.n_kv) * pc.k_stride + kvh * HD) / 4u;
        float s = 0.0;
        [[unroll]] for (uint d = 0u; d < HD / 4u; d++) {
            s += dot(qv[d], k4[kb + d]);
        }
        if (s > m) {  // a new running max: rescale what was summed so far
            const float c = exp(m - s);
            l *= c;
            [[unroll]] for (uint d = 0u; d < HDV / 4u; d++) {
                acc[d] *= c;
            }
            m = s;
        }
        const float p = exp(s - m);
        l += p;
        const uint vb = ((j % pc.n_kv) * pc.v_stride + kvh * HDV) / 4u;
        [[unroll]] for (uint d = 0u; d < HDV / 4u; d++) {
            acc[d] += p * v4[vb + d];
        }
    }
    const float mk = wg_max(m);
    const float mx = pc.has_sinks != 0u ? max(mk, sinks[h]) : mk;
    const float f = m == -1.0 / 0.0 ? 0.0 : exp(m - mx);  // threads with no keys add nothing
    const float total = wg_sum(l * f) + (pc.has_sinks != 0u ? exp(sinks[h] - mx) : 0.0);
    [[unroll]] for (uint d0 = 0u; d0 < HDV; d0 += DC) {
        [[unroll]] for (uint c = 0u; c < DC; c += 4u) {
            const vec4 a = d0 + c < HDV ? acc[(d0 + c) / 4u] * f : vec4(0.0);
            merge[c * WG + tid] = a.x;
            merge[(c + 1u) * WG + tid] = a.y;
            merge[(c + 2u) * WG + tid] = a.z;
            merge[(c + 3u) * WG + tid] = a.w;
        }
        barrier();
        for (uint c = tid; c < DC && d0 + c < HDV; c += WG) {
            float v = 0.0;
            for (uint i = 0u; i < WG; i++) {
                v += merge[c * WG + i];
            }
            o[r * pc.out_stride + h * HDV + d0 + c] = v / total;
        }
        barrier();
    }
}

#else
shared float qs[MAX_D];
shared float sc[CH];

void main() {
    const uint h = gl_WorkGroupID.x;
    const uint r = gl_WorkGroupID.y;
    const uint tid = gl_LocalInvocationID.x;
    const uint WG = gl_WorkGroupSize.x;
    const uint kvh = h / (pc.n_heads / pc.n_kv_heads);
    const uint n_valid = uint(pos[r]) + 1u;
    const uint j0 = first_key(uint(pos[r]));
    const uint D = pc.head_dim;
    for (uint d = tid; d < D; d += WG) {
        qs[d] = q[r * pc.q_stride + h * D + d];
    }
    barrier();
    float m = -1.0 / 0.0;
    float l = 0.0;
    float acc[DV_PER_THREAD];
    [[unroll]] for (uint j = 0u; j < DV_PER_THREAD; j++) {
        acc[j] = 0.0;
    }
    for (uint c0 = j0; c0 < n_valid; c0 += CH) {
        const uint cn = min(CH, n_valid - c0);
        float cmax = -1.0 / 0.0;
        for (uint j = tid; j < cn; j += WG) {
            const uint kb = ((c0 + j) % pc.n_kv) * pc.k_stride + kvh * D;
            float dotv = 0.0;
            for (uint d = 0u; d < D; d++) {
                dotv += qs[d] * kc[kb + d];
            }
            dotv *= pc.scale;
            sc[j] = dotv;
            cmax = max(cmax, dotv);
        }
        cmax = wg_max(cmax);
        const float m_new = max(m, cmax);
        const float alpha = exp(m - m_new);  // 0 on the first chunk (m = -inf)
        float psum = 0.0;
        for (uint j = tid; j < cn; j += WG) {
            const float p = exp(sc[j] - m_new);
            sc[j] = p;
            psum += p;
        }
        psum = wg_sum(psum);  // its barriers also publish sc
        l = l * alpha + psum;
        [[unroll]] for (uint jd = 0u; jd < DV_PER_THREAD; jd++) {
            const uint d = tid + WG * jd;
            if (d < pc.head_dim_v) {
                float a = acc[jd] * alpha;
                const uint vb = kvh * pc.head_dim_v + d;
                for (uint j = 0u; j < cn; j++) {
                    a += sc[j] * vc[vb + ((c0 + j) % pc.n_kv) * pc.v_stride];
                }
                acc[jd] = a;
            }
        }
        m = m_new;
        barrier();
    }
    float c = 1.0;  // with a sink: acc / (l + exp(sink - m)), both rescaled to max(m, sink)
    if (pc.has_sinks != 0u) {
        const float ms = max(m, sinks[h]);
        c = exp(m - ms);
        l = l * c + exp(sinks[h] - ms);
    }
    [[unroll]] for (uint jd = 0u; jd < DV_PER_THREAD; jd++) {
        const uint d = tid + WG * jd;
        if (d < pc.head_dim_v) {
            o[r * pc.out_stride + h * pc.head_dim_v + d] = acc[jd] * c / l;
        }
    }
}
#endif
