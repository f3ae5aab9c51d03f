#version 450
// The Gated DeltaNet's short causal conv, one invocation per channel c, over R rows after the
// history of the previous K-1 inputs (updated in place):
//   y[t, c] = silu(sum_j full[t + j, c] * w[c, j]),  full = history rows, then x rows
// and the history becomes the last K-1 rows of full.
#include "common.glsl"

layout(local_size_x_id = 0) in;

layout(binding = 0, std430) readonly buffer X { float x[]; };       // [R, C]
layout(binding = 1, std430) buffer Hist { float hist[]; };          // [K-1, C]
layout(binding = 2, std430) readonly buffer W { float w[]; };       // [C, K]
layout(binding = 3, std430) writeonly buffer Out { float o[]; };    // [R, C]

layout(push_constant) uniform Push {
    uint rows;
    uint c;   // channels
    uint k;   // taps
} pc;

float full(uint i, uint ch) {
    return i + 1u < pc.k ? hist[i * pc.c + ch] : x[(i + 1u - pc.k) * pc.c + ch];
}

void main() {
    const uint ch = flat_group() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (ch >= pc.c) {
        return;
    }
    for (uint t = 0u; t < pc.rows; t++) {
        float y = 0.0;
        for (uint j = 0u; j < pc.k; j++) {
            y += full(t + j, ch) * w[ch * pc.k + j];
        }
        o[t * pc.c + ch] = y / (1.0 + exp(-y));
    }
    // history[i] = full[R + i]: read index R + i > i, so ascending i reads before it overwrites
    for (uint i = 0u; i + 1u < pc.k; i++) {
        hist[i * pc.c + ch] = full(pc.rows + i, ch);
    }
}
