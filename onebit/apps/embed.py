"""Embeddings of a decoder model: the hidden states after the final norm (what the output head
reads), pooled over a text's tokens and scaled to unit length, as llama-server's `--pooling`.

A decoder trained to predict the next token was not trained to place similar texts close
together: its embeddings are a baseline for retrieval and clustering, good for texts that share
words and topics, below a model trained for embeddings (e5, bge, nomic-embed).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import UsageError
from ..models.base import check_ids

POOLINGS = ("mean", "last", "cls")
CHUNK = 256  # rows of one forward
SLACK = 16  # tokens a prefix of a text may have beyond its part of the whole


class HiddenStates:
    """A network whose schedule stops at the final norm: [R, dim] instead of logits."""

    def __init__(self, arch):
        self.arch = arch

    def __getattr__(self, name):  # everything a backend asks of the network but its schedule
        return getattr(self.arch, name)

    def schedule(self, g, last_only: bool = False):
        cfg = self.arch.cfg
        x = g.embed("token_embd.weight")  # [R, dim]
        if cfg.embed_scale != 1.0:
            x = g.scale(x, cfg.embed_scale)
        for i in range(cfg.n_layers):
            x = self.arch.layer(g, i, x)
        return g.norm(x, "output_norm.weight", cfg.norm_eps)  # [R, dim]


def hidden_states(model, ids: Sequence[int]) -> np.ndarray:
    """[len(ids), dim]: the final-norm hidden state of every token, in a fresh cache."""
    ids = np.asarray(ids, dtype=np.int64)
    check_ids(ids, model.cfg.vocab_size)
    if len(ids) > model.context_length:
        raise UsageError(f"the input is {len(ids)} tokens; this model's context holds {model.context_length}")
    net = HiddenStates(model.net.arch)
    cache = model.net.make_cache(capacity=len(ids))  # (this input's rows only: the served cache is left as it is)
    rows = []
    for start in range(0, len(ids), CHUNK):
        h, _ = model.net.be.forward(net, ids[start:start + CHUNK], cache)
        rows.append(np.asarray(h, dtype=np.float32))
    return np.concatenate(rows)


def input_ids(model, text: str) -> list[int]:
    """Token ids of `text` (with the model's special tokens), or UsageError where they are more
    than the context holds: prefixes four times longer each time are tokenized while the text
    goes on, and one of more than the context + SLACK tokens ends it (a prefix cut mid-word may
    tokenize to a few more tokens than its part of the whole), so a huge text costs what a text
    of the context costs."""
    limit = model.context_length
    n = 4 * (limit + SLACK)  # characters
    while n < len(text):
        head = model.tokenize(text[:n])
        if len(head) > limit + SLACK:
            raise UsageError(f"the input is more than {len(head) - SLACK} tokens; this model's context holds {limit}")
        n *= 4
    return model.tokenize(text)


def pool(h: np.ndarray, pooling: str) -> np.ndarray:
    """One unit vector [dim] from hidden states [R, dim]."""
    if pooling == "mean":
        v = h.mean(axis=0)
    elif pooling == "last":
        v = h[-1]
    elif pooling == "cls":
        v = h[0]
    else:
        raise UsageError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    v = v.astype(np.float64)
    n = np.linalg.norm(v)
    return (v / n if n > 0 else v).astype(np.float32)


def embed(model, inputs: Sequence[Sequence[int]], pooling: str = "mean") -> list[np.ndarray]:
    """One pooled unit vector per input (token ids)."""
    return [pool(hidden_states(model, ids), pooling) for ids in inputs]


__all__ = ["POOLINGS", "HiddenStates", "embed", "hidden_states", "input_ids", "pool"]
