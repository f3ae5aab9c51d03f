// The routers' SLOT_LUT bindings, from LUT_BINDING on (softmax_topk.comp, sigmoid_topk.comp).
// Streamed experts run with no pause: the host keeps lut[layer * n_experts + e] = the expert
// pool's slot holding expert e complete, or -1 (memory/pool.py ExpertPool.track). The router
// writes each chosen expert's slot into table, which the expert kernels index; a chosen expert
// with no slot reads slot 0 (in bounds, a wrong result) and sets miss[0], and the host runs the
// step again with pauses (graph.py).
#ifdef SLOT_LUT
layout(binding = LUT_BINDING, std430) readonly buffer Lut { int lut[]; };
layout(binding = LUT_BINDING + 1, std430) writeonly buffer Table { int table[]; };
layout(binding = LUT_BINDING + 2, std430) buffer Miss { int miss[]; };
#define SLOT_OF(i, e) { const int s_ = lut[pc.lut_base + (e)]; table[i] = max(s_, 0); if (s_ < 0) { miss[0] = 1; } }
#else
#define SLOT_OF(i, e)
#endif
