#!/usr/bin/env python3
"""Make an importance matrix for llama-quantize with onebit's own numpy engine.

    python tools/make_imatrix.py MODEL.gguf OUT.imatrix.gguf [--text FILE]

llama-quantize needs one for its lowest-bit types (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S and
IQ3_XXS's mix); llama.cpp's llama-imatrix makes it by running the model over a text. This
does the same over the text (default: tools/make_fixtures.py's reference text and tokenizer
strings): for every matrix a matmul multiplies, the sum over tokens of each input column's
square (`<name>.in_sum2`, per expert for expert tensors) and the token count (`<name>.counts`),
in llama.cpp's GGUF imatrix layout (`imatrix.datasets`, `imatrix.chunk_count`,
`imatrix.chunk_size`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import onebit  # noqa: E402
from onebit.backends import numpy_backend as nb  # noqa: E402
from onebit.formats.gguf_file import EXPERT_PARTS  # noqa: E402


class ActivationStats(nb.NumpyBackend):
    """The numpy backend, adding up every matmul input's squared columns as it runs."""

    def __init__(self, gguf):
        super().__init__(gguf)
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, np.ndarray] = {}

    def _add(self, name: str, x: np.ndarray, expert: int | None = None, n_experts: int = 1) -> None:
        if name not in self.sums:
            self.sums[name] = np.zeros((n_experts, x.shape[-1]), np.float64)
            self.counts[name] = np.zeros(n_experts, np.float64)
        e = 0 if expert is None else expert
        self.sums[name][e] += (x.astype(np.float64) ** 2).sum(axis=0)
        self.counts[name][e] += len(x)

    def linear(self, x, name):
        self._add(name, x.reshape(-1, x.shape[-1]))
        return super().linear(x, name)

    def expert_ffn(self, out, x, ids, weights, e, parts, raws, biases=None, glu=None):
        gate, up, down = (nb.QTYPES[t.qtype].dequantize(r) for t, r in zip(parts, raws))
        rows, _ = np.nonzero(ids == e)
        xe = x[rows]
        n_exp = parts[0].shape[0]
        for t in parts[:2]:
            self._add(t.name, xe, e, n_exp)
        g, u = xe @ gate.T, xe @ up.T  # down's input as the backend makes it (gpt-oss: biases, clamped SwiGLU)
        if biases is not None:
            g, u = g + biases[0][e], u + biases[1][e]
        h = self.silu(g) * u if glu is None else self.glu_oai(g, u, *glu)
        self._add(parts[2].name, h, e, n_exp)
        super().expert_ffn(out, x, ids, weights, e, parts, raws, biases, glu)


def default_text() -> str:
    sys.path.insert(0, str(ROOT / "tools"))
    import make_fixtures  # the fixtures' reference text and tokenizer strings

    return "\n".join([make_fixtures.REF_TEXT, *make_fixtures.TOKENIZER_STRINGS])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--text", type=Path, help="text to run (default: the fixtures' reference text)")
    ap.add_argument("--chunk", type=int, default=64, help="tokens per forward pass")
    args = ap.parse_args()
    import gguf

    text = args.text.read_text() if args.text else default_text()
    model = onebit.load(args.model, backend="numpy")
    stats = ActivationStats(model.gguf)
    model.net.be = stats
    ids = np.array(model.tokenizer.encode(text), np.int64)
    chunks = 0
    for s in range(0, len(ids), args.chunk):
        model.net.forward(ids[s : s + args.chunk], model.new_cache())
        chunks += 1
    w = gguf.GGUFWriter(str(args.out), arch="imatrix")
    w.add_array("imatrix.datasets", [args.text.name if args.text else "onebit fixture reference text"])
    w.add_uint32("imatrix.chunk_count", chunks)
    w.add_uint32("imatrix.chunk_size", args.chunk)
    for name in sorted(stats.sums):
        w.add_tensor(f"{name}.in_sum2", stats.sums[name].astype(np.float32))
        w.add_tensor(f"{name}.counts", stats.counts[name].astype(np.float32)[:, None])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{args.out}: {len(stats.sums)} matrices, {len(ids)} tokens in {chunks} chunks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
