"""Token log-probabilities of a generation, as the OpenAI API returns them (`logprobs`,
`top_logprobs`): taken from the distribution each token was drawn from."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    bytes: list[int]
    top: list[tuple[str, float, list[int]]]  # the most likely tokens at this position, best first


class LogprobRecorder:
    """The last logits processor of a request that asks for logprobs: the log-softmax of the
    distribution each token was drawn from (after penalties, bias and grammar), taken when the
    token's logits pass by and read once the token is known."""

    def __init__(self, tokenizer, top: int):
        self.tokenizer, self.top = tokenizer, top
        self.rows: list[np.ndarray] = []

    def __call__(self, tokens, logits):
        x = logits.astype(np.float64)
        finite = np.isfinite(x)
        m = x[finite].max() if finite.any() else 0.0
        self.rows.append(x - (m + np.log(np.exp(x[finite] - m).sum())))
        return logits

    def entry(self, token: int) -> TokenLogprob:
        row = self.rows.pop(0)
        piece = lambda t: self.tokenizer.token_bytes(t)  # noqa: E731
        top = []
        if self.top:
            best = np.argpartition(-row, min(self.top, len(row) - 1))[: self.top]
            best = best[np.argsort(-row[best], kind="stable")]
            top = [(piece(int(t)).decode("utf-8", "replace"), float(row[t]), list(piece(int(t)))) for t in best
                   if np.isfinite(row[t])]
        b = piece(token)
        return TokenLogprob(b.decode("utf-8", "replace"), float(row[token]), list(b), top)
