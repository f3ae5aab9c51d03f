"""Decode and prompt speed of onebit against llama.cpp on the same GGUF, in one run.

    python bench/bench_vs_llamacpp.py MODEL.gguf [MODEL2.gguf ...] [--llama-cpp DIR] [--runs 3]
                                      [--backend auto|cpu|numpy|vulkan]

llama.cpp comes from tools/build_llama_cpp.sh (its Python binding over the built library;
CPU backend, 2 threads). Runs alternate onebit / llama.cpp (ABAB...) and the table gives
medians and the ratio onebit / llama.cpp. Greedy decoding of the same prompt tokens.

"GB/s" is weight bytes read per decode token (every non-expert matrix, one embedding row,
and the k routed experts of each MoE layer) times onebit's decode tok/s, printed beside the
machine's memory read bandwidth (a 2-thread sum over 1 GiB, measured in the same run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import onebit


def llama_binding(root: Path):
    lib = next(iter(sorted(root.rglob("libllama.so"))), None)
    if lib is None:
        sys.exit(f"no libllama.so under {root}: run tools/build_llama_cpp.sh {root}")
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib.parent)
    sdist = next(iter(sorted(root.rglob("llama_cpp/__init__.py"))), None)
    if sdist is None:
        sys.exit(f"no llama_cpp Python binding under {root}")
    sys.path.insert(0, str(sdist.parent.parent))
    try:
        import diskcache  # noqa: F401
    except ImportError:  # only the binding's optional disk prompt cache uses it
        import types

        sys.modules["diskcache"] = types.SimpleNamespace(Cache=object)
    import llama_cpp

    # llama.cpp's CPU weight repacking uses AMX where the CPU has it; this sandbox does not
    # grant AMX state and the process dies, so repacking is off (as in tools/make_fixtures.py).
    low = llama_cpp.llama_cpp
    default_params = low.llama_model_default_params

    def params_without_repack():
        p = default_params()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params_without_repack
    return llama_cpp


def decode_bytes(model) -> int:
    """Weight bytes one decode token reads: all but routed experts and the embedding table,
    plus one embedding row and, per MoE layer, k of its E experts."""
    from onebit.formats.gguf_file import is_expert_tensor

    total = 0
    k, E = model.cfg.n_experts_used, max(model.cfg.n_experts, 1)
    for name, t in model.gguf.tensors.items():
        if name == "token_embd.weight":
            total += t.n_bytes // t.shape[0]
        elif is_expert_tensor(name):
            total += t.n_bytes * k // E
        else:
            total += t.n_bytes
    return total


def memory_bandwidth(threads: int = 2) -> float:
    """Read bandwidth in GB/s: median of 3 parallel sums over 1 GiB."""
    import numba
    from numba import njit, prange

    @njit(parallel=True)
    def total(a):
        s = 0
        for i in prange(a.shape[0]):
            s += a[i]
        return s

    numba.set_num_threads(threads)
    a = np.ones(1 << 27, np.int64)  # 1 GiB
    total(a)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        total(a)
        times.append(time.perf_counter() - t0)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    return a.nbytes / statistics.median(times) / 1e9


def time_onebit(model, prompt, n):
    cache = model.new_cache()
    t0 = time.perf_counter()
    logits = model.net.forward(np.asarray(prompt), cache, last_only=True)
    pp = len(prompt) / (time.perf_counter() - t0)
    tok = int(logits[-1].argmax())
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(model.net.forward(np.array([tok]), cache, last_only=True)[-1].argmax())
    return pp, n / (time.perf_counter() - t0)


def time_llama(llm, prompt, n):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    pp = len(prompt) / (time.perf_counter() - t0)
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t0 = time.perf_counter()
    for _ in range(n):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return pp, n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--llama-cpp", default=".llama-cpp", type=Path)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()
    llama_cpp = llama_binding(args.llama_cpp)
    from onebit.backends import describe

    bw = memory_bandwidth()
    print(f"{'model':<26} {'onebit pp':>10} {'llama pp':>10} {'ratio':>6} {'onebit tg':>10} {'llama tg':>10} "
          f"{'ratio':>6} {'MB/tok':>7} {'GB/s':>6}")
    backend = None
    for path in args.models:
        ob = onebit.load(path, n_ctx=512, backend=args.backend)
        backend = f"{ob.be.name} ({describe(ob.be)})"
        prompt = (ob.tokenize("The json module encodes and decodes JSON. ", add_special=False) * 64)[: args.prompt_tokens]
        llm = llama_cpp.Llama(path, n_ctx=512, n_threads=2, n_batch=512, logits_all=True, verbose=False)
        time_onebit(ob, prompt[:8], 2)  # warm-up, not timed: kernels load from numba's cache on first use
        time_llama(llm, prompt[:8], 2)
        a_pp, a_tg, b_pp, b_tg = [], [], [], []
        for _ in range(args.runs):
            pp, tg = time_onebit(ob, prompt, args.gen_tokens)
            a_pp.append(pp)
            a_tg.append(tg)
            pp, tg = time_llama(llm, prompt, args.gen_tokens)
            b_pp.append(pp)
            b_tg.append(tg)
        m = statistics.median
        mb = decode_bytes(ob) / 1e6
        print(f"{Path(path).name:<26} {m(a_pp):>10.1f} {m(b_pp):>10.1f} {m(a_pp) / m(b_pp):>6.2f} "
              f"{m(a_tg):>10.1f} {m(b_tg):>10.1f} {m(a_tg) / m(b_tg):>6.2f} {mb:>7.1f} {mb * m(a_tg) / 1e3:>6.2f}",
              flush=True)
    print(f"tok/s, medians of {args.runs} alternating runs ({args.prompt_tokens}-token prompt, {args.gen_tokens} "
          f"decode tokens); ratio = onebit / llama.cpp (CPU backend, 2 threads, weight repacking off); onebit "
          f"backend {backend}. MB/tok: weight bytes a decode token reads; GB/s: that x onebit's decode tok/s, "
          f"against {bw:.1f} GB/s measured memory read bandwidth (2 threads).")


if __name__ == "__main__":
    main()
