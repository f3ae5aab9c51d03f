"""Per-layer KV cache with trim / snapshot / restore (speculative decoding rolls back)."""

from __future__ import annotations

import numpy as np


class KVCache:
    """Keys and values of one attention layer for one sequence, grown in steps."""

    step = 256

    def __init__(self, n_kv_heads: int, head_dim: int, head_dim_v: int, capacity: int = 0):
        # capacity > 0: allocate (and touch) it all now, as the memory plan counted it
        self.keys = np.zeros((capacity, n_kv_heads, head_dim), np.float32)  # [cap, Hkv, D]
        self.values = np.zeros((capacity, n_kv_heads, head_dim_v), np.float32)
        if capacity:
            self.keys.fill(0)
            self.values.fill(0)
        self.offset = 0

    def update_and_fetch(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append k: [R, Hkv, D], v: [R, Hkv, Dv]; return all keys/values so far: [S, Hkv, *]."""
        n = self.offset + k.shape[0]
        if n > self.keys.shape[0]:
            cap = (n + self.step - 1) // self.step * self.step
            self.keys = _grow(self.keys, cap)
            self.values = _grow(self.values, cap)
        self.keys[self.offset : n] = k
        self.values[self.offset : n] = v
        self.offset = n
        return self.keys[:n], self.values[:n]

    def trim(self, n: int) -> int:
        """Drop the last n positions; returns how many were dropped."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    def snapshot(self):
        return self.offset, self.keys[: self.offset].copy(), self.values[: self.offset].copy()

    def restore(self, state) -> None:
        offset, k, v = state
        self.offset = 0
        if offset:
            self.update_and_fetch(k, v)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def _grow(a: np.ndarray, cap: int) -> np.ndarray:
    out = np.zeros((cap, *a.shape[1:]), a.dtype)
    out[: a.shape[0]] = a
    return out


def make_cache(cfg, capacity: int = 0) -> list[KVCache]:
    return [KVCache(cfg.n_kv_heads, cfg.head_dim, cfg.head_dim_v, capacity) for _ in range(cfg.n_layers)]


def trim_cache(cache: list[KVCache], n: int) -> None:
    for c in cache:
        c.trim(n)


def cache_offset(cache: list[KVCache]) -> int:
    return cache[0].offset if cache else 0


def kv_cache_bytes(cfg, n_ctx: int, elem_bytes: int = 4) -> int:
    """Bytes of every layer's keys and values for n_ctx positions."""
    return cfg.n_layers * n_ctx * cfg.n_kv_heads * (cfg.head_dim + cfg.head_dim_v) * elem_bytes
