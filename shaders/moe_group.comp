#version 450
// The slots routed to each expert, in ascending order (the tiled expert mat-mat's input,
// shaders/mul_mm.comp MUL_ID). A workgroup per expert e:
//   counts[e] = #{i < n_slots : ids[i] == e}   (the host makes stride = n_slots: a streamed pass
//                                               may point many slots of a row at one pool slot)
//   lists[e * stride + r] = the r-th such i
// Each thread counts a contiguous run of the ids, an exclusive scan of the counts gives each
// run's first rank, and each thread writes its run's slots from there.
#include "common.glsl"

layout(local_size_x = 64) in;

layout(binding = 0, std430) readonly buffer Ids { int ids[]; };
layout(binding = 1, std430) writeonly buffer Counts { uint counts[]; };
layout(binding = 2, std430) writeonly buffer Lists { uint lists[]; };

layout(push_constant) uniform Push {
    uint n_slots;    // n_tokens * k
    uint stride;     // entries per expert in lists
    uint n_experts;  // workgroups with work (the grid may be folded past it)
} pc;

shared uint first[64];

void main() {
    const uint e = flat_group();
    if (e >= pc.n_experts) {
        return;  // (the whole workgroup)
    }
    const uint tid = gl_LocalInvocationID.x;
    const uint per = CEIL_DIV(pc.n_slots, 64u);
    const uint lo = min(tid * per, pc.n_slots), hi = min(lo + per, pc.n_slots);
    uint c = 0u;
    for (uint i = lo; i < hi; i++) {
        c += ids[i] == int(e) ? 1u : 0u;
    }
    first[tid] = c;
    barrier();
    if (tid == 0u) {
        uint s = 0u;
        for (uint j = 0u; j < 64u; j++) {
            const uint v = first[j];
            first[j] = s;
            s += v;
        }
        counts[e] = min(s, pc.stride);
    }
    barrier();
    uint r = first[tid];
    for (uint i = lo; i < hi; i++) {
        if (ids[i] == int(e)) {
            if (r < pc.stride) {
                lists[e * pc.stride + r] = i;
            }
            r++;
        }
    }
}
