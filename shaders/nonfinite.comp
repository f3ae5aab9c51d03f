#version 450
// flag[0] |= 1 where any of x[0..n) is NaN or inf (the host zeroes it before the run): the
// forward's own check of its logits, so that the host reads one word instead of summing them.
// Each thread looks at PER values, a workgroup's threads at adjacent ones.
#include "common.glsl"

#define PER 16u

layout(local_size_x_id = 0) in;

layout(binding = 0, std430) readonly buffer X { uint x[]; };
layout(binding = 1, std430) buffer Flag { uint flag[]; };

layout(push_constant) uniform Push {
    uint n;
} pc;

void main() {
    const uint base = flat_group() * gl_WorkGroupSize.x * PER + gl_LocalInvocationID.x;
    bool bad = false;
    [[unroll]] for (uint j = 0u; j < PER; j++) {
        const uint i = base + j * gl_WorkGroupSize.x;
        // (an all-ones exponent is NaN or inf: a bit test no float optimisation can drop)
        bad = bad || (i < pc.n && (x[i] & 0x7F800000u) == 0x7F800000u);
    }
    if (bad) {
        atomicOr(flag[0], 1u);
    }
}
