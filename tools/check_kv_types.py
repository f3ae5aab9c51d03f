#!/usr/bin/env python3
"""onebit's quantized KV caches against llama.cpp's with the same cache types, on one GGUF file.
Not part of the test run (it needs llama.cpp). Two steps, as tools/check_real_file.py, because
llama.cpp's Python binding lives in the tooling's environment, not onebit's:

    python tools/check_kv_types.py refs FILE.gguf --llama-cpp DIR [--types f32,f16,q8_0,q4_0] [--tokens 200] --out REFS.npz
    python tools/check_kv_types.py compare FILE.gguf REFS.npz [--backends numpy,cpu]

`refs` (DIR: what tools/build_llama_cpp.sh built, or an extracted llama-cpp-python sdist with its
build) tokenizes check_real_file's fixed text (with BOS) and writes, for
each type T, llama.cpp's teacher-forced logits with `type_k = type_v = T` and flash attention on
(llama.cpp needs it for a quantized V cache; on for every type, so the types differ in their
cache only). `compare` (onebit's environment) loads the file with --cache-type-k/-v T on each
backend and prints, per type, cosine (min over positions), max |diff| and greedy (argmax)
agreement against llama.cpp with the same T, and against onebit's own f32 cache: the second
says what the cache type costs, the first whether onebit's costs it the way llama.cpp's does.

llama.cpp (this build) rotates Q, K and V by a Walsh-Hadamard matrix when a cache type is
quantized and the head width a multiple of 64 (llama-kv-cache.cpp, `attn_rot_k` / `attn_rot_v`),
and onebit's cache does the same (cache.hadamard_size); `refs --no-rotation` runs llama.cpp with
it off (its LLAMA_ATTN_ROT_DISABLE=1), which shows what the rotation changes there (onebit
against that reference is then not like for like). With flash attention on, llama.cpp casts an
f32 cache to f16 for the attention, so its f32 and f16 rows agree exactly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

GGML_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}  # ggml.h's enum ggml_type


def refs(args) -> None:
    import os

    import make_fixtures as mf
    from check_real_file import TEXT

    if args.no_rotation:
        os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"  # (read by llama.cpp when a context is made)

    llama_cpp = mf.import_llama_cpp(mf.find_llama_cpp(Path(args.llama_cpp).resolve()))

    out = {}
    tokens = None
    for t in args.types.split(","):
        llm = llama_cpp.Llama(model_path=args.file, n_ctx=args.tokens, n_batch=args.tokens, n_ubatch=args.tokens,
                              n_threads=2, n_gpu_layers=0, logits_all=True, flash_attn=True,
                              type_k=GGML_TYPE[t], type_v=GGML_TYPE[t], verbose=False)
        if tokens is None:
            tokens = np.array(llm.tokenize(TEXT.encode("utf-8"), add_bos=True, special=False)[: args.tokens], np.int64)
        out[f"llama_{t}"] = mf.llama_logits(llm, tokens)
        del llm
        print(f"llama.cpp {t}: {len(tokens)} positions", file=sys.stderr)
    np.savez(args.out, tokens=tokens, **out)


def figures(a: np.ndarray, b: np.ndarray) -> str:
    from oracle_figures import cosine

    cos = cosine(a, b)
    return (f"cos min {cos.min():.6f} median {np.median(cos):.6f} >=0.999 {int((cos >= 0.999).sum()):3d}/{len(a)}  "
            f"max|d| {np.abs(a - b).max():7.4f}  "
            f"argmax {int((a.argmax(-1) == b.argmax(-1)).sum())}/{len(a)}")


def logits(path: str, backend: str, t: str, tokens: np.ndarray) -> np.ndarray:
    import onebit

    with onebit.load(path, backend=backend, n_ctx=len(tokens), cache_type_k=t, cache_type_v=t) as m:
        cache = m.net.make_cache()
        return np.concatenate([m.net.forward(tokens[i : i + 64], cache) for i in range(0, len(tokens), 64)])


def compare(args) -> None:
    ref = np.load(args.refs)
    tokens = ref["tokens"]
    types = [k.removeprefix("llama_") for k in ref.files if k.startswith("llama_")]
    print(f"{Path(args.file).name}: {len(tokens)} positions, teacher-forced; llama.cpp with flash attention "
          f"({args.refs})")
    if "f32" in types:
        for t in types:
            if t != "f32":
                print(f"  llama.cpp {t:5s} vs llama.cpp f32   {figures(ref['llama_' + t], ref['llama_f32'])}")
    for backend in args.backends.split(","):
        own = {t: logits(args.file, backend, t, tokens) for t in types}
        for t in types:
            print(f"  {backend:5s} {t:5s} vs llama.cpp {t:5s}  {figures(own[t], ref['llama_' + t])}")
            if t != "f32" and "f32" in own:
                print(f"  {backend:5s} {t:5s} vs {backend} f32       {figures(own[t], own['f32'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("refs")
    r.add_argument("file")
    r.add_argument("--llama-cpp", required=True, help="the directory tools/build_llama_cpp.sh built into")
    r.add_argument("--types", default="f32,f16,q8_0,q4_0")
    r.add_argument("--tokens", type=int, default=200)
    r.add_argument("--no-rotation", action="store_true", help="llama.cpp's Hadamard rotation of a quantized "
                                                                "cache off (LLAMA_ATTN_ROT_DISABLE=1)")
    r.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("file")
    c.add_argument("refs")
    c.add_argument("--backends", default="numpy,cpu")
    args = ap.parse_args()
    refs(args) if args.cmd == "refs" else compare(args)


if __name__ == "__main__":
    main()
