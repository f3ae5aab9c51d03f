#version 450
// Mat-vec (decode): y[r, row0 + i] (+)= sum_k W[i, k] * x[r, k], read straight from W's blocks.
// With -DMUL_ID, W is [n_experts, nrows, ncols] and each token row r reads the experts the
// router chose from the ids buffer on the device:
//   flags & 2 (sum):  y[t, :] (+)= sum_s wts[t, s] * W[ids[t, s]] @ x[t, s]   (grid z = tokens)
//   otherwise:        y[t*k + s, :] = (flags & 4 ? wts[t, s] : 1) * W[ids[t, s]] @ x[t, s]  (z = t*k + s)
// A binding holds experts [e0, e0 + n_experts_part) (tensors larger than maxStorageBufferRange
// are bound in parts); other experts are skipped by this dispatch.
// Each workgroup computes NR rows; its WG threads split the row's units and reduce at the end
// (subgroupAdd or a shared-memory tree). With -DREDUCE_NONE each thread owns NR rows instead
// and walks all of k, so each x load serves NR rows and nothing is reduced: what a CPU device
// wants (lavapipe: lanes are SIMD slots and every lane's load costs the same, uniform or not).
// A workgroup then covers WG * NR rows.
#include "common.glsl"
// IQ weight types also read their codebook, bound after this kernel's own buffers.
#ifdef MUL_ID
#define GRID_BINDING 5
#else
#define GRID_BINDING 3
#endif
#include "types.glsl"
#include "dequant.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint NR = 2u;

#ifdef X_UNIFORM
// x as a uniform buffer (at most 64 KiB: the host picks this variant only when x fits the
// device's maxUniformBufferRange). On lavapipe a storage-buffer read inside a loop is a
// bounds-checked branch per lane even when every lane reads the same address; a uniform
// buffer read at a uniform address is one load. The IQ1/2/3 decoders' x reads were the
// larger part of their time.
layout(binding = 1, std140) uniform X { vec4 x4[4096]; };
#else
layout(binding = 1, std430) readonly buffer X { vec4 x4[]; };
#endif
layout(binding = 2, std430) buffer Y { float y[]; };
#ifdef MUL_ID
layout(binding = 3, std430) readonly buffer Ids { int ids[]; };
layout(binding = 4, std430) readonly buffer Wts { float wts[]; };
#endif

layout(push_constant) uniform Push {
    uint ncols;          // weights per row
    uint nrows;          // rows in this binding part (per expert with MUL_ID)
    uint row0;           // output column of the part's first row
    uint x_stride;       // floats between token rows of x (multiple of 4)
    uint y_stride;       // floats between rows of y
    uint flags;          // 1: add to y; 2: weighted sum over slots; 4: scale by routing weight
    uint n_used;         // MUL_ID: k, slots per token
    uint x_slot_stride;  // MUL_ID: floats between slots of x (0: one x row for every slot)
    uint e0;             // MUL_ID: first expert in this part
    uint n_experts_part; // MUL_ID: experts in this part
} pc;

const uint WG = gl_WorkGroupSize.x;
#ifndef REDUCE_NONE
shared float red[NR * WG];
#endif

// Adds scale * (unit u = (ib, iu) of rows first.. of W) . x to partial[], for the rows starting
// at block ab and x starting at vec4 xb.
void unit_dot(uint ab, uint xb, uint first, float scale, uint ib, uint iu, uint u, inout float partial[NR]) {
    const uint row_blocks = pc.ncols / QK;
    const uint last = pc.nrows - 1u;
    vec4 xv[QU / 4u];
    float xs = 0.0;
    [[unroll]] for (uint g = 0u; g < QU / 4u; g++) {
        xv[g] = x4[xb + u * (QU / 4u) + g];
#ifdef A_HAS_MIN
        xs += xv[g].x + xv[g].y + xv[g].z + xv[g].w;
#endif
    }
    [[unroll]] for (uint n = 0u; n < NR; n++) {
        const uint b = ab + min(first + n, last) * row_blocks + ib;
#ifdef UNIT_QDOT
        vec2 dm;
        const float q = unit_qdot(b, iu, xv, dm);
#else
        const vec2 dm = get_dm(b, iu);
        float q = 0.0;
        [[unroll]] for (uint g = 0u; g < QU / 4u; g++) {
            q += dot(get_q4(b, iu, g), xv[g]);
        }
#endif
#ifdef A_HAS_MIN
        partial[n] += scale * (dm.x * q + dm.y * xs);
#else
        partial[n] += scale * (dm.x * q);
#endif
    }
}

