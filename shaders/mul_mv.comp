#version 450
#if defined(XROWS) && !defined(X_UNIFORM)
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#endif
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
// With -DXROWS (REDUCE_NONE) each thread also takes XR rows of x: every weight unit of its NR
// rows is decoded once and dotted with each of them (prefill and verify rows on a CPU device,
// where the decode, not the weight bytes, is the cost); with MUL_ID too, the slots grouped per
// expert (see that main). Each row's sums are the one-row kernel's, term for term. Dense: the
// dispatch covers x rows [0, pc.xrows) of its x binding, pc.zrows (<= XR) of them per
// workgroup layer z, and writes y rows pc.yrow0 + i; XR is a specialization constant (the host
// compiles a few widths), rows past a layer's last re-read it and are not written.
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
#ifdef XROWS
layout(constant_id = 2) const uint XR = 1u;  // rows of x per thread
#ifndef X_UNIFORM
// x from a storage buffer, the same address on every lane: lane i reads vec4 i of a unit and
// subgroupShuffle hands each to all (a workgroup of one subgroup of at least QU / 4 lanes; on
// lavapipe a storage read is a loop over the lanes: grouped experts 1.00-1.17x, and dense
// products beat x from a uniform buffer, 1.03-1.80x)
layout(constant_id = 4) const bool X_SHUFFLE = false;
#endif
#endif

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
#if defined(MUL_ID) && defined(XROWS)
// the routing ids as a uniform buffer (at most 4096: the host checks), so the scan and the
// slots it finds are uniform
layout(binding = 3, std140) uniform Ids { ivec4 ids4[1024]; };
layout(binding = 4, std430) readonly buffer Wts { float wts[]; };
#elif defined(MUL_ID)
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
#ifdef XROWS
    uint xrows;          // rows of x in this dispatch (dense; MUL_ID: tokens)
    uint yrow0;          // y row of x row 0
    uint zrows;          // dense: rows of x per workgroup layer z
#endif
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
        const float q = unit_qdot(b, ib, iu, xv, dm);  // ib: lane-uniform (W_ALIGNED)
#else
        const vec2 dm = get_dm(b, iu);
        float q = 0.0;
#ifdef HAS_UNIT_LOAD
        vec4 uq[QU / 4u];
        get_unit(b, iu, uq);
        [[unroll]] for (uint g = 0u; g < QU / 4u; g++) {
            q += dot(uq[g], xv[g]);
        }
#else  // (get_q4 inside the dots, as before: through get_unit these types' one-row decode measured
      // 1.03-1.05x slower in one A/B, about that A/B's noise; not taken)
        [[unroll]] for (uint g = 0u; g < QU / 4u; g++) {
            q += dot(get_q4(b, iu, g), xv[g]);
        }
#endif
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

#ifdef XROWS
// acc[n * XR + j] += W[rows first + n of the matrix at block ab] . x row j (at vec4 xo[j]).
// Every j < XR is computed: callers point the rows they do not need at a real one and drop
// them (a branch per row here measured 11 s of LLVM compile time on lavapipe against 3 s).
// (Invocation globals: glslang cannot pass arrays sized by specialization constants.)
float acc[NR * XR];
uint xo[XR];
float xsc[XR];  // per row of x: its scale (the routing weight, or 1)
void xr_dot(uint ab, uint first) {
    const uint row_blocks = pc.ncols / QK;
    const uint last = pc.nrows - 1u;
    // one loop over units (not unrolled per block as in the mat-vec: the body is already
    // NR x XR dots of a unit, and LLVM's compile time on lavapipe grows with its size)
    for (uint u = 0u; u < pc.ncols / QU; u++) {
        const uint ib = u / (QK / QU), iu = u % (QK / QU), u4 = u * (QU / 4u);
        // the unit of the NR rows decoded once, then each x vec4 read once for all of them.
        // The sums are the one-row mat-vec's (unit_dot), term for term, so a row's result has
        // the same bits whichever kernel and however many rows computed it (chunked prefill,
        // ring caches and streamed experts are compared bit for bit against unchunked runs).
        vec4 qv[NR * (QU / 4u)];
        vec2 dm[NR];
        [[unroll]] for (uint n = 0u; n < NR; n++) {
            const uint b = ab + min(first + n, last) * row_blocks + ib;
            dm[n] = get_dm(b, iu);
            vec4 uq[QU / 4u];
            get_unit(b, iu, uq);
            [[unroll]] for (uint g = 0u; g < QU / 4u; g++) {
                qv[n * (QU / 4u) + g] = uq[g];
            }
        }
        [[unroll]] for (uint j = 0u; j < XR; j++) {
            float q[NR];
            [[unroll]] for (uint n = 0u; n < NR; n++) {
                q[n] = 0.0;
            }
            float xs = 0.0;
#ifndef X_UNIFORM
            vec4 xm = vec4(0.0);
            if (X_SHUFFLE) {
                xm = x4[xo[j] + u4 + min(gl_SubgroupInvocationID, QU / 4u - 1u)];
            }
#endif
            [[unroll]] for (uint g = 0u; g < QU / 4u; g++) {
#ifdef X_UNIFORM
                const vec4 xv = x4[xo[j] + u4 + g];
#else
                const vec4 xv = X_SHUFFLE ? subgroupShuffle(xm, g) : x4[xo[j] + u4 + g];
#endif
#ifdef A_HAS_MIN
                xs += xv.x + xv.y + xv.z + xv.w;
#endif
                [[unroll]] for (uint n = 0u; n < NR; n++) {
                    q[n] += dot(qv[n * (QU / 4u) + g], xv);
                }
            }
            [[unroll]] for (uint n = 0u; n < NR; n++) {
#ifdef A_HAS_MIN
                acc[n * XR + j] += xsc[j] * (dm[n].x * q[n] + dm[n].y * xs);
#else
                acc[n * XR + j] += xsc[j] * (dm[n].x * q[n]);
#endif
            }
        }
    }
}

