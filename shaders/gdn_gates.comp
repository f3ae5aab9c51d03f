#version 450
// Gated DeltaNet gates over rows of Hv value heads:
//   beta = sigmoid(b),  g = softplus(a + dt[h]) * A[h]  (A = -exp(A_log): g is the log decay)
// softplus(z) = max(z, 0) + log(1 + exp(-|z|)), which never overflows.
#include "common.glsl"

layout(local_size_x_id = 0) in;

layout(binding = 0, std430) readonly buffer B { float b[]; };
layout(binding = 1, std430) readonly buffer Al { float a[]; };
layout(binding = 2, std430) readonly buffer Dt { float dt[]; };
layout(binding = 3, std430) readonly buffer Ac { float A[]; };
layout(binding = 4, std430) writeonly buffer Beta { float beta[]; };
layout(binding = 5, std430) writeonly buffer G { float g[]; };

layout(push_constant) uniform Push {
    uint n;   // rows x heads
    uint hv;  // heads
} pc;

void main() {
    const uint i = flat_group() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (i >= pc.n) {
        return;
    }
    const uint h = i % pc.hv;
    beta[i] = 1.0 / (1.0 + exp(-b[i]));
    const float z = a[i] + dt[h];
    g[i] = (max(z, 0.0) + log(1.0 + exp(-abs(z)))) * A[h];
}
