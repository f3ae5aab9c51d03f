#version 450
// Routed experts' rows of x gathered per expert, in chunks of XR rows (the sorted expert
// product, shaders/mul_mv.comp SORTED, takes one chunk per dispatch with x from a uniform
// buffer). From moe_group's per-expert slot lists:
//
// -DPLAN (one workgroup): chunk c = (expert, rows) at plan[2c], plan[2c + 1], the experts in
// order, each expert's slots in ascending order, XR to a chunk (its last chunk may hold fewer);
// chunks past the last used one are (-1, 0). Then plan[2C + c * XR + j] = chunk c's j-th slot (for
// j past its rows: its last slot), and pos[slot] = c * XR + j, the slot's row in the gathered
// order (~0 for a slot whose id names no expert of the tensor).
//
// -DGATHER: xs[c * XR + j, :] = x[t, s, :] for chunk c's j-th slot t * k + s (rows past a chunk's
// count are not written; the product never reads them). -DUNSORT: the product's rows back in slot
// order.
#include "common.glsl"

#ifdef PLAN
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint XR = 16u;
layout(binding = 0, std430) readonly buffer Counts { uint counts[]; };
layout(binding = 1, std430) readonly buffer Lists { uint lists[]; };
layout(binding = 2, std430) writeonly buffer Plan { int plan[]; };
layout(binding = 3, std430) writeonly buffer Pos { uint pos[]; };

layout(push_constant) uniform Push {
    uint n_experts;  // <= MAX_EXPERTS (the host checks)
    uint stride;     // entries per expert in lists
    uint n_chunks;   // C: the plan's chunks (the host's bound on what the experts can need)
    uint n_slots;
} pc;

#define MAX_EXPERTS 1024u
shared uint start[MAX_EXPERTS];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    for (uint i = tid; i < pc.n_slots; i += 64u) {
        pos[i] = 0xffffffffu;
    }
    if (tid == 0u) {
        uint s = 0u;
        for (uint e = 0u; e < pc.n_experts; e++) {
            start[e] = s;
            s += CEIL_DIV(counts[e], XR);
        }
        start[MAX_EXPERTS - 1u] = s;  // (n_experts < MAX_EXPERTS: the host checks)
    }
    barrier();
    for (uint e = tid; e < pc.n_experts; e += 64u) {
        const uint cnt = counts[e];
        for (uint r0 = 0u; r0 < cnt; r0 += XR) {
            const uint c = start[e] + r0 / XR, n = min(XR, cnt - r0);
            plan[2u * c] = int(e);
            plan[2u * c + 1u] = int(n);
            for (uint j = 0u; j < XR; j++) {
                const uint slot = lists[e * pc.stride + r0 + min(j, n - 1u)];
                plan[2u * pc.n_chunks + c * XR + j] = int(slot);
                if (j < n) {
                    pos[slot] = c * XR + j;
                }
            }
        }
    }
    for (uint c = start[MAX_EXPERTS - 1u] + tid; c < pc.n_chunks; c += 64u) {
        plan[2u * c] = -1;
        plan[2u * c + 1u] = 0;
    }
}
#endif

#ifdef GATHER
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint XR = 16u;
layout(binding = 0, std430) readonly buffer Plan { int plan[]; };
layout(binding = 1, std430) readonly buffer X { vec4 x4[]; };
layout(binding = 2, std430) writeonly buffer Xs { vec4 xs4[]; };

layout(push_constant) uniform Push {
    uint n_chunks;
    uint k;              // slots per token
    uint x_stride;       // floats between token rows of x (multiple of 4)
    uint x_slot_stride;  // floats between slots of x (0: one row for every slot)
    uint ncols;          // floats per row (multiple of 4)
    uint xs_stride;      // floats between gathered rows (multiple of 4)
} pc;

void main() {
    const uint p = gl_WorkGroupID.y, c = p / XR, j = p % XR;
    const uint i = gl_WorkGroupID.x * 64u + gl_LocalInvocationID.x;
    if (j >= uint(plan[2u * c + 1u]) || i >= pc.ncols / 4u) {
        return;
    }
    const uint slot = uint(plan[2u * pc.n_chunks + p]);
    const uint t = slot / pc.k, s = slot % pc.k;
    xs4[p * (pc.xs_stride / 4u) + i] = x4[(t * pc.x_stride + s * pc.x_slot_stride) / 4u + i];
}
#endif

#ifdef UNSORT
// y[i, :] = ys[pos[i], :] for every slot i the plan placed (the others are not written).
layout(local_size_x = 64) in;
layout(binding = 0, std430) readonly buffer Pos { uint pos[]; };
layout(binding = 1, std430) readonly buffer Ys { float ys[]; };
layout(binding = 2, std430) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint n;         // floats per row
    uint y_stride;  // floats between rows of y
} pc;

void main() {
    const uint i = gl_WorkGroupID.y, col = gl_WorkGroupID.x * 64u + gl_LocalInvocationID.x;
    const uint r = pos[i];
    if (col >= pc.n || r == 0xffffffffu) {
        return;
    }
    y[i * pc.y_stride + col] = ys[r * pc.n + col];
}
#endif
