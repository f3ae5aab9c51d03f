#version 450
// Elementwise ops over n floats, chosen with -DOP_<name>:
//   ADD: o = a + b    MUL: o = a * b    SILU: o = a / (1 + exp(-a))    SWIGLU: o = silu(a) * b
//   GEGLU: o = gelu(a) * b, gelu's tanh form written as a * sigmoid(2u) (no overflow)
//   SOFTCAP: o = b * tanh(a / b) (b: one value, nb = 1)    SIGMOID_MUL: o = a * sigmoid(b)
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
#elif defined(OP_GEGLU)
    const float u = 0.7978845608028654 * (av + 0.044715 * av * av * av);  // sqrt(2/pi) (a + 0.044715 a^3)
    o[i] = av / (1.0 + exp(-2.0 * u)) * b[i % pc.nb];
#elif defined(OP_SOFTCAP)
    const float cap = b[i % pc.nb];
    o[i] = cap * (1.0 - 2.0 / (exp(2.0 * av / cap) + 1.0));  // tanh, saturating cleanly at +-1
#elif defined(OP_SIGMOID_MUL)
    o[i] = av / (1.0 + exp(-b[i % pc.nb]));
#else
#error "define one OP_<name>"
#endif
}