#ifdef MUL_ID
// Experts grouped: grid z = the part's experts; each workgroup scans the n_tokens * k routing
// ids for its expert and takes the slots that chose it XR at a time, so each unit of the
// expert's rows is decoded once for up to XR slots. Writes y[t*k + s, :] = (flags & 4 ?
// wts[t, s] : 1) * W[e] @ x[t, s] for every slot whose expert is in this part (the host adds
// the slots for "sum"). pc.xrows: n_tokens.
void main() {
    // (no early return for lanes past the last row: they decode the last row again and write
    // nothing, and the shuffles need every lane)
    const uint first = (flat_group() * WG + gl_LocalInvocationID.x) * NR;
    const int e = int(pc.e0 + gl_WorkGroupID.z);
    const uint n_slots = pc.xrows * pc.n_used;
    const uint ab = gl_WorkGroupID.z * pc.nrows * (pc.ncols / QK);
    uint i = 0u;
    for (;;) {
        uint slot[XR];
        uint cnt = 0u;
        for (; i < n_slots && cnt < XR; i++) {
            if (ids4[i / 4u][i % 4u] == e) {
                [[unroll]] for (uint j = 0u; j < XR; j++) {
                    if (j == cnt) {
                        slot[j] = i;
                    }
                }
                cnt++;
            }
        }
        if (cnt == 0u) {
            break;
        }
        [[unroll]] for (uint j = 0u; j < XR; j++) {
            const uint sl = slot[min(j, cnt - 1u)];
            xo[j] = ((sl / pc.n_used) * pc.x_stride + (sl % pc.n_used) * pc.x_slot_stride) / 4u;
            xsc[j] = (pc.flags & 4u) != 0u ? wts[sl] : 1.0;
            [[unroll]] for (uint n = 0u; n < NR; n++) {
                acc[n * XR + j] = 0.0;
            }
        }
        xr_dot(ab, first);
        [[unroll]] for (uint j = 0u; j < XR; j++) {
            if (j < cnt) {
                [[unroll]] for (uint n = 0u; n < NR; n++) {
                    if (first + n < pc.nrows) {
                        y[slot[j] * pc.y_stride + pc.row0 + first + n] = acc[n * XR + j];
                    }
                }
            }
        }
        if (cnt < XR) {
            break;
        }
    }
}
#else
void main() {
    const uint first = (flat_group() * WG + gl_LocalInvocationID.x) * NR;  // (no early return: as above)
    // grid z: pc.zrows (<= XR) rows of x each, from x row zr of the binding; xo: first vec4 of
    // each x row (rows past the layer's or the binding's last re-read the last one)
    const uint zr = gl_WorkGroupID.z * pc.zrows;
    const uint zn = min(pc.zrows, pc.xrows - zr);  // rows of this layer
    [[unroll]] for (uint j = 0u; j < XR; j++) {
        xo[j] = (zr + min(j, zn - 1u)) * (pc.x_stride / 4u);
        xsc[j] = 1.0;
        [[unroll]] for (uint n = 0u; n < NR; n++) {
            acc[n * XR + j] = 0.0;
        }
    }
    xr_dot(0u, first);
    [[unroll]] for (uint j = 0u; j < XR; j++) {
        if (j < zn) {
            [[unroll]] for (uint n = 0u; n < NR; n++) {
                if (first + n < pc.nrows) {
                    const uint i = (pc.yrow0 + zr + j) * pc.y_stride + pc.row0 + first + n;
                    y[i] = ((pc.flags & 1u) != 0u ? y[i] : 0.0) + acc[n * XR + j];
                }
            }
        }
    }
}
#endif  // MUL_ID
#else
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
#ifdef REDUCE_NONE
        // each slot summed on its own, then added: the grouped kernel's sums (XROWS + moe_sum)
        float ps[NR];
        [[unroll]] for (uint n = 0u; n < NR; n++) {
            ps[n] = 0.0;
        }
        accumulate(ab, xb, first, scale, ps);
        [[unroll]] for (uint n = 0u; n < NR; n++) {
            partial[n] += ps[n];
        }
#else
        accumulate(ab, xb, first, scale, partial);
#endif
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
#endif  // XROWS
