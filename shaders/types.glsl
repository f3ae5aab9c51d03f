// One block struct per GGML type, named like the classes in onebit/quants.py.
// Sizes must equal gguf's GGML_QUANT_SIZES (tests/test_vulkan_shaders.py checks the compiled
// array strides). Float types are "blocks" of one value.

struct F32   { float v; };
struct F16   { float16_t v; };
struct BF16  { uint16_t v; };
struct Q8_0  { float16_t d; int8_t qs[32]; };                                 // 34 bytes, 32 weights
struct Q4_0  { float16_t d; uint8_t qs[16]; };                                // 18 bytes, 32 weights
struct Q4_1  { f16vec2 dm; uint8_t qs[16]; };                                 // 20 bytes, 32 weights
struct Q5_0  { float16_t d; uint8_t qh[4]; uint8_t qs[16]; };                 // 22 bytes, 32 weights
struct Q5_1  { f16vec2 dm; uint8_t qh[4]; uint8_t qs[16]; };                  // 24 bytes, 32 weights
struct Q1_0  { float16_t d; uint8_t qs[16]; };                                // 18 bytes, 128 weights
struct MXFP4 { uint8_t e; uint8_t qs[16]; };                                  // 17 bytes, 32 weights
struct Q2_K  { uint8_t scales[16]; uint8_t qs[64]; f16vec2 dm; };             // 84 bytes, 256 weights
struct Q3_K  { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; float16_t d; };  // 110 bytes
struct Q4_K  { f16vec2 dm; uint8_t scales[12]; uint8_t qs[128]; };            // 144 bytes, 256 weights
struct Q5_K  { f16vec2 dm; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };  // 176 bytes
struct Q6_K  { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; float16_t d; };  // 210 bytes
struct TQ1_0 { uint8_t qs[48]; uint8_t qh[4]; float16_t d; };                 // 54 bytes, 256 weights
struct TQ2_0 { uint8_t qs[64]; float16_t d; };                                // 66 bytes, 256 weights
struct IQ1_S   { float16_t d; uint8_t qs[32]; uint16_t qh[8]; };              // 50 bytes, 256 weights
struct IQ1_M   { uint8_t qs[32]; uint8_t qh[16]; uint16_t scales[4]; };         // 56 bytes (d in the scales)
struct IQ2_XXS { float16_t d; uint16_t qs[32]; };                               // 66 bytes
struct IQ2_XS  { float16_t d; uint16_t qs[32]; uint8_t scales[8]; };            // 74 bytes
struct IQ2_S   { float16_t d; uint8_t qs[64]; uint8_t qh[8]; uint8_t scales[8]; };  // 82 bytes
struct IQ3_XXS { float16_t d; uint8_t qs[96]; };                                // 98 bytes
struct IQ3_S   { float16_t d; uint8_t qs[64]; uint8_t qh[8]; uint8_t signs[32]; uint8_t scales[4]; };  // 110
struct IQ4_NL  { float16_t d; uint8_t qs[16]; };                                // 18 bytes, 32 weights
struct IQ4_XS  { float16_t d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; };  // 136 bytes
