#version 450
// gpt-oss's expert biases and clamped SwiGLU, around the expert mat-vecs (mul_mv_id), chosen
// with -D:
//   GLU_OAI:   h[i] = glu(g[i] + bg[e, f], u[i] + bu[e, f]) over n = R * k * F values, where
//              i = (r * k + s) * F + f and e = ids[r * k + s];
//              glu(a, b) = min(a, limit) * sigmoid(alpha * min(a, limit)) * (clamp(b, -limit, limit) + 1)
//   DOWN_BIAS: y[r, d] += sum_s wts[r * k + s] * bd[ids[r * k + s], d] over n = R * dim values
//              (the down part's bias, weighted as its product is; added after mul_mv_id "sum")
// ids are expert ids (not pool slots): the biases are resident.
#include "common.glsl"

layout(local_size_x_id = 0) in;

layout(push_constant) uniform Push {
    uint n;
    uint width;  // F (GLU_OAI) or dim (DOWN_BIAS)
    uint k;
    float alpha;
    float limit;
} pc;

#if defined(GLU_OAI)
layout(binding = 0, std430) readonly buffer G { float g[]; };
layout(binding = 1, std430) readonly buffer U { float u[]; };
layout(binding = 2, std430) readonly buffer Ids { int ids[]; };
layout(binding = 3, std430) readonly buffer BG { float bg[]; };
layout(binding = 4, std430) readonly buffer BU { float bu[]; };
layout(binding = 5, std430) writeonly buffer H { float h[]; };

void main() {
    const uint i = flat_group() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (i >= pc.n) {
        return;
    }
    const uint slot = i / pc.width;
    const uint b = uint(ids[slot]) * pc.width + (i - slot * pc.width);
    const float a = min(g[i] + bg[b], pc.limit);
    const float c = clamp(u[i] + bu[b], -pc.limit, pc.limit);
    h[i] = a / (1.0 + exp(-pc.alpha * a)) * (c + 1.0);
}
#elif defined(DOWN_BIAS)
layout(binding = 0, std430) buffer Y { float y[]; };
layout(binding = 1, std430) readonly buffer Ids { int ids[]; };
layout(binding = 2, std430) readonly buffer W { float wts[]; };
layout(binding = 3, std430) readonly buffer BD { float bd[]; };

void main() {
    const uint i = flat_group() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (i >= pc.n) {
        return;
    }
    const uint r = i / pc.width;
    const uint d = i - r * pc.width;
    float acc = 0.0;
    for (uint s = 0u; s < pc.k; s++) {
        acc += wts[r * pc.k + s] * bd[uint(ids[r * pc.k + s]) * pc.width + d];
    }
    y[i] += acc;
}
#else
#error "define GLU_OAI or DOWN_BIAS"
#endif
