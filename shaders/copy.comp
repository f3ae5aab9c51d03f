#version 450
// Copy n 16-byte words: the bandwidth yardstick for bench/bench_kernels.py.
#include "common.glsl"

layout(local_size_x_id = 0) in;

layout(binding = 0, std430) readonly buffer Src { uvec4 src[]; };
layout(binding = 1, std430) writeonly buffer Dst { uvec4 dst[]; };

layout(push_constant) uniform Push {
    uint n;
} pc;

void main() {
    const uint i = flat_group() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (i < pc.n) {
        dst[i] = src[i];
    }
}
