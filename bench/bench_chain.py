"""Greedy decode with the device a step ahead (chain.GreedyChain) against plain steps, Vulkan.

In one process per file, two generations from the same 8-token random prompt through
`generate_step`, alternating round by round (the VM's speed drifts between minutes): plain
steps (a sampler the chain does not recognise: `forward` per token, the host's argmax) and
the chain (the sampler of `--temp 0`). Per round, `--tokens` tokens after the first two are
timed; the table gives medians over rounds: the time per token, tok/s, the fence waits per
token, and the host's time outside the fence waits as a share of the token's time (plain:
the host's part of a step; chained: the part of the host's work the device's queued step did
not cover).

    python bench/bench_chain.py [--tokens 64] [--rounds 12] FILE.gguf ...
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def measure(path: str, n_tokens: int, rounds: int) -> dict:
    import numpy as np

    import onebit
    from onebit.generate import generate_step
    from onebit.sample import make_sampler

    m = onebit.load(path, backend="vulkan")
    assert m.be.name == "vulkan", "Vulkan backend not in use"
    dev = m.be.dev
    prompt = np.random.default_rng(0).integers(1, m.cfg.vocab_size, 8).tolist()
    greedy = make_sampler(0.0, 1.0, 0.0, 0, None)
    samplers = {"plain": lambda logits: greedy(logits), "chained": greedy}
    got: dict = {k: {"token": [], "wait": [], "toks": None} for k in samplers}
    for r in range(rounds + 1):  # the first round records and warms up
        for name, sampler in samplers.items():
            cache = m.new_cache()
            gen = generate_step(m.net, prompt, cache, sampler)
            toks = [next(gen), next(gen)]
            w0, t0 = dev.wait_s, time.perf_counter()
            toks += [next(gen) for _ in range(n_tokens)]
            dt, waited = time.perf_counter() - t0, dev.wait_s - w0
            gen.close()
            if got[name]["toks"] is None:
                got[name]["toks"] = toks
            if r:
                got[name]["token"].append(dt / n_tokens)
                got[name]["wait"].append(waited / n_tokens)
    if got["plain"]["toks"] != got["chained"]["toks"]:
        raise SystemExit(f"{path}: the chain's tokens differ from plain steps'")
    out = {}
    for name, g in got.items():
        token, wait = statistics.median(g["token"]), statistics.median(g["wait"])
        host = statistics.median((t - w) / t for t, w in zip(g["token"], g["wait"]))
        out[name] = {"token": token, "wait": wait, "host": host}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--tokens", type=int, default=64, help="timed tokens per generation")
    ap.add_argument("--rounds", type=int, default=12)
    a = ap.parse_args()
    print(f"{'file':<28} {'mode':<8} {'us/token':>9} {'tok/s':>8} {'wait us':>8} {'host':>6} {'x plain':>8}")
    for f in a.files:
        res = measure(str(f), a.tokens, a.rounds)
        for name, r in res.items():
            ratio = res["plain"]["token"] / r["token"]
            print(f"{f.name[:28]:<28} {name:<8} {1e6 * r['token']:>9.0f} {1 / r['token']:>8.1f} "
                  f"{1e6 * r['wait']:>8.0f} {100 * r['host']:>5.1f}% {ratio:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
