"""What every architecture file shares: construction, tensor checks, positions."""

from __future__ import annotations

import numpy as np

from ..cache import KVCache, cache_offset, make_cache
from ..config import ModelConfig
from . import blocks


class TransformerLM:
    """A decoder over one sequence. Subclasses give `config()` and a top-to-bottom `forward()`."""

    def __init__(self, gguf, backend, cfg: ModelConfig | None = None):
        self.gguf = gguf
        self.be = backend
        self.cfg: ModelConfig = cfg if cfg is not None else self.config(gguf)
        blocks.check_tensors(gguf, blocks.expected_tensors(self.cfg, gguf, self.layer_has_moe))
        attach = getattr(backend, "attach_model", None)  # e.g. Vulkan: the recorded decode step
        if attach is not None:
            attach(self)

    @staticmethod
    def config(gguf) -> ModelConfig:
        raise NotImplementedError

    def layer_has_moe(self, layer: int) -> bool:
        return self.cfg.is_moe

    def make_cache(self, capacity: int = 0) -> list[KVCache]:
        device_cache = getattr(self.be, "make_cache", None)  # the backend's own (device memory)
        cache = device_cache(self, capacity) if device_cache is not None else None
        return cache if cache is not None else make_cache(self.cfg, capacity)

    @staticmethod
    def positions(cache: list[KVCache], n: int) -> np.ndarray:
        start = cache_offset(cache)
        return np.arange(start, start + n, dtype=np.int64)  # [R]
