#version 450
// Scatter rows: dst[pos[r] * dst_stride + i] = src[r * src_stride + i] (writes K/V into the cache
// at positions read on the device, so a recorded decode step needs no new push constants).
// dst_rows > 0: row pos[r] % dst_rows (a sliding-window layer's ring).
#include "common.glsl"

layout(local_size_x_id = 0) in;

layout(binding = 0, std430) readonly buffer Src { float src[]; };
layout(binding = 1, std430) readonly buffer Pos { int pos[]; };
layout(binding = 2, std430) buffer Dst { float dst[]; };

layout(push_constant) uniform Push {
    uint n;            // floats per row
    uint src_stride;
    uint dst_stride;
    uint dst_rows;     // 0: no wrap
} pc;

void main() {
    const uint i = gl_GlobalInvocationID.x;
    const uint r = gl_WorkGroupID.y;
    if (i >= pc.n) {
        return;
    }
    const uint row = pc.dst_rows > 0u ? uint(pos[r]) % pc.dst_rows : uint(pos[r]);
    dst[row * pc.dst_stride + i] = src[r * pc.src_stride + i];
}
