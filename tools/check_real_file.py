#!/usr/bin/env python3
"""Check onebit on a real GGUF file (one a user downloaded) against two independent
implementations: HF transformers on the file's own weights (dequantized by transformers'
GGUF loader) and llama.cpp on the same file. Not part of the test run (no real files in CI).

Two steps, because the references need the optional tooling (torch, transformers,
accelerate, a llama.cpp build from tools/build_llama_cpp.sh) and onebit's own environment
does not:

    python tools/check_real_file.py refs FILE.gguf --llama-cpp DIR [--tokens 200] [--out REFS.npz] [--f32-copy F32.gguf]
    python tools/check_real_file.py compare FILE.gguf REFS.npz [--backends numpy,cpu,vulkan]

`refs` (in the tooling's environment) writes the prompt's tokens (llama.cpp's tokenization of a
fixed mixed text, with BOS), teacher-forced logits from transformers and from llama.cpp, and
llama.cpp's ids for the tokenizer test strings of tools/make_fixtures.py. `compare` (in
onebit's environment) prints, per backend, cosine and max |diff| against each reference at the
bars of tests/test_oracle.py (transformers: cosine >= 0.99999 and max |diff| <= 1e-2; llama.cpp:
cosine >= 0.999), whether greedy (argmax) tokens agree, and whether onebit's tokenizer gives
llama.cpp's ids; the two references' agreement with each other is printed first, so a
difference that both onebit and transformers have from llama.cpp is seen to be llama.cpp's.
With `--f32-copy`, `refs` also writes a copy of the file with every tensor dequantized to f32
(by gguf-py) and runs llama.cpp on it: there llama.cpp multiplies in f32, without rounding its
activations to 8 bits as it does for quantized weights, and `compare` shows onebit (on the
quantized file) against that too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 256  # tools/make_fixtures.py's open_llama: a context of 256

TEXT = ("The quick brown fox jumps over the lazy dog. " * 3
        + "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
        + "In 1905, Albert Einstein published four papers that changed physics: on the photoelectric "
        + "effect, Brownian motion, special relativity and mass-energy equivalence. "
        + "Übersetzung: «le café» — 東京都 — 😀 1234567890 {\"key\": [1, 2.5, null]}\n") * 3


def f32_copy(src: Path, dst: Path) -> None:
    """src with every quantized tensor dequantized to f32 (gguf-py's dequantizers)."""
    import gguf

    sys.path.insert(0, str(ROOT / "tests"))
    from ggufedit import rewrite

    def dequantized(name, data, qtype):
        if qtype == gguf.GGMLQuantizationType.F32:
            return None
        return gguf.quants.dequantize(data, qtype).astype(np.float32), gguf.GGMLQuantizationType.F32

    rewrite(src, dst, tensor_fn=dequantized)


def refs(args) -> None:
    if not 1 <= args.tokens <= MAX_TOKENS:
        sys.exit(f"check_real_file: --tokens must be 1..{MAX_TOKENS} (the oracle's context)")
    sys.path.insert(0, str(ROOT / "tools"))
    import make_fixtures as mf

    path = Path(args.file).resolve()
    llama_cpp = mf.import_llama_cpp(mf.find_llama_cpp(Path(args.llama_cpp)))
    llm = mf.open_llama(llama_cpp, path)  # (the fixtures' oracle settings: f32 KV cache, no flash attention)
    tokens = np.array(mf.llama_tokenize(llm, TEXT, special=True)[: args.tokens], dtype=np.int64)
    extra = dict(logits_llama=mf.llama_logits(llm, tokens))
    cases = mf.tokenizer_cases(llm)
    del llm
    if args.f32_copy:
        f32_copy(path, Path(args.f32_copy))
        llm = mf.open_llama(llama_cpp, Path(args.f32_copy))
        extra["logits_llama_f32"] = mf.llama_logits(llm, tokens)
        del llm
    name = "llama.cpp only"
    if not args.no_transformers:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        model.eval()
        with torch.no_grad():
            extra["logits_hf"] = model(torch.tensor(tokens[None]), use_cache=False).logits[0].float().numpy()
        name = f"transformers {type(model).__name__}"
    out = Path(args.out or path.with_suffix(".refs.npz"))
    np.savez_compressed(out, tokens=tokens, **extra,
                        strings=np.array(mf.TOKENIZER_STRINGS, dtype=object),
                        ids_special=np.array(cases["special"], dtype=object),
                        ids_plain=np.array(cases["plain"], dtype=object))
    print(f"wrote {out}: {len(tokens)} tokens, {name}")


def compare(args) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
    import onebit
    from oracle_figures import cosine

    ref = np.load(args.refs, allow_pickle=True)
    tokens, ll = ref["tokens"], ref["logits_llama"]
    hf = ref["logits_hf"] if "logits_hf" in ref.files else None
    if hf is not None:
        c = cosine(hf, ll)
        print(f"{len(tokens)} positions; transformers vs llama.cpp: cosine median {np.median(c):.6f}, min "
              f"{c.min():.6f}, >= 0.999 at {(c >= 0.999).mean():.0%}, argmax agree {(hf.argmax(-1) == ll.argmax(-1)).mean():.0%}")
    backends = args.backends.split(",")
    for backend in backends:
        m = onebit.load(args.file, backend=backend)
        try:
            got = m.logits(tokens)
            if backend == backends[0]:  # (one tokenizer whatever the backend)
                bad = 0
                for mode, special in (("special", True), ("plain", False)):
                    for s, want in zip(ref["strings"], ref[f"ids_{mode}"]):
                        bad += m.tokenizer.encode(str(s), add_special=special, parse_special=special) != list(want)
                print(f"tokenizer: {bad} of {2 * len(ref['strings'])} strings differ from llama.cpp's ids")
        finally:
            m.close()
        if hf is not None:
            ch = cosine(got, hf)
            ok_hf = (ch >= 0.99999) & (np.abs(got - hf).max(-1) <= 1e-2)
            print(f"{backend:7} vs transformers: cosine median {np.median(ch):.7f}, min {ch.min():.7f}, max |diff| "
                  f"{np.abs(got - hf).max():.3g}, at the bar {ok_hf.mean():.0%}, argmax agree "
                  f"{(got.argmax(-1) == hf.argmax(-1)).mean():.0%}")
        cl = cosine(got, ll)
        differ = got.argmax(-1) != ll.argmax(-1)
        print(f"{backend:7} vs llama.cpp:    cosine median {np.median(cl):.6f}, min {cl.min():.6f}, >= 0.999 at "
              f"{(cl >= 0.999).mean():.0%}, argmax agree {1 - differ.mean():.0%}")
        if differ.any():  # a near tie in either engine's logits, or a real difference?
            top2 = np.sort(ll, axis=-1)[:, -2:]
            gap = (top2[:, 1] - top2[:, 0])
            print(f"{backend:7}   where argmax differs ({differ.sum()} positions), llama.cpp's top-two gap: median "
                  f"{np.median(gap[differ]):.3g} (everywhere: median {np.median(gap):.3g})")
        if "logits_llama_f32" in ref.files:
            lf = ref["logits_llama_f32"]
            cf = cosine(got, lf)
            print(f"{backend:7} vs llama.cpp on the f32 copy: cosine median {np.median(cf):.7f}, min {cf.min():.7f}, "
                  f"max |diff| {np.abs(got - lf).max():.3g}, argmax agree {(got.argmax(-1) == lf.argmax(-1)).mean():.0%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("refs", help="write the references (needs torch, transformers, accelerate, llama.cpp)")
    r.add_argument("file")
    r.add_argument("--llama-cpp", required=True, help="the directory tools/build_llama_cpp.sh built into")
    r.add_argument("--tokens", type=int, default=200)
    r.add_argument("--out", default=None)
    r.add_argument("--no-transformers", action="store_true",
                   help="llama.cpp's logits only (a file transformers cannot load, or too big to dequantize)")
    r.add_argument("--f32-copy", default=None, metavar="F32.gguf",
                   help="also write the file dequantized to f32 here and run llama.cpp on it")
    c = sub.add_parser("compare", help="onebit against the references")
    c.add_argument("file")
    c.add_argument("refs")
    c.add_argument("--backends", default="numpy,cpu,vulkan")
    args = ap.parse_args()
    refs(args) if args.cmd == "refs" else compare(args)


if __name__ == "__main__":
    main()
