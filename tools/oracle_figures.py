#!/usr/bin/env python3
"""Print how onebit's logits agree with a fixture's oracles, per backend: the figures behind
tests/test_oracle.py's bars (which only assert them).

Usage: python tools/oracle_figures.py glm4moe-f32 glm4moe-Q8_0 [--backends numpy,cpu,vulkan]

Per file, backend and oracle (logits_hf: transformers; logits_llama: llama.cpp): the smallest
per-position cosine, the largest |diff|, and how many positions meet the bar (HF: cosine >=
0.99999 and max |diff| <= 1e-2; llama.cpp: cosine >= 0.999); for quantized files also numpy
with llama.cpp's activation rounding modelled (tests/llamacpp_numerics.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import onebit  # noqa: E402
from onebit.backends import BACKENDS  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-row cosine of two [positions, vocab] arrays, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="+", help="fixture file stems, e.g. glm4moe-f32")
    ap.add_argument("--backends", default="numpy,cpu,vulkan")
    ap.add_argument("--delta-chunk", type=int, default=None, metavar="ROWS",
                    help="Vulkan: the chunked delta rule for chunks of >= ROWS rows (0: never; default: the device's)")
    args = ap.parse_args()
    if "vulkan" in args.backends:
        from onebit.backends.vulkan.backend import VulkanBackend

        BACKENDS["vulkan"] = VulkanBackend  # lavapipe too (auto takes Vulkan only on a GPU)
    for name in args.names:
        ref = np.load(FIXTURES / f"{name}.ref.npz")
        tokens = ref["tokens"].astype(np.int64)
        for backend in args.backends.split(","):
            m = onebit.load(FIXTURES / f"{name}.gguf", backend=backend)
            if backend == "vulkan" and args.delta_chunk is not None:
                m.net.be.k.delta_chunk_min_rows = args.delta_chunk
            logits = m.net.forward(tokens, m.new_cache())
            m.close()
            for key in ("logits_hf", "logits_llama"):
                if key not in ref.files:
                    continue
                c, d = cosine(logits, ref[key]), np.abs(logits - ref[key]).max(axis=1)
                ok = (c >= 0.99999) & (d <= 1e-2) if key == "logits_hf" else c >= 0.999
                print(f"{name:16s} {backend:6s} vs {key[7:]:5s}: min cos {c.min():.7f}  max|d| {d.max():.2e}  "
                      f"positions in bar {ok.sum()}/{len(ok)}")
        if "logits_hf" not in ref.files:
            from llamacpp_numerics import LlamaCppRoundingBackend

            m = onebit.load(FIXTURES / f"{name}.gguf", backend="numpy")
            m.net.be = LlamaCppRoundingBackend(m.gguf)
            c = cosine(m.logits(tokens), ref["logits_llama"])
            print(f"{name:16s} numpy with llama.cpp's activation rounding vs llama: min cos {c.min():.7f}  "
                  f"positions in bar {(c >= 0.999).sum()}/{len(c)}")


if __name__ == "__main__":
    main()
