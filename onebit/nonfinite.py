"""Where NaN / inf first appear, when a forward pass's logits are not finite.

The check itself is each backend's, once per forward (numpy: a sum of the logits; Vulkan: a
flag the recording's last dispatch sets), reported by runner.py. Only when it fails is
the same step run again here, on the numpy backend, eagerly, with every op's output checked,
from a numpy copy of the cache as it was before the step (on Vulkan the K/V of earlier
positions are read from the mapped device buffers). The first op whose output is
not finite names the layer and the tensor; whether that tensor itself holds NaN / inf tells
a corrupt file from values that overflow float32.
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

from .backends.numpy_backend import EagerStep, NumpyBackend, dequantize
from .cache import RingKVCache, make_cache
from .formats.gguf_file import EXPERT_PARTS

_BLK = re.compile(r"^blk\.(\d+)\.")


class _Found(Exception):
    def __init__(self, where: str):
        self.where = where


def _finite(out) -> bool:
    for a in out if isinstance(out, tuple) else (out,):
        if isinstance(a, np.ndarray) and a.dtype.kind == "f" and not np.isfinite(a).all():
            return False
    return True


class CheckedStep(EagerStep):
    """EagerStep that stops at the first op whose output holds NaN or inf."""

    layer: Optional[int] = None  # the layer the running op belongs to (None: embedding / head)

    def _at(self, op: str, out, name: Optional[str] = None, layer: Optional[int] = None, weights=()):
        """`out` if it is finite; else stop, naming where. `weights`: (tensor name, index) the op
        read, checked for NaN / inf only then."""
        if layer is None and name is not None:
            m = _BLK.match(name)
            layer = int(m.group(1)) if m else None
        if layer is not None or name is not None:
            self.layer = layer
        if _finite(out):
            return out
        if self.layer is not None:
            where = f"layer {self.layer}"
        elif name == "token_embd.weight" and op == "embed":
            where = "the token embedding"
        else:
            where = "the output head"
        what = f"{op} {name}" if name else op
        if name is not None:
            weights = ((name, None),) + tuple(weights)
        cause = "values overflowed float32 (corrupt weights or metadata)"
        for w, index in weights:
            if w in self.tensor_names and not np.isfinite(dequantize(self.be.gguf.tensor(w), index)).all():
                part = f" (expert {index})" if index is not None else ""
                cause = f"tensor {w!r}{part} holds NaN/inf values: the file's weights are corrupt"
                break
        raise _Found(f"first in {where} ({what}): {cause}")

    def embed(self, name):
        return self._at("embed", super().embed(name), name)

    def norm(self, x, name, eps):
        return self._at("norm", super().norm(x, name, eps), name)

    def linear(self, x, name, bias=None):
        return self._at("linear", super().linear(x, name, bias), name, weights=((bias, None),) if bias else ())

    def linears(self, x, names, biases):
        ys = super().linears(x, names, biases)  # (fused on the cpu backend: `linear` not called)
        return [self._at("linear", y, n, weights=((b, None),) if b else ()) for y, n, b in zip(ys, names, biases)]

    def rope(self, x, *args):
        return self._at("rope", super().rope(x, *args))

    def attention(self, layer, q, k, v, *args):
        return self._at("attention", super().attention(layer, q, k, v, *args), layer=layer)

    def add(self, a, b):
        return self._at("add", a + b)

    def residual(self, x, y):
        return self._at("residual", x + y)

    def swiglu(self, a, b):
        return self._at("swiglu", super().swiglu(a, b))

    def geglu(self, a, b):
        return self._at("geglu", super().geglu(a, b))

    def scale(self, x, *args):
        return self._at("scale", super().scale(x, *args))

    def softcap(self, x, *args):
        return self._at("softcap", super().softcap(x, *args))

    def route(self, logits, k, norm):
        return self._at("route", super().route(logits, k, norm))

    def experts(self, layer, x, ids, weights, *args):
        read = [(f"blk.{layer}.{p}.weight", int(e)) for e in np.unique(ids) for p in EXPERT_PARTS]
        return self._at("experts", super().experts(layer, x, ids, weights, *args), layer=layer, weights=read)

    def shared_expert(self, layer, x):
        parts = ("gate_inp_shexp", "gate_shexp", "up_shexp", "down_shexp")
        read = [(f"blk.{layer}.ffn_{p}.weight", None) for p in parts]
        return self._at("shared_expert", super().shared_expert(layer, x), layer=layer, weights=read)


def first_nonfinite(model, gguf, ids: np.ndarray, cache, last_only: bool) -> Optional[str]:
    """Re-run architecture `model`'s step that just put token ids [R] into `cache` (its offset
    already moved past them) on numpy over the tensors of `gguf`, checking every op; 'first in layer L (op tensor): cause', or None when the
    re-run is finite (or cannot be made)."""
    cfg = model.cfg
    start = cache.offset - len(ids)
    fresh = make_cache(cfg)
    try:
        for layer in range(cfg.n_layers):
            c = cache[layer]
            if isinstance(c, RingKVCache):  # a sliding-window ring: the same ring, copied
                fresh.layers[layer] = RingKVCache(cfg.n_kv_heads, cfg.head_dim, cfg.head_dim_v, c.window, 0, c.rows)
                fresh[layer].restore(c.snapshot(start))
                continue
            keys, values = c.keys, c.values
            if start:
                fresh[layer].write(0, np.array(keys[:start]), np.array(values[:start]))
    except (AttributeError, IndexError, TypeError, ValueError):  # a cache without keys/values
        return None
    fresh.offset = start
    step = CheckedStep(NumpyBackend(gguf), ids, fresh)
    try:
        with np.errstate(all="ignore"):
            model.schedule(step, last_only)
    except _Found as f:
        return f.where
    return None
