#version 450
// RoPE: rotate the first n_rot dims of every head of row r by angle pos[r] * scale * theta^(-2i/n_rot)
// (divided by factors[i] when given: Llama 3's per-frequency rope_freqs).
// Normal mode pairs dims (2i, 2i + 1); NeoX mode pairs (i, i + n_rot/2). Dims past n_rot are copied.
// In place is fine: each thread reads and writes only its own pair.
#include "common.glsl"

layout(local_size_x_id = 0) in;

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) readonly buffer Pos { int pos[]; };
layout(binding = 2, std430) buffer Out { float o[]; };
layout(binding = 3, std430) readonly buffer Factors { float factors[]; };

layout(push_constant) uniform Push {
    uint n_heads;
    uint head_dim;
    uint n_rot;
    uint x_stride;     // floats between rows of x
    uint out_stride;   // floats between rows of out
    float log2_theta;
    float scale;       // linear position scaling
    uint neox;
    uint has_factors;  // 1: divide frequency i by factors[i]
} pc;

void main() {
    const uint half_d = pc.head_dim / 2u;
    const uint t = gl_GlobalInvocationID.x;
    const uint r = gl_WorkGroupID.y;
    if (t >= pc.n_heads * half_d) {
        return;
    }
    const uint h = t / half_d;
    const uint i = t % half_d;
    const uint xb = r * pc.x_stride + h * pc.head_dim;
    const uint ob = r * pc.out_stride + h * pc.head_dim;
    if (2u * i < pc.n_rot) {
        float inv_freq = exp2(-float(2u * i) / float(pc.n_rot) * pc.log2_theta);
        if (pc.has_factors != 0u) {
            inv_freq /= factors[i];
        }
        const float ang = float(pos[r]) * pc.scale * inv_freq;
        const float c = cos(ang);
        const float s = sin(ang);
        const uint i0 = pc.neox != 0u ? i : 2u * i;
        const uint i1 = pc.neox != 0u ? i + pc.n_rot / 2u : 2u * i + 1u;
        const float a = x[xb + i0];
        const float b = x[xb + i1];
        o[ob + i0] = a * c - b * s;
        o[ob + i1] = a * s + b * c;
    } else {
        const float a = x[xb + 2u * i];
        const float b = x[xb + 2u * i + 1u];
        o[ob + 2u * i] = a;
        o[ob + 2u * i + 1u] = b;
    }
}
