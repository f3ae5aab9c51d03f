#version 450
// get_rows (embedding lookup): out[r, :] = dequantized W[ids[r], :], ids read on the device.
// The binding holds rows [row0, row0 + nrows); ids outside it are left to another dispatch.
#include "common.glsl"
// IQ weight types also read their codebook, bound after this kernel's own buffers.
#define GRID_BINDING 3
#include "types.glsl"
#include "dequant.glsl"

layout(local_size_x_id = 0) in;

layout(binding = 1, std430) readonly buffer Ids { int ids[]; };
layout(binding = 2, std430) writeonly buffer Out { vec4 out4[]; };
#ifdef KV_ROWS
// a KV cache of ggml blocks decoded for the attention: rows past the forward's last position
// (pos[last]) are not read by it, so not decoded (a ring that wrapped: every row is)
layout(binding = 3, std430) readonly buffer Pos { int pos[]; };
#endif

layout(push_constant) uniform Push {
    uint ncols;       // weights per row
    uint nrows;       // rows in this binding part
    uint row0;        // first row in this part
    uint out_stride;  // floats between output rows (multiple of 4)
#ifdef KV_ROWS
    uint last;        // the forward's last row
#endif
} pc;

void main() {
    const uint gi = gl_GlobalInvocationID.x;
    const uint r = gl_WorkGroupID.y;
    if (gi * 4u >= pc.ncols) {
        return;
    }
    const int id = ids[r] - int(pc.row0);
    if (id < 0 || id >= int(pc.nrows)) {
        return;
    }
#ifdef KV_ROWS
    if (ids[r] > pos[pc.last]) {
        return;
    }
#endif
    out4[(r * pc.out_stride) / 4u + gi] = dequant4_at(uint(id) * (pc.ncols / QK), gi * 4u);
}
