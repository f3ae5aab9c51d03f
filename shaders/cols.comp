#version 450
// Columns c0..c0+w-1 of every row: o[r, i] = a[r, c0 + i] over rows of length n (a split
// along the last axis: a query and its gate, q / k / v of a DeltaNet projection).
#include "common.glsl"

layout(local_size_x_id = 0) in;

layout(binding = 0, std430) readonly buffer A { float a[]; };
layout(binding = 1, std430) writeonly buffer Out { float o[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint n;   // row length of a
    uint c0;  // first column taken
    uint w;   // columns taken (row length of o)
} pc;

void main() {
    const uint i = flat_group() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (i >= pc.rows * pc.w) {
        return;
    }
    const uint r = i / pc.w;
    o[i] = a[r * pc.n + pc.c0 + (i - r * pc.w)];
}
