#version 450
// Tiled mat-mat (prefill, several rows): y[r, row0 + i] (+)= sum_k W[i, k] * x[r, k].
// A workgroup of 64 threads computes a 32 (rows of W) x 32 (rows of x) tile; each 32-wide
// slice of k is dequantized into shared memory once and used by all 32 rows of x.
#include "common.glsl"
// IQ weight types also read their codebook, bound after this kernel's own buffers.
#define GRID_BINDING 3
#include "types.glsl"
#include "dequant.glsl"

layout(local_size_x = 64) in;
#define BM 32u
#define BN 32u
#define BK 32u
#define LD (BK + 1u)

layout(binding = 1, std430) readonly buffer X { vec4 x4[]; };
layout(binding = 2, std430) buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint ncols;     // K: weights per row
    uint nrows;     // M: rows of W in this binding part
    uint row0;      // output column of the part's first row
    uint n_x;       // N: rows of x
    uint x_stride;  // floats between rows of x (multiple of 4)
    uint y_stride;  // floats between rows of y
    uint flags;     // 1: add to y
} pc;

shared float sa[BM * LD];
shared float sb[BN * LD];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint m0 = gl_WorkGroupID.x * BM;
    const uint n0 = gl_WorkGroupID.y * BN;
    const uint tx = tid % 8u;
    const uint ty = tid / 8u;
    const uint row_blocks = pc.ncols / QK;
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
                w = dequant4_at((m0 + r) * row_blocks, k);
            }
            vec4 xv = vec4(0.0);
            if (n0 + r < pc.n_x && k < pc.ncols) {
                xv = x4[((n0 + r) * pc.x_stride + k) / 4u];
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
            if (m < pc.nrows && n < pc.n_x) {
                const uint o = n * pc.y_stride + pc.row0 + m;
                y[o] = ((pc.flags & 1u) != 0u ? y[o] : 0.0) + acc[i][j];
            }
        }
    }
}
