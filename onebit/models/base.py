"""What every architecture shares: its config, the tensors it reads, and its schedule of
shared blocks. The run of a network on a backend (caches, file checks, counters) is runner.py's."""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..errors import UsageError
from . import blocks


class TransformerLM:
    """An architecture: its config, the tensors it reads, and its schedule of shared blocks,
    which a backend runs (runner.Runner holds a run's state). An architecture file gives
    `config()` (its metadata mapping) and, where the shared `blocks.decoder_layer` does not
    fit, its own `layer()`."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    @staticmethod
    def config(gguf) -> ModelConfig:
        raise NotImplementedError

    def expected_tensors(self, gguf) -> dict[str, tuple[int, ...]]:
        """Every tensor the schedule reads, with its shape (numpy order)."""
        return blocks.expected_tensors(self.cfg, gguf)

    @staticmethod
    def mixer(g, cfg: ModelConfig, layer: int, x):
        """Layer's token mixer over x = norm(residual) (the predictor runs it speculatively)."""
        return blocks.mixer(g, cfg, layer, x)

    @staticmethod
    def router_names(cfg: ModelConfig, layer: int) -> tuple[str, str, str | None]:
        """GGUF names of the layer's FFN norm, router weight and router bias (None: no bias)."""
        return f"blk.{layer}.{cfg.ffn_norm}.weight", f"blk.{layer}.ffn_gate_inp.weight", None

    def layer(self, g, i: int, x):
        """Layer i of the schedule, as block calls on the running step `g`."""
        return blocks.decoder_layer(g, self.cfg, i, x)

    def schedule(self, g, last_only: bool = False):
        """The whole forward pass as ops on `g`: embedding, every layer, the output head."""
        x = g.embed("token_embd.weight")  # [R, dim]
        if self.cfg.embed_scale != 1.0:
            x = g.scale(x, self.cfg.embed_scale)
        for i in range(self.cfg.n_layers):
            x = self.layer(g, i, x)
        if last_only:
            x = g.last_row(x)  # [1, dim]
        return blocks.output_head(g, self.cfg, x)  # [R, vocab]


def check_ids(ids: np.ndarray, vocab_size: int) -> None:
    """Token ids outside the vocabulary are the caller's error (on a device: out-of-bounds reads)."""
    if ids.size <= 16:  # (a decode step's: Python's min and max cost less than two reductions)
        vals = ids.ravel().tolist()
        lo, hi = (min(vals), max(vals)) if vals else (0, 0)
    else:
        lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise UsageError(f"token ids must be in [0, {vocab_size}), got {lo}..{hi}")
