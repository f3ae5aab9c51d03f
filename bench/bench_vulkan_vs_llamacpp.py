"""Decode and prompt speed of onebit's Vulkan backend against llama.cpp's Vulkan backend on the
same GGUF and the same device, in one run (issue 3, "Benchmarks").

    python bench/bench_vulkan_vs_llamacpp.py MODEL.gguf [MODEL2.gguf ...] \\
        --llama-vk DIR --llama-py DIR [--llama-cpu DIR] [--runs 3] [--gen-tokens 16]

--llama-vk   a llama.cpp build with -DGGML_VULKAN=ON and -DBUILD_SHARED_LIBS=ON (the build
             folder or the folder holding its libllama.so; searched recursively).
--llama-py   the llama-cpp-python source tree (the folder that holds `llama_cpp/`), whose
             ctypes binding drives the library named by LLAMA_CPP_LIB_PATH.
--llama-cpu  optional: a CPU-only llama.cpp shared build, for a third column (n_threads=2).

Every llama.cpp library runs in its own worker subprocess (the binding loads one libllama per
process): the model is loaded once per worker and the workers are driven over a pipe, so runs
alternate onebit / llama.cpp Vulkan [/ llama.cpp CPU] (ABAB...) inside one invocation. The
Vulkan worker gets GGML_VK_VISIBLE_DEVICES=0 (ggml-vulkan skips CPU-type devices such as
lavapipe unless they are listed) and n_gpu_layers=-1. Both sides do the same work: the same
prompt token ids in one batch (prompt tok/s), then greedy decode of N tokens one at a time,
each step computing only the last position's logits and taking the argmax on the host (decode
tok/s). One warm-up run per engine is not counted (pipeline compilation). The table gives
medians and ratios onebit / llama.cpp, and whether the greedy tokens agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RESULT = "@@RESULT "


# -- llama.cpp worker (runs in a subprocess) ----------------------------------------------


def _worker(args) -> None:
    os.environ["LLAMA_CPP_LIB_PATH"] = args.lib
    sys.path.insert(0, args.llama_py)
    import llama_cpp

    low = llama_cpp.llama_cpp
    default_params = low.llama_model_default_params

    # llama.cpp's CPU weight repacking uses AMX where the CPU has it; this sandbox does not
    # grant AMX state and the process dies, so repacking is off (as in bench_vs_llamacpp.py).
    def params_without_repack():
        p = default_params()
        if hasattr(p, "use_extra_bufts"):
            p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params_without_repack
    llm = llama_cpp.Llama(args.model, n_ctx=args.n_ctx, n_batch=args.n_ctx, n_threads=args.threads,
                          n_threads_batch=args.threads, n_gpu_layers=args.gpu_layers,
                          logits_all=False, verbose=True)
    n_vocab = llm.n_vocab()

    def last_logits():
        ptr = low.llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,))

    print(RESULT + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        prompt, n = req["prompt"], req["n"]
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        tok = int(last_logits().argmax())
        pp_s = time.perf_counter() - t0
        toks = [tok]
        t0 = time.perf_counter()
        for _ in range(n):
            llm.eval([tok])
            tok = int(last_logits().argmax())
            toks.append(tok)
        tg_s = time.perf_counter() - t0
        print(RESULT + json.dumps({"pp": len(prompt) / pp_s, "tg": n / tg_s, "tokens": toks}), flush=True)


class LlamaWorker:
    def __init__(self, label, lib_dir: Path, llama_py: Path, model: str, n_ctx: int, threads: int,
                 gpu_layers: int, env_extra: dict, log_path: Path):
        self.label = label
        env = dict(os.environ, **env_extra)
        self.log_path = log_path
        self.log = open(log_path, "w")
        cmd = [sys.executable, __file__, "--_worker", "--lib", str(lib_dir), "--llama-py", str(llama_py),
               "--model", model, "--n-ctx", str(n_ctx), "--threads", str(threads),
               "--gpu-layers", str(gpu_layers)]
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                  text=True, env=env)
        self._read()

    def _read(self):
        for line in self.p.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
        self.log.flush()
        sys.exit(f"llama.cpp worker '{self.label}' died; its log: {self.log_path}\n"
                 + self.log_path.read_text()[-3000:])

    def run(self, prompt, n):
        self.p.stdin.write(json.dumps({"prompt": list(map(int, prompt)), "n": n}) + "\n")
        self.p.stdin.flush()
        return self._read()

    def device_lines(self):
        keep = ("ggml_vulkan: 0", "offloaded", "using device", "Vulkan0 model buffer", "CPU_Mapped model buffer")
        text = self.log_path.read_text(errors="replace")
        return [ln.strip() for ln in text.splitlines() if any(k in ln for k in keep)]

    def close(self):
        try:
            self.p.stdin.close()
            self.p.wait(timeout=60)
        except Exception:
            self.p.kill()
        self.log.close()


# -- onebit -------------------------------------------------------------------------------


def run_onebit(model, prompt, n):
    cache = model.new_cache()
    t0 = time.perf_counter()
    logits = model.net.forward(np.asarray(prompt), cache, last_only=True)
    tok = int(logits[-1].argmax())
    pp_s = time.perf_counter() - t0
    toks = [tok]
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(model.net.forward(np.array([tok]), cache, last_only=True)[-1].argmax())
        toks.append(tok)
    tg_s = time.perf_counter() - t0
    return {"pp": len(prompt) / pp_s, "tg": n / tg_s, "tokens": toks}


def find_lib(root: Path, what: str) -> Path:
    if not root.exists():
        sys.exit(f"{what}: {root} does not exist")
    libs = sorted(root.rglob("libllama.so"))
    if not libs:
        sys.exit(f"{what}: no libllama.so under {root} (a -DBUILD_SHARED_LIBS=ON build is needed)")
    return libs[0].parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*")
    ap.add_argument("--llama-vk", type=Path, help="llama.cpp Vulkan shared build (folder holding libllama.so)")
    ap.add_argument("--llama-py", type=Path, help="llama-cpp-python source tree (holds llama_cpp/)")
    ap.add_argument("--llama-cpu", type=Path, default=None, help="optional CPU-only llama.cpp shared build")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--vk-threads", type=int, default=2, help="n_threads of the llama.cpp Vulkan worker (host side)")
    ap.add_argument("--cpu-threads", type=int, default=2, help="n_threads of the llama.cpp CPU worker")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/bench_vulkan_vs_llamacpp"))
    # worker mode (internal)
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lib", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--gpu-layers", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        args.llama_py = str(args.llama_py)
        return _worker(args)

    if not args.models:
        ap.error("give at least one GGUF file")
    if args.llama_vk is None or args.llama_py is None:
        ap.error("--llama-vk and --llama-py are required (no default paths are assumed)")
    if not (args.llama_py / "llama_cpp" / "__init__.py").exists():
        sys.exit(f"--llama-py: no llama_cpp/__init__.py under {args.llama_py}")
    vk_lib = find_lib(args.llama_vk, "--llama-vk")
    cpu_lib = find_lib(args.llama_cpu, "--llama-cpu") if args.llama_cpu else None
    args.log_dir.mkdir(parents=True, exist_ok=True)

    import onebit

    print(f"llama.cpp Vulkan lib: {vk_lib}")
    if cpu_lib:
        print(f"llama.cpp CPU lib:    {cpu_lib}")
    print(f"prompt {args.prompt_tokens} tokens, decode {args.gen_tokens} tokens, {args.runs} runs "
          f"(+{args.warmup} warm-up), alternating; llama.cpp threads: vk worker {args.vk_threads}, "
          f"cpu worker {args.cpu_threads}; {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")

    rows = []
    for path in args.models:
        name = Path(path).name
        ob = onebit.load(path, backend="vulkan", n_ctx=args.n_ctx)
        dev = getattr(getattr(ob.net, "be", None), "dev", None)
        ob_dev = dev.info.name if dev is not None else "?"
        text = "The json module encodes and decodes JSON. "
        prompt = (ob.tokenize(text, add_special=False) * 256)[: args.prompt_tokens]
        stem = name.replace(".gguf", "")
        workers = [("llama.cpp vk", LlamaWorker("vulkan", vk_lib, args.llama_py, path, args.n_ctx, args.vk_threads,
                                                 -1, {"GGML_VK_VISIBLE_DEVICES": "0"},
                                                 args.log_dir / f"{stem}-vk.log"))]
        if cpu_lib:
            workers.append(("llama.cpp cpu", LlamaWorker("cpu", cpu_lib, args.llama_py, path, args.n_ctx,
                                                          args.cpu_threads, 0, {}, args.log_dir / f"{stem}-cpu.log")))
        engines = [("onebit vk", lambda: run_onebit(ob, prompt, args.gen_tokens))]
        engines += [(lbl, (lambda w=w: w.run(prompt, args.gen_tokens))) for lbl, w in workers]
        res = {lbl: [] for lbl, _ in engines}
        for i in range(args.warmup + args.runs):
            for lbl, fn in engines:  # A B [C] A B [C] ...
                r = fn()
                if i >= args.warmup:
                    res[lbl].append(r)
        print(f"\n{name}: onebit device: {ob_dev}")
        for lbl, w in workers:
            for ln in w.device_lines():
                print(f"  [{lbl}] {ln}")
            w.close()
        m = statistics.median
        row = {"model": name}
        for lbl in res:
            row[lbl] = (m(r["pp"] for r in res[lbl]), m(r["tg"] for r in res[lbl]),
                        [round(r["tg"], 1) for r in res[lbl]])
        ref = res["onebit vk"][-1]["tokens"]
        row["agree"] = {lbl: res[lbl][-1]["tokens"] == ref for lbl in res if lbl != "onebit vk"}
        rows.append(row)
        for lbl in res:
            print(f"  {lbl:<14} decode runs tok/s: {row[lbl][2]}")
        print(f"  greedy tokens (onebit): {ref}")
        for lbl, ok in row["agree"].items():
            print(f"  greedy tokens agree with {lbl}: {ok}" + ("" if ok else f" -> {res[lbl][-1]['tokens']}"))
        del ob

    cols = ["onebit vk", "llama.cpp vk"] + (["llama.cpp cpu"] if cpu_lib else [])
    head = ["model"]
    for kind, idx in (("decode", 1), ("prompt", 0)):
        head += [f"{c} {kind}" for c in cols] + [f"ratio {kind} ob/vk"] + ([f"ratio {kind} ob/cpu"] if cpu_lib else [])
    print("\n| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        cells = [f"`{row['model']}`"]
        for idx in (1, 0):
            cells += [f"{row[c][idx]:.1f}" for c in cols]
            cells.append(f"{row['onebit vk'][idx] / row['llama.cpp vk'][idx]:.2f}")
            if cpu_lib:
                cells.append(f"{row['onebit vk'][idx] / row['llama.cpp cpu'][idx]:.2f}")
        print("| " + " | ".join(cells) + " |")
    print(f"\ntok/s, medians of {args.runs} alternating runs (after {args.warmup} warm-up); decode = "
          f"{args.gen_tokens} greedy tokens one at a time after a {args.prompt_tokens}-token prompt; "
          f"prompt = the prompt in one batch; ratio = onebit Vulkan / llama.cpp.")


if __name__ == "__main__":
    main()
