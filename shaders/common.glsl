// Shared by every kernel: storage extensions and small helpers.
// Weights are read through 8-/16-bit storage (block structs) and 16-/32-bit word views of
// the same binding; nothing here needs 8- or 16-bit arithmetic.
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_control_flow_attributes : enable
#ifdef REDUCE_SUBGROUP
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_KHR_shader_subgroup_basic : require
#endif

#define CEIL_DIV(a, b) (((a) + (b) - 1u) / (b))

// Workgroup index flattened over x and y, for grids wider than maxComputeWorkGroupCount[0].
uint flat_group() {
    return gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
}
