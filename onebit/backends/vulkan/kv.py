"""The KV cache in device memory: `DeviceKV` holds every layer's keys and values (and a Gated
DeltaNet layer's conv history and state) in mapped device buffers, so trim / snapshot / restore
work on it as on host arrays; `DeviceCache` is a sequence's view of one, a layer cache per layer.

A sliding-window layer's buffers are a ring (position p in row p % its rows: set_rows and attn
wrap), and a forward runs in chunks no longer than the rows its rings are sized for.
"""

from __future__ import annotations

import weakref

import numpy as np

from ...cache import (F32_KV, SWA_ROWS, Cache, KVCache, KVRows, KVTypes, RecurrentCache, RingKVCache, kv_rotation,
                      layer_positions)
from .device import Buffer, Slice, VulkanKernelError

MAX_ROWS = 256  # the most rows one recorded forward has: longer ones run as chunks (runner.row_chunks)


class DeviceKV:
    """Every layer's keys [cap, Hkv, D] and values [cap, Hkv, Dv] in mapped device buffers; a
    sliding-window layer's ring holds at most its `ring_capacity` positions (`swa_rows`: the
    rows its forwards are sized for, 0: no rings), position p in row p % its rows. Stored as
    `types` says: float32 arrays, or ggml blocks (the host sees `KVRows` over the same memory)."""

    def __init__(self, dev, cfg, capacity: int, swa_rows: int = SWA_ROWS, types: KVTypes = F32_KV):
        self.dev, self.cfg, self.types = dev, cfg, types
        self.capacity = int(capacity)
        self.swa_rows = int(swa_rows)
        self.rings = [i for i in range(cfg.n_layers) if swa_rows and cfg.layer_window(i) > 0]
        self.users: "weakref.WeakSet[DeviceCache]" = weakref.WeakSet()
        self.recordings: dict = {}
        self._alloc()
        # A Gated DeltaNet layer's conv history [K-1, C] and state [Hv, D, D]: a constant size
        # (they never grow), mapped like the K/V so checkpoints and rollback work on the host.
        self.rbuffers: dict[int, tuple[Buffer, Buffer]] = {}
        self.conv: dict[int, np.ndarray] = {}
        self.state: dict[int, np.ndarray] = {}
        for layer in cfg.recurrent_layers:
            cshape = (cfg.ssm_conv_kernel - 1, cfg.ssm_conv_channels)
            sshape = (cfg.ssm_time_step_rank, cfg.ssm_state_size, cfg.ssm_state_size)
            cb = self.dev.buffer(max(int(np.prod(cshape)) * 4, 16), host_visible=True)
            sb = self.dev.buffer(int(np.prod(sshape)) * 4, host_visible=True)
            self.rbuffers[layer] = (cb, sb)
            self.conv[layer], self.state[layer] = cb.view(np.float32, cshape), sb.view(np.float32, sshape)

    def conv_slice(self, layer: int) -> Slice:
        return self.rbuffers[layer][0].slice(0, self.rbuffers[layer][0].size)

    def state_slice(self, layer: int) -> Slice:
        return self.rbuffers[layer][1].slice(0, self.state[layer].nbytes)

    def _alloc(self) -> None:
        cfg, cap = self.cfg, self.capacity
        self.buffers: list[tuple[Buffer, Buffer]] = []
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        for layer in range(cfg.n_layers):
            n = max(1, layer_positions(cfg, layer, cap, self.swa_rows))  # a DeltaNet layer keeps no K/V
            kq, vq = self.types.qtype("k"), self.types.qtype("v")
            kshape = (n, cfg.n_kv_heads, kq.row_bytes(cfg.head_dim))  # [n, Hkv, D] as bytes
            vshape = (n, cfg.n_kv_heads, vq.row_bytes(cfg.head_dim_v))
            # (blocks of 34 or 18 bytes: whole words, so the kernel's last word stays inside)
            kb = self.dev.buffer(-(-int(np.prod(kshape)) // 4) * 4, host_visible=True)
            vb = self.dev.buffer(-(-int(np.prod(vshape)) // 4) * 4, host_visible=True)
            if not (kb.host_visible and vb.host_visible):
                kb.destroy()
                vb.destroy()
                raise VulkanKernelError("KV cache: the device has no host-visible memory")
            self.buffers.append((kb, vb))
            k = _rows(kb, kq, kshape, cfg.head_dim, kv_rotation(self.types.k, "k", cfg.head_dim))
            v = _rows(vb, vq, vshape, cfg.head_dim_v, kv_rotation(self.types.v, "v", cfg.head_dim_v))
            k.fill(0)
            v.fill(0)
            self.keys.append(k)
            self.values.append(v)

    def k_slice(self, layer: int) -> Slice:
        return self.buffers[layer][0].slice(0, -(-self.keys[layer].nbytes // 4) * 4)

    def v_slice(self, layer: int) -> Slice:
        return self.buffers[layer][1].slice(0, -(-self.values[layer].nbytes // 4) * 4)

    def rows(self, layer: int) -> int:
        """Positions layer's buffers hold (position p in row p % rows)."""
        return self.keys[layer].shape[0]

    @property
    def forward_rows(self) -> int:
        """The most rows one recorded forward may have: a ring's rows read after they are written."""
        return min(RingKVCache.rows_for(self.cfg.layer_window(i), self.swa_rows) for i in self.rings) if self.rings \
            else MAX_ROWS

    @property
    def in_use(self) -> bool:
        return len(self.users) > 0

    def grow(self, n: int) -> None:
        """Room for at least n positions: new buffers (double), contents copied, recordings dropped."""
        cap = max(self.capacity, 1)
        while cap < n:
            cap *= 2
        old_bufs, old_k, old_v = self.buffers, self.keys, self.values
        self.capacity = cap
        self._alloc()
        for layer in range(self.cfg.n_layers):  # (a ring that already wrapped keeps its size)
            self.keys[layer][: old_k[layer].shape[0]] = old_k[layer]
            self.values[layer][: old_v[layer].shape[0]] = old_v[layer]
        del old_k, old_v
        self.drop_recordings()
        for kb, vb in old_bufs:
            kb.destroy()
            vb.destroy()

    def drop_recordings(self) -> None:
        """Close every recording over these buffers (one over several sequences' storages leaves
        the others' lists too)."""
        for r in list(self.recordings.values()):
            r.close()
        self.recordings = {}

    def destroy(self) -> None:
        self.drop_recordings()
        for kb, vb in [*self.buffers, *self.rbuffers.values()]:
            kb.destroy()
            vb.destroy()
        self.buffers, self.keys, self.values = [], [], []
        self.rbuffers, self.conv, self.state = {}, {}, {}

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values)) + \
            sum(self.conv[l].nbytes + self.state[l].nbytes for l in self.conv)


def _rows(buf: Buffer, qtype, shape, width: int, rot: int):
    """A buffer's K or V as the host sees it: float32 [n, Hkv, width], or KVRows of its blocks
    (rotated in chunks of `rot`, 0: not)."""
    if qtype.name == "F32":
        return buf.view(np.float32, (shape[0], shape[1], width))
    raw = buf.view(np.uint8, (buf.size,))[: int(np.prod(shape))].reshape(shape)
    return KVRows(qtype, raw, width, rot)


class _DeviceKVView:
    """A layer cache whose keys and values are layer `layer`'s buffers in a `DeviceKV`."""

    storage: DeviceKV
    layer: int

    @property
    def keys(self) -> np.ndarray:
        return self.storage.keys[self.layer]

    @property
    def values(self) -> np.ndarray:
        return self.storage.values[self.layer]

    @property
    def plain(self) -> bool:
        return self.storage.types.plain

    @property
    def rotation(self) -> tuple[int, int]:
        k, v = self.keys, self.values
        return (k.rot if isinstance(k, KVRows) else 0), (v.rot if isinstance(v, KVRows) else 0)


class DeviceKVCache(_DeviceKVView, KVCache):
    """One layer's view of a `DeviceKV`: a `KVCache` whose keys and values are device memory."""

    def __init__(self, storage: DeviceKV, layer: int):
        self.storage, self.layer = storage, layer

    def write(self, start: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if start + k.shape[0] > self.storage.capacity:
            self.storage.grow(start + k.shape[0])  # every layer's buffers at once
        return super().write(start, k, v)


class DeviceRingKVCache(_DeviceKVView, RingKVCache):
    """One sliding-window layer's ring in a `DeviceKV`: the device writes and reads it; the host
    keeps what it holds (`advance`, called by the runner per forward), trims and snapshots it."""

    def __init__(self, storage: DeviceKV, layer: int):
        self.storage, self.layer = storage, layer
        self.window = storage.cfg.layer_window(layer)
        self.capacity = layer_positions(storage.cfg, layer, 1 << 62, storage.swa_rows)
        self.rows = self.capacity - self.window + 1
        self.held_from = 0

    def _room(self, n: int) -> None:
        if n > self.keys.shape[0] and self.keys.shape[0] < self.capacity:
            self.storage.grow(n)  # every layer's buffers at once


class DeviceRecurrentCache(RecurrentCache):
    """One Gated DeltaNet layer's view of a `DeviceKV`: conv history and state in device memory."""

    def __init__(self, storage: DeviceKV, layer: int):
        self.storage, self.layer = storage, layer

    @property
    def conv(self) -> np.ndarray:
        return self.storage.conv[self.layer]

    @property
    def state(self) -> np.ndarray:
        return self.storage.state[self.layer]


class DeviceCache(Cache):
    """A sequence whose layers' K/V (and recurrent state) live in one `DeviceKV`."""

    def __init__(self, storage: DeviceKV):
        cfg = storage.cfg

        def layer_cache(layer: int):
            if cfg.layer_is_recurrent(layer):
                return DeviceRecurrentCache(storage, layer)
            return DeviceRingKVCache(storage, layer) if layer in storage.rings else DeviceKVCache(storage, layer)

        super().__init__([layer_cache(layer) for layer in range(cfg.n_layers)])
        self.storage = storage
        storage.users.add(self)
        for c in self.layers:  # a new sequence: zero state (a reused storage holds the last one's)
            if isinstance(c, RecurrentCache):
                c.reset()
