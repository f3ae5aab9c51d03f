#version 450
// out = x with every chunk of N floats times the N x N Walsh-Hadamard matrix (Sylvester's order)
// times `scale` (1 / sqrt(N)), by the fast transform (numpy twin: cache.hadamard): the rotation
// a quantized KV cache applies to each head before quantizing and after decoding (as llama.cpp
// does). One thread a chunk.
#include "common.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint N = 64;  // a power of two

layout(binding = 0, std430) readonly buffer X { float x[]; };
layout(binding = 1, std430) writeonly buffer Out { float o[]; };

layout(push_constant) uniform Push {
    uint chunks;
    float scale;
} pc;

void main() {
    const uint c = flat_group() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (c >= pc.chunks) {
        return;
    }
    float v[N];
    for (uint i = 0u; i < N; i++) {
        v[i] = x[c * N + i];
    }
    for (uint h = 1u; h < N; h *= 2u) {
        for (uint i = 0u; i < N; i += 2u * h) {
            for (uint j = i; j < i + h; j++) {
                const float a = v[j];
                const float b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
        }
    }
    for (uint i = 0u; i < N; i++) {
        o[c * N + i] = v[i] * pc.scale;
    }
}
