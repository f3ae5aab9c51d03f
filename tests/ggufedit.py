"""Make broken or altered copies of a fixture GGUF for bad-input tests."""

from __future__ import annotations

from typing import Any, Callable, Optional

import gguf
import numpy as np


def rewrite(src, dst, *, meta: Optional[dict[str, Any]] = None, drop_meta=(), drop_tensors=(),
            arch: Optional[str] = None, tensor_fn: Optional[Callable] = None):
    """Copy src to dst changing metadata (key -> python value) and tensors.
    tensor_fn(name, array, qtype) -> (array, qtype) or None to keep it unchanged."""
    r = gguf.GGUFReader(str(src))
    src_arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch or src_arch)
    meta = dict(meta or {})
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop_meta:
            continue
        if arch and name.startswith(src_arch + "."):
            new = arch + name[len(src_arch):]
        else:
            new = name
        if name in meta:
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
        val = f.contents()
        if vtype == gguf.GGUFValueType.ARRAY and sub is None:
            continue
        w.add_key_value(new, val, vtype, sub_type=sub)
    for k, v in meta.items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, (list, tuple)):
            w.add_array(k, list(v))
        else:
            w.add_string(k, v)
    for t in r.tensors:
        if t.name in drop_tensors:
            continue
        data, qtype = np.array(t.data), t.tensor_type
        if tensor_fn is not None:
            out = tensor_fn(t.name, data, qtype)
            if out is not None:
                data, qtype = out
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(t.name, data)
        else:
            w.add_tensor(t.name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