// Adds this thread's share of scale * W[rows first..] @ x to partial[].
void accumulate(uint ab, uint xb, uint first, float scale, inout float partial[NR]) {
#ifdef REDUCE_NONE
    // Whole blocks, units unrolled: loads shared by a block's units (Q4_K's words hold two
    // units' nibbles, the packed scales serve all eight) are read once. The unrolled body is
    // NR x units per block copies of the dequantizer, so the host keeps NR small for types
    // with many units per block (LLVM's compile time on lavapipe grows with it).
    for (uint ib = 0u; ib < pc.ncols / QK; ib++) {
        [[unroll]] for (uint iu = 0u; iu < QK / QU; iu++) {
            unit_dot(ab, xb, first, scale, ib, iu, ib * (QK / QU) + iu, partial);
        }
    }
#else
    for (uint u = gl_LocalInvocationID.x; u < pc.ncols / QU; u += WG) {
        unit_dot(ab, xb, first, scale, u / (QK / QU), u % (QK / QU), u, partial);
    }
#endif
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
#ifdef REDUCE_NONE
    const uint first = (flat_group() * WG + tid) * NR;
#else
    const uint first = flat_group() * NR;
#endif
    if (first >= pc.nrows) {
        return;
    }
    float partial[NR];
    [[unroll]] for (uint n = 0u; n < NR; n++) {
        partial[n] = 0.0;
    }
    uint yrow = gl_WorkGroupID.z;
#ifdef MUL_ID
    const bool sum = (pc.flags & 2u) != 0u;
    const uint token = sum ? gl_WorkGroupID.z : gl_WorkGroupID.z / pc.n_used;
    const uint s0 = sum ? 0u : gl_WorkGroupID.z % pc.n_used;
    const uint s1 = sum ? pc.n_used : s0 + 1u;
    bool any = false;
    for (uint s = s0; s < s1; s++) {
        const int e = ids[token * pc.n_used + s] - int(pc.e0);
        if (e < 0 || e >= int(pc.n_experts_part)) {
            continue;
        }
        any = true;
        const float scale = (pc.flags & 6u) != 0u ? wts[token * pc.n_used + s] : 1.0;
        const uint ab = uint(e) * pc.nrows * (pc.ncols / QK);
        const uint xb = (token * pc.x_stride + s * pc.x_slot_stride) / 4u;
        accumulate(ab, xb, first, scale, partial);
    }
    if (!any && !sum) {
        return;  // this slot's expert lives in another part
    }
#else
    accumulate(0u, gl_WorkGroupID.z * pc.x_stride / 4u, first, 1.0, partial);
#endif

#if defined(REDUCE_NONE)
    // nothing to combine: partial[] is this thread's rows
#elif defined(REDUCE_SUBGROUP)
    [[unroll]] for (uint n = 0u; n < NR; n++) {
        const float v = subgroupAdd(partial[n]);
        if (subgroupElect()) {
            red[n * WG + gl_SubgroupID] = v;
        }
    }
    barrier();
    if (tid == 0u) {
        [[unroll]] for (uint n = 0u; n < NR; n++) {
            float v = 0.0;
            for (uint i = 0u; i < gl_NumSubgroups; i++) {
                v += red[n * WG + i];
            }
            partial[n] = v;
        }
    }
#else
    [[unroll]] for (uint n = 0u; n < NR; n++) {
        red[n * WG + tid] = partial[n];
    }
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (tid < s) {
            [[unroll]] for (uint n = 0u; n < NR; n++) {
                red[n * WG + tid] += red[n * WG + tid + s];
            }
        }
        barrier();
    }
    if (tid == 0u) {
        [[unroll]] for (uint n = 0u; n < NR; n++) {
            partial[n] = red[n * WG];
        }
    }
#endif
#ifndef REDUCE_NONE
    if (tid != 0u) {
        return;
    }
#endif
    {
        [[unroll]] for (uint n = 0u; n < NR; n++) {
            if (first + n < pc.nrows) {
                const uint i = yrow * pc.y_stride + pc.row0 + first + n;
                y[i] = ((pc.flags & 1u) != 0u ? y[i] : 0.0) + partial[n];
            }
        }
    }
}
