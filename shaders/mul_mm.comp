#version 450
// Tiled mat-mat (prefill, several rows): y[r, row0 + i] (+)= sum_k W[i, k] * x[r, k].
// A workgroup of 64 threads computes a 32 (rows of W) x 32 (rows of x) tile; each 32-wide
// slice of k is dequantized into shared memory once and used by all 32 rows of x.
// With -DMUL_ID (routed experts, GPUs), W is [n_experts, nrows, ncols], grid z = the part's
// experts and grid y = tiles of the slots that chose each one, as moe_group.comp lists them
// (ascending slot order): y[s, row0 + i] = (flags & 4 ? wts[s] : 1) * W[e] @ x[s] for each slot
// s = t * n_used + j routed to expert e, x[s] at t * x_stride + j * x_slot_stride. Each weight
// tile is read once for up to 32 of the expert's slots (a per-slot mat-vec reads it per slot).
#include "common.glsl"
// IQ weight types also read their codebook, bound after this kernel's own buffers.
#ifdef MUL_ID
#define GRID_BINDING 6
#else
#define GRID_BINDING 3
#endif
#include "types.glsl"
#include "dequant.glsl"

layout(local_size_x = 64) in;
#define BM 32u
#define BN 32u
#define BK 32u
#define LD (BK + 1u)

layout(binding = 1, std430) readonly buffer X { vec4 x4[]; };
layout(binding = 2, std430) buffer Y { float y[]; };
#ifdef MUL_ID
layout(binding = 3, std430) readonly buffer Counts { uint counts[]; };  // per expert: slots routed to it
layout(binding = 4, std430) readonly buffer Lists { uint lists[]; };    // per expert: those slots, n_x apart
layout(binding = 5, std430) readonly buffer Wts { float wts[]; };
#endif

layout(push_constant) uniform Push {
    uint ncols;     // K: weights per row
    uint nrows;     // M: rows of W in this binding part (per expert with MUL_ID)
    uint row0;      // output column of the part's first row
    uint n_x;       // N: rows of x (MUL_ID: the lists' stride, n_tokens * k)
    uint x_stride;  // floats between rows of x (multiple of 4)
    uint y_stride;  // floats between rows of y
    uint flags;     // 1: add to y; 4 (MUL_ID): scale by the routing weight
#ifdef MUL_ID
    uint n_used;         // k, slots per token
    uint x_slot_stride;  // floats between slots of x (0: one x row for every slot)
    uint e0;             // first expert in this part
#endif
} pc;

shared float sa[BM * LD];
shared float sb[BN * LD];
#ifdef MUL_ID
shared uint sslot[BN];
#endif

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint m0 = gl_WorkGroupID.x * BM;
    const uint n0 = gl_WorkGroupID.y * BN;
    const uint tx = tid % 8u;
    const uint ty = tid / 8u;
    const uint row_blocks = pc.ncols / QK;
#ifdef MUL_ID
    const uint e = pc.e0 + gl_WorkGroupID.z;
    const uint n_x = counts[e];  // this expert's slots
    if (n0 >= n_x) {
        return;  // (the whole workgroup: before any barrier)
    }
    if (tid < BN) {
        sslot[tid] = lists[e * pc.n_x + min(n0 + tid, n_x - 1u)];
    }
    barrier();
    const uint wb = gl_WorkGroupID.z * pc.nrows * row_blocks;  // the expert's first block in this part
#else
    const uint n_x = pc.n_x;
    const uint wb = 0u;
#endif
    float acc[4][4];
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        [[unroll]] for (uint j = 0u; j < 4u; j++) {
            acc[i][j] = 0.0;
        }
    }
    for (uint k0 = 0u; k0 < pc.ncols; k0 += BK) {
        [[unroll]] for (uint i = 0u; i < 4u; i++) {
            const uint idx = tid + 64u * i;
            const uint r = idx / 8u;
            const uint c = (idx % 8u) * 4u;
            const uint k = k0 + c;
            vec4 w = vec4(0.0);
            if (m0 + r < pc.nrows && k < pc.ncols) {
                w = dequant4_at(wb + (m0 + r) * row_blocks, k);
            }
            vec4 xv = vec4(0.0);
            if (n0 + r < n_x && k < pc.ncols) {
#ifdef MUL_ID
                const uint sl = sslot[r];
                xv = x4[((sl / pc.n_used) * pc.x_stride + (sl % pc.n_used) * pc.x_slot_stride + k) / 4u];
#else
                xv = x4[((n0 + r) * pc.x_stride + k) / 4u];
#endif
            }
            sa[r * LD + c] = w.x; sa[r * LD + c + 1u] = w.y; sa[r * LD + c + 2u] = w.z; sa[r * LD + c + 3u] = w.w;
            sb[r * LD + c] = xv.x; sb[r * LD + c + 1u] = xv.y; sb[r * LD + c + 2u] = xv.z; sb[r * LD + c + 3u] = xv.w;
        }
        barrier();
        for (uint kk = 0u; kk < BK; kk++) {
            float a[4], b[4];
            [[unroll]] for (uint i = 0u; i < 4u; i++) {
                a[i] = sa[(tx + 8u * i) * LD + kk];
                b[i] = sb[(ty + 8u * i) * LD + kk];
            }
            [[unroll]] for (uint i = 0u; i < 4u; i++) {
                [[unroll]] for (uint j = 0u; j < 4u; j++) {
                    acc[i][j] += a[i] * b[j];
                }
            }
        }
        barrier();
    }
    [[unroll]] for (uint i = 0u; i < 4u; i++) {
        const uint m = m0 + tx + 8u * i;
        [[unroll]] for (uint j = 0u; j < 4u; j++) {
            const uint n = n0 + ty + 8u * j;
            if (m < pc.nrows && n < n_x) {
#ifdef MUL_ID
                const uint sl = sslot[ty + 8u * j];
                y[sl * pc.y_stride + pc.row0 + m] = ((pc.flags & 4u) != 0u ? wts[sl] : 1.0) * acc[i][j];
#else
                const uint o = n * pc.y_stride + pc.row0 + m;
                y[o] = ((pc.flags & 1u) != 0u ? y[o] : 0.0) + acc[i][j];
#endif
            }
        }
    }
}
