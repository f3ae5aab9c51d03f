"""The one table of shader variants: every .spv the package ships is a row here.

A variant is a .comp source compiled with some -D defines. Names follow llama.cpp's habit,
`<op>[_id]_<TYPE>[_<reduce>]`, e.g. `mul_mv_id_Q4_K_subgroup`. `shaders/build.py` compiles
them; `onebit/backends/vulkan/kernels.py` looks them up by the same names.

This file is also imported by tests/test_vulkan_shaders.py (to check the shipped SPIR-V is
not stale), so it uses only the standard library.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

SHADER_DIR = Path(__file__).resolve().parent
SPV_DIR = SHADER_DIR.parent / "onebit" / "backends" / "vulkan" / "spv"

# Flags every variant is compiled with; part of each variant's hash.
GLSLC_FLAGS = ("--target-env=vulkan1.2", "-O")

# Weight types: one block struct each in types.glsl (GGML names, as in onebit/quants.py), each
# with a dequantizer in dequant.glsl. Adding a struct there adds the type's variants here.
WEIGHT_TYPES = tuple(re.findall(r"^struct (\w+)", (SHADER_DIR / "types.glsl").read_text(), re.MULTILINE))
# How mat-vec splits a row: threads share a row and sum their partial dots with subgroupAdd
# ("subgroup") or a tree in shared memory ("shmem", for devices without subgroup arithmetic);
# or each thread owns whole rows ("none": CPU devices, where lanes are SIMD slots).
REDUCE_MODES = ("subgroup", "shmem", "none")
# Every thread-per-row mat-vec also has an `_ux` variant, x read from a uniform buffer
# (shaders/mul_mv.comp X_UNIFORM): on lavapipe it measured 1.3-1.6x on Q2_K / Q3_K / Q4_K and
# 1.7-2.6x on the IQ1/2/3 codebook types (bench/results/vulkan-kernels-by-type-2026-12-02.md).
X_UNIFORM_TYPES = WEIGHT_TYPES
ELEMENTWISE_OPS = ("add", "mul", "silu", "swiglu", "geglu", "softcap", "sigmoid_mul")


@dataclass(frozen=True)
class Variant:
    name: str
    source: str  # a .comp file in shaders/
    defines: tuple[tuple[str, str], ...] = ()

    def glslc_args(self) -> list[str]:
        return [*GLSLC_FLAGS, *(f"-D{k}={v}" if v else f"-D{k}" for k, v in self.defines)]

    def source_hash(self) -> str:
        """sha256 over the flags, the defines, the .comp and every shared .glsl include."""
        h = hashlib.sha256()
        h.update(repr((GLSLC_FLAGS, self.source, self.defines)).encode())
        for path in [SHADER_DIR / self.source, *sorted(SHADER_DIR.glob("*.glsl"))]:
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        return h.hexdigest()


def variants() -> list[Variant]:
    out: list[Variant] = []
    for t in WEIGHT_TYPES:
        ty = (f"TYPE_{t}", "")
        for red in REDUCE_MODES:
            rd = {"subgroup": (("REDUCE_SUBGROUP", ""),), "shmem": (), "none": (("REDUCE_NONE", ""),)}[red]
            out.append(Variant(f"mul_mv_{t}_{red}", "mul_mv.comp", (ty, *rd)))
            out.append(Variant(f"mul_mv_id_{t}_{red}", "mul_mv.comp", (ty, ("MUL_ID", ""), *rd)))
        if t in X_UNIFORM_TYPES:  # thread-per-row mat-vec reading x from a uniform buffer
            ux = (("REDUCE_NONE", ""), ("X_UNIFORM", ""))
            out.append(Variant(f"mul_mv_{t}_none_ux", "mul_mv.comp", (ty, *ux)))
            out.append(Variant(f"mul_mv_id_{t}_none_ux", "mul_mv.comp", (ty, ("MUL_ID", ""), *ux)))
        # many rows of x per weight decode (prefill / verify rows on CPU devices), x uniform or storage
        out.append(Variant(f"mul_mv_{t}_none_xr", "mul_mv.comp", (ty, ("REDUCE_NONE", ""), ("XROWS", ""),
                                                                  ("X_UNIFORM", ""))))
        out.append(Variant(f"mul_mv_{t}_none_xrs", "mul_mv.comp", (ty, ("REDUCE_NONE", ""), ("XROWS", ""))))
        # routed experts grouped per expert (the slots that chose it share each weight decode)
        out.append(Variant(f"mul_mv_id_{t}_none_xrs", "mul_mv.comp", (ty, ("REDUCE_NONE", ""), ("XROWS", ""),
                                                                     ("MUL_ID", ""))))
        out.append(Variant(f"mul_mm_{t}", "mul_mm.comp", (ty,)))
        # routed experts over many tokens on GPUs: each expert's weight tiles read once for its slots
        out.append(Variant(f"mul_mm_id_{t}", "mul_mm.comp", (ty, ("MUL_ID", ""))))
        out.append(Variant(f"get_rows_{t}", "get_rows.comp", (ty,)))
    for op in ELEMENTWISE_OPS:
        out.append(Variant(op, "elementwise.comp", ((f"OP_{op.upper()}", ""),)))
    # attention: threads split each key chunk (GPUs), or each thread owns keys (CPU devices)
    out.append(Variant("attn", "attn.comp"))
    out.append(Variant("attn_none", "attn.comp", (("REDUCE_NONE", ""),)))
    out.append(Variant("attn_rows", "attn.comp", (("ROWS", ""),)))  # many rows on CPU devices: K/V read once per key
    for name in ("rms_norm", "rope", "softmax_topk", "sigmoid_topk", "argmax", "set_rows", "copy",
                 "cols", "gdn_gates", "ssm_conv", "delta_rule", "delta_chunk",  # the last five: Gated DeltaNet models
                 "moe_sum", "moe_group", "nonfinite"):
        out.append(Variant(name, f"{name}.comp"))
    for t in ("F16", "Q8_0", "Q4_0"):  # K/V into a cache stored as ggml blocks (--cache-type-k / -v), and out
        out.append(Variant(f"set_rows_{t}", "set_rows_q.comp", ((f"KV_{t}", ""),)))
        out.append(Variant(f"kv_rows_{t}", "get_rows.comp", (("TYPE_" + t, ""), ("KV_ROWS", ""))))
    out.append(Variant("hadamard", "hadamard.comp"))  # a quantized cache's rotation of each head
    out.append(Variant("greedy_next", "argmax.comp", (("GREEDY_NEXT", ""),)))  # a greedy step's tail (GreedyChain)
    for name in ("softmax_topk", "sigmoid_topk"):  # routers that also write streamed experts' slots
        out.append(Variant(f"{name}_lut", f"{name}.comp", (("SLOT_LUT", ""),)))
    out.append(Variant("moe_sum4", "moe_sum.comp", (("VEC4", ""),)))  # four columns a thread
    out.append(Variant("rms_norm4", "rms_norm.comp", (("VEC4", ""),)))  # rows read as vec4s
    # gpt-oss experts: biases and the clamped SwiGLU around the expert mat-vecs
    out.append(Variant("expert_glu_oai", "expert_bias.comp", (("GLU_OAI", ""),)))
    out.append(Variant("expert_down_bias", "expert_bias.comp", (("DOWN_BIAS", ""),)))
    return out
