#version 450
// The routed experts' outputs summed per token, in slot order:
//   y[t, :] (+)= sum_{s < k} a[t * k + s, :]      (grid: columns / WG, tokens)
#include "common.glsl"

layout(local_size_x_id = 0) in;

layout(binding = 0, std430) readonly buffer A { float a[]; };
layout(binding = 1, std430) buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint n;         // columns
    uint k;         // slots per token
    uint y_stride;  // floats between rows of y
    uint acc;       // 1: add to y
} pc;

void main() {
    const uint col = gl_WorkGroupID.x * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    const uint t = gl_WorkGroupID.y;
    if (col >= pc.n) {
        return;
    }
    float sum = 0.0;
    for (uint s = 0u; s < pc.k; s++) {
        sum += a[(t * pc.k + s) * pc.n + col];
    }
    const uint i = t * pc.y_stride + col;
    y[i] = (pc.acc != 0u ? y[i] : 0.0) + sum;
}
