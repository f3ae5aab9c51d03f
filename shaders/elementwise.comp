#version 450
// Elementwise ops over n floats, chosen with -DOP_<name>:
//   ADD: o = a + b    MUL: o = a * b    SILU: o = a / (1 + exp(-a))    SWIGLU: o = silu(a) * b
// b is indexed modulo nb (nb = n: same shape; nb = row length: one row broadcast to all rows).
#include "common.glsl"

layout(local_size_x_id = 0) in;

layout(binding = 0, std430) readonly buffer A { float a[]; };
layout(binding = 1, std430) readonly buffer B { float b[]; };
layout(binding = 2, std430) buffer Out { float o[]; };

layout(push_constant) uniform Push {
    uint n;
    uint nb;
} pc;

void main() {
    const uint i = flat_group() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (i >= pc.n) {
        return;
    }
    const float av = a[i];
#if defined(OP_ADD)
    o[i] = av + b[i % pc.nb];
#elif defined(OP_MUL)
    o[i] = av * b[i % pc.nb];
#elif defined(OP_SILU)
    o[i] = av / (1.0 + exp(-av));
#elif defined(OP_SWIGLU)
    o[i] = av / (1.0 + exp(-av)) * b[i % pc.nb];
#else
#error "define one OP_<name>"
#endif
}
