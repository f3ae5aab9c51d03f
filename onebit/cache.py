"""Caches typed per layer, held by the `Cache` of one sequence, which also holds the position.

A layer's cache is the state its mixer keeps between forward passes: `KVCache` for attention
(keys and values by position), `RecurrentCache` for a Gated DeltaNet layer (conv history and
delta-rule state: a constant size, no positions, so it cannot trim). Every layer cache says
whether it can `trim` (drop the last positions in place) and gives a `snapshot` / `restore`
of its state; speculative decoding and chat prefix reuse roll back through `Cache.trim`, or,
where a layer cannot trim, to a `Cache.checkpoint` taken at the position to return to.
"""

from __future__ import annotations

import numpy as np


class KVCache:
    """Keys and values of one attention layer, by position, grown in steps.

    Positions past the sequence's length are never read, so trimming is free: the sequence
    moves its position back and later writes overwrite what was there."""

    step = 256
    can_trim = True

    def __init__(self, n_kv_heads: int, head_dim: int, head_dim_v: int, capacity: int = 0):
        # capacity > 0: allocate (and touch) it all now, as the memory plan counted it
        self.keys = np.zeros((capacity, n_kv_heads, head_dim), np.float32)  # [cap, Hkv, D]
        self.values = np.zeros((capacity, n_kv_heads, head_dim_v), np.float32)  # [cap, Hkv, Dv]
        if capacity:
            self.keys.fill(0)
            self.values.fill(0)

    def write(self, start: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k: [R, Hkv, D], v: [R, Hkv, Dv] at positions start..start+R-1; return every
        key and value up to the last of them: [start + R, Hkv, *]."""
        n = start + k.shape[0]
        if n > self.keys.shape[0]:
            cap = (n + self.step - 1) // self.step * self.step
            self.keys = _grow(self.keys, cap)
            self.values = _grow(self.values, cap)
        self.keys[start:n] = k
        self.values[start:n] = v
        return self.keys[:n], self.values[:n]

    def trim(self, length: int) -> None:
        """The sequence is now `length` positions long (nothing to do: see the class note)."""

    def snapshot(self, length: int):
        return self.keys[:length].copy(), self.values[:length].copy()

    def restore(self, state) -> None:
        k, v = state
        self.write(0, k, v)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class RecurrentCache:
    """A Gated DeltaNet layer's state after the sequence's last position: the conv's input
    history (the last kernel - 1 rows) and the delta rule's state per value head.

    It holds no positions, so it cannot go back by itself: rolling back means restoring a
    snapshot taken at the position to return to (`Cache.checkpoint` / `Cache.rollback`)."""

    can_trim = False

    def __init__(self, conv_kernel: int, conv_channels: int, n_heads: int, head_dim: int):
        self.conv = np.zeros((conv_kernel - 1, conv_channels), np.float32)  # [K-1, C], oldest first
        self.state = np.zeros((n_heads, head_dim, head_dim), np.float32)  # [Hv, Dk, Dv]

    def trim(self, length: int) -> None:
        """Nothing to drop (`Cache.trim` refuses a real trim; a rollback restores a snapshot)."""

    def reset(self) -> None:
        """The state of an empty sequence."""
        self.conv.fill(0)
        self.state.fill(0)

    def snapshot(self, length: int = 0):
        return self.conv.copy(), self.state.copy()

    def restore(self, state) -> None:
        conv, st = state
        self.conv[...] = conv
        self.state[...] = st

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.state.nbytes


def recurrent_state_bytes(cfg, elem_bytes: int = 4) -> int:
    """Bytes of every recurrent layer's state for one sequence (whatever its length)."""
    per = (cfg.ssm_conv_kernel - 1) * cfg.ssm_conv_channels + cfg.ssm_time_step_rank * cfg.ssm_state_size ** 2
    return len(cfg.recurrent_layers) * per * elem_bytes


def _grow(a: np.ndarray, cap: int) -> np.ndarray:
    out = np.zeros((cap, *a.shape[1:]), a.dtype)
    out[: a.shape[0]] = a
    return out


class Cache:
    """One sequence: a cache per layer, and `offset`, the number of positions it holds."""

    def __init__(self, layers: list):
        self.layers = layers
        self.offset = 0

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int):
        return self.layers[layer]

    def __iter__(self):
        return iter(self.layers)

    @property
    def can_trim(self) -> bool:
        return all(c.can_trim for c in self.layers)

    def trim(self, n: int) -> int:
        """Drop the last n positions (fewer if it holds fewer); returns how many were dropped."""
        n = max(0, min(self.offset, n))
        if n and not self.can_trim:
            raise ValueError("this cache cannot trim: restore a snapshot instead")
        self.offset -= n
        for c in self.layers:
            c.trim(self.offset)
        return n

    def snapshot(self):
        return self.offset, [c.snapshot(self.offset) for c in self.layers]

    def restore(self, state) -> None:
        self.offset, layers = state
        for c, s in zip(self.layers, layers):
            c.restore(s)

    def checkpoint(self):
        """What `rollback` needs to return to this position: the layers that cannot trim are
        copied (recurrent state: a constant size), the others will trim."""
        return self.offset, {i: c.snapshot(self.offset) for i, c in enumerate(self.layers) if not c.can_trim}

    def rollback(self, point) -> None:
        """Back to a checkpoint taken at a position this sequence has not since gone below."""
        offset, saved = point
        if offset > self.offset:
            raise ValueError(f"cannot roll forward from {self.offset} to {offset}")
        self.offset = offset
        for i, c in enumerate(self.layers):
            if i in saved:
                c.restore(saved[i])
            else:
                c.trim(offset)

    def clear(self) -> None:
        """An empty sequence (recurrent layers back to zero state)."""
        self.offset = 0
        for c in self.layers:
            reset = getattr(c, "reset", None)
            reset() if reset is not None else c.trim(0)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)


def make_cache(cfg, capacity: int = 0) -> Cache:
    return Cache([RecurrentCache(cfg.ssm_conv_kernel, cfg.ssm_conv_channels, cfg.ssm_time_step_rank, cfg.ssm_state_size)
                  if cfg.layer_is_recurrent(i) else KVCache(cfg.n_kv_heads, cfg.head_dim, cfg.head_dim_v, capacity)
                  for i in range(cfg.n_layers)])


def kv_cache_bytes(cfg, n_ctx: int, elem_bytes: int = 4) -> int:
    """Bytes of every attention layer's keys and values for n_ctx positions."""
    return len(cfg.attention_layers) * n_ctx * cfg.n_kv_heads * (cfg.head_dim + cfg.head_dim_v) * elem_bytes
