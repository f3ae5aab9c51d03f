"""Load time and memory of `onebit.load` on a GGUF file (the weights must stay memory-mapped).

Run in a fresh process per file: python bench/bench_load.py MODEL.gguf [MODEL2.gguf ...]
Prints one table row per file: size, load seconds, RSS growth at load, peak RSS after one
forward over 32 tokens, all as ratios of the file size.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time


def measure(path: str) -> None:
    import numpy as np
    import psutil

    import onebit
    import onebit.chat_formats.chat_template  # noqa: F401  (import the libraries first: their code is not the model's)
    import onebit.model  # noqa: F401
    import onebit.formats.tokenizer  # noqa: F401

    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    t0 = time.perf_counter()
    m = onebit.load(path)
    t_load = time.perf_counter() - t0
    rss1 = proc.memory_info().rss
    ids = np.arange(32) % m.cfg.vocab_size
    t0 = time.perf_counter()
    m.logits(ids)
    t_fwd = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    size = m.gguf.file_bytes
    print(f"{path}\t{size / 2**20:.2f}\t{t_load:.3f}\t{(rss1 - rss0) / 2**20:.2f}\t{(rss1 - rss0) / size:.3f}"
          f"\t{peak / 2**20:.1f}\t{t_fwd:.3f}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        measure(sys.argv[2])
        return
    print("file\tMiB\tload_s\tload_rss_MiB\tload_rss/size\tpeak_rss_MiB\tforward32_s")
    for path in sys.argv[1:]:
        subprocess.run([sys.executable, __file__, "--one", path], check=True)


if __name__ == "__main__":
    main()
