"""The shipped SPIR-V: complete, not stale against shaders/, and laid out like gguf's blocks."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import struct
import sys
from pathlib import Path

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from onebit.backends.vulkan.kernels import SUPPORTED_TYPES, QTYPES_BY_NAME

ROOT = Path(__file__).resolve().parents[1]
SPV = ROOT / "onebit" / "backends" / "vulkan" / "spv"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"shaders_{name}", ROOT / "shaders" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


variants = _load("variants")
MANIFEST = json.loads((SPV / "manifest.json").read_text())["variants"]


def test_every_variant_is_shipped_and_nothing_else():
    names = {v.name for v in variants.variants()}
    assert set(MANIFEST) == names, "run: python shaders/build.py"
    assert {p.stem for p in SPV.glob("*.spv")} == names, "run: python shaders/build.py"


def test_shipped_spirv_is_not_stale():
    stale = [v.name for v in variants.variants() if MANIFEST[v.name]["source_hash"] != v.source_hash()]
    assert not stale, f"shaders changed since the last build ({', '.join(stale[:5])}...): run python shaders/build.py"
    bad = [n for n, e in MANIFEST.items()
           if hashlib.sha256((SPV / f"{n}.spv").read_bytes()).hexdigest() != e["spv_sha256"]]
    assert not bad, f"SPIR-V files differ from the manifest: {bad[:5]}; run python shaders/build.py --all"


def _spirv_array_strides(code: bytes) -> dict[str, set[int]]:
    """ArrayStrides of the shader's runtime arrays, split by element kind: "struct" (a block
    struct such as Q4_K) or "other" (scalars and vectors). glslc -O strips names, so the
    weight struct is found as the one runtime array whose element is a struct."""
    words = struct.unpack(f"<{len(code) // 4}I", code)
    assert words[0] == 0x07230203, "not SPIR-V"
    structs, strides, arrays = set(), {}, {}
    i = 5
    while i < len(words):
        op, n = words[i] & 0xFFFF, words[i] >> 16
        args = words[i + 1 : i + n]
        if op == 71 and args[1] == 6:  # OpDecorate <id> ArrayStride <n>
            strides[args[0]] = args[2]
        elif op == 29:  # OpTypeRuntimeArray <id> <element>
            arrays[args[0]] = args[1]
        elif op == 30:  # OpTypeStruct
            structs.add(args[0])
        i += n
    out = {"struct": set(), "other": set()}
    for arr, elem in arrays.items():
        out["struct" if elem in structs else "other"].add(strides[arr])
    return out


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_block_struct_matches_gguf(type_name):
    """types.glsl's struct for each type has gguf's block byte size, and the numpy class agrees.
    Float types are read 4 values at a time (vec4 / f16vec4 / uvec2 views)."""
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]] if type_name != "Q1_0" else (128, 18)
    cls = QTYPES_BY_NAME[type_name]
    assert (cls.block_size, cls.type_size) == (block_size, type_size)
    strides = _spirv_array_strides((SPV / f"get_rows_{type_name}.spv").read_bytes())
    if type_name in ("F32", "F16", "BF16"):
        assert 4 * type_size in strides["other"]
        return
    if not strides["struct"]:
        # the shipped decoders read this type's blocks as whole uvec4s (Q4_K, Q5_K), so the struct
        # is compiled away there: check it in a shader that indexes it
        assert type_size % 16 == 0 and 16 in strides["other"], f"{type_name}: neither struct nor uvec4 reads"
        strides = _spirv_array_strides(_probe_struct(type_name))
    assert strides["struct"] == {type_size}, (
        f"struct {type_name} in shaders/types.glsl: {strides['struct']} bytes, gguf: {type_size}")


def _probe_struct(type_name: str) -> bytes:
    """SPIR-V of a shader that reads a runtime array of types.glsl's struct for type_name."""
    import subprocess
    import tempfile

    glslc = shutil.which("glslc")
    assert glslc, "glslc is needed to build shaders (apt-get install glslc)"
    src = ("#version 450\n#include \"common.glsl\"\n#include \"types.glsl\"\nlayout(local_size_x = 1) in;\n"
           f"layout(binding = 0, std430) readonly buffer A {{ {type_name} a[]; }};\n"
           "layout(binding = 1, std430) writeonly buffer O { uint o[]; };\n"
           "void main() { o[0] = uint(a[gl_WorkGroupID.x].qs[3]); }\n")
    with tempfile.TemporaryDirectory() as tmp:
        comp, out = Path(tmp) / "probe.comp", Path(tmp) / "probe.spv"
        comp.write_text(src)
        subprocess.run([glslc, *variants.GLSLC_FLAGS, "-I", str(ROOT / "shaders"), str(comp), "-o", str(out)],
                       check=True, capture_output=True)
        return out.read_bytes()


def test_build_script_compiles_a_variant(tmp_path):
    """glslc (apt: glslc) turns a variant into SPIR-V; CI installs it with the Vulkan driver."""
    glslc = shutil.which("glslc")
    assert glslc, "glslc is needed to build shaders (apt-get install glslc)"
    build = _load("build")
    v = next(v for v in variants.variants() if v.name == "mul_mv_id_Q4_K_subgroup")
    _, code = build.compile_variant(glslc, v)
    assert code[:4] == struct.pack("<I", 0x07230203)
