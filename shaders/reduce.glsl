// Workgroup-wide sum and max over one float per thread (WG a power of two), through shared
// memory. Every thread must call them (they contain barriers); every thread gets the result.
shared float red_f[gl_WorkGroupSize.x];

float wg_sum(float v) {
    const uint tid = gl_LocalInvocationID.x;
    barrier();
    red_f[tid] = v;
    barrier();
    for (uint s = gl_WorkGroupSize.x / 2u; s > 0u; s >>= 1) {
        if (tid < s) {
            red_f[tid] += red_f[tid + s];
        }
        barrier();
    }
    return red_f[0];
}

float wg_max(float v) {
    const uint tid = gl_LocalInvocationID.x;
    barrier();
    red_f[tid] = v;
    barrier();
    for (uint s = gl_WorkGroupSize.x / 2u; s > 0u; s >>= 1) {
        if (tid < s) {
            red_f[tid] = max(red_f[tid], red_f[tid + s]);
        }
        barrier();
    }
    return red_f[0];
}
