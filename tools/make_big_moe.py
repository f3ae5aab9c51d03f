#!/usr/bin/env python3
"""Make a larger synthetic qwen3moe GGUF (about 0.86B parameters, Q4_K_M) for streaming benches.

What it makes (outside the repo; default /work/deps/big/q3moe-0.9b-Q4_K_M.gguf):
  a random-initialised HF `Qwen3MoeForCausalLM` (no training: its text is noise, its routing
  is not uniform), converted by llama.cpp's own convert_hf_to_gguf.py at f32 and quantized to
  Q4_K_M by llama-quantize. The f32 GGUF is deleted after quantizing (add --keep-f32 to keep).

Shape (defaults; see --help): hidden 1024, 16 layers, 16 query heads x 64 (4 KV heads),
64 routed experts per layer, top-8, moe_intermediate 256, vocab 4096 (a byte-level BPE
tokenizer with qwen2 pre-tokenization, trained here on stdlib docstrings), untied output,
max_position_embeddings 8192. Parameter count: 16 x (64 x 3 x 1024 x 256 expert weights
= 50.3M, attention 2.6M, router 65.5K) + 2 x 4096 x 1024 embeddings + norms = 0.856B, of
which 805M are routed-expert weights. moe_intermediate is 256 (not 512-768) so that 16
layers x 64 experts lands near 0.9B total while every matmul row length stays a multiple of
256 (the K-quant block size), so llama-quantize keeps its normal Q4_K_M mix.

Weights: transformers' own init (N(0, initializer_range=0.02)), then the same changes as
tools/make_fixtures.py's init_hf_model (imported, not copied): norm weights 1 + N(0, 0.2),
biases N(0, 0.1) (qwen3moe has none), router weights (mlp.gate) x ROUTER_GAIN = 3 (router
logits of std ~2 per token, top-8 holding ~75% of the router probability, not uniform
noise). Two more changes, so that routing looks like a trained model's (balanced use of the
experts, some reuse from token to token) instead of collapsing onto a few experts:
  - token embeddings N(0, EMBED_STD = 0.2) instead of N(0, 0.02);
  - the residual branches' output projections (self_attn.o_proj, mlp.experts.down_proj)
    x 1/sqrt(n_layers) = 0.25 (GPT-2-style residual scaling).
Why: with HF's plain init the embeddings are ~20x smaller than what each block adds to the
residual stream, so from a few layers on the residual is mostly a component shared by every
token and the deeper layers send nearly every token to the same ~20 of 64 experts. A first
build with the plain init touched only 242 of its 1024 experts in 63 greedy decode tokens,
and `onebit cache-sim` gave ~99% hit rate even for a pool of 25% of the experts. With the
two changes, on 192 teacher-forced tokens of stdlib docstrings: 47-64 distinct experts per
layer in 64 tokens, normalised usage entropy 0.83-0.99, and the share of a token's top-8
also used by the previous token rising from 0.12 (chance: 8/64) in the first layers to
0.25-0.35 in the last ones. The script prints and
saves (<out>.json) these routing statistics for the model it made. No seed search for
router margins (make_fixtures does one for its oracles; nothing here compares logits across
implementations); near-ties exist, which does not matter for streamed-vs-resident checks on
one backend.

Memory: the float32 HF model is ~3.4 GB in RAM, saved as safetensors (~3.4 GB on disk in
--work); the converter streams it into a ~3.4 GB f32 GGUF; llama-quantize writes ~0.5 GB.
Measured peak RSS of the whole run: 5.6 GiB.

Needs the optional tooling (torch, transformers, tokenizers) and a llama.cpp build
(tools/build_llama_cpp.sh). Usage:
  python tools/make_big_moe.py --llama-cpp /work/deps/llama_cpp_python-0.3.36
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402  (tokenizers, HF init, llama.cpp conversion helpers)

DEFAULT_OUT = Path("/work/deps/big/q3moe-0.9b-Q4_K_M.gguf")
DEFAULT_WORK = Path("/work/deps/big/work")
SEED = 9
EMBED_STD = 0.2

TOKENIZER = mf.TokenizerSpec("bpe", 4096, pre="qwen2", bos="<|endoftext|>", eos="<|im_end|>",
                             pad="<|endoftext|>")


def shape(args) -> dict:
    return dict(hidden_size=args.hidden, num_hidden_layers=args.layers,
                num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                num_experts=args.experts, num_experts_per_tok=args.top_k,
                moe_intermediate_size=args.moe_ff, intermediate_size=4 * args.hidden,
                max_position_embeddings=8192, initializer_range=0.02,
                tie_word_embeddings=False, norm_topk_prob=True, rms_norm_eps=1e-6,
                rope_theta=1_000_000.0)


def routing_text() -> str:
    """Some stdlib docstrings (make_fixtures' tokenizer corpus, lines 200-260)."""
    return " ".join(mf.build_corpus()[200:260])


def routing_stats(model, ids: list[int], k: int) -> dict:
    """How the HF model routes `ids` (teacher-forced): per layer, the distinct experts in the
    first 64 tokens, the entropy of expert use (normalised to 1 = all equally used), and the
    share of a token's top-k also in the previous token's; plus the mean top-k probability
    mass and the smallest k-th vs (k+1)-th router logit margin."""
    import math

    import torch

    with torch.no_grad():
        res = model(torch.tensor([ids]), output_router_logits=True)
    logits = torch.stack(res.router_logits).float()            # [layers, T, experts]
    n_exp = logits.shape[-1]
    top = logits.topk(k, -1).indices
    ranked = logits.sort(-1, descending=True).values
    distinct, entropy, overlap = [], [], []
    for t in top:
        distinct.append(len(set(t[:64].flatten().tolist())))
        p = torch.bincount(t.flatten(), minlength=n_exp).float()
        p = p[p > 0] / p.sum()
        entropy.append(round(float(-(p * p.log()).sum()) / math.log(n_exp), 3))
        rows = [set(r) for r in t.tolist()]
        overlap.append(round(sum(len(a & b) for a, b in zip(rows, rows[1:]))
                             / (k * (len(rows) - 1)), 3))
    return dict(tokens=len(ids), topk_mass_mean=round(float(
                    logits.softmax(-1).topk(k, -1).values.sum(-1).mean()), 3),
                uniform_topk_mass=k / n_exp, chance_overlap=k / n_exp,
                router_logit_std=round(float(logits.std()), 3),
                min_margin=float((ranked[..., k - 1] - ranked[..., k]).min()),
                distinct_in_64_tokens=distinct, usage_entropy=entropy,
                prev_token_overlap=overlap)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, default=Path("/work/deps/llama_cpp_python-0.3.36"),
                    help="tools/build_llama_cpp.sh output dir (or the extracted sdist)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK,
                    help="scratch dir for the tokenizer, HF model and f32 GGUF")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-ff", type=int, default=256)
    ap.add_argument("--quant", default="Q4_K_M")
    ap.add_argument("--keep-f32", action="store_true", help="keep the f32 GGUF")
    args = ap.parse_args()
    # torch and ggml each bring an OpenMP runtime; passive waits stop them starving each other.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import torch
    import transformers

    lc = mf.find_llama_cpp(args.llama_cpp.resolve())
    out: Path = args.out.resolve()
    work: Path = args.work.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def step(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    # 1. Tokenizer (byte-level BPE, qwen2 pre-tokenizer, ChatML specials last).
    tok_dir = work / "tokenizer"
    shutil.rmtree(tok_dir, ignore_errors=True)
    mf.train_bpe(TOKENIZER, mf.build_corpus(), tok_dir)
    step(f"tokenizer: bpe vocab {TOKENIZER.vocab_size} pre {TOKENIZER.pre}")

    # 2. Random-init HF model (float32), saved as safetensors next to the tokenizer.
    config = transformers.Qwen3MoeConfig(vocab_size=TOKENIZER.vocab_size,
                                         **mf.token_ids(TOKENIZER, tok_dir), **shape(args))
    model = mf.init_hf_model("Qwen3MoeForCausalLM", config, SEED)
    out_gain = 1.0 / args.layers ** 0.5
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, EMBED_STD)
        for name, p in model.named_parameters():
            if name.endswith(("self_attn.o_proj.weight", "mlp.experts.down_proj")):
                p.mul_(out_gain)
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    step(f"HF model: {n_params / 1e9:.3f}B parameters ({n_expert / 1e6:.0f}M routed-expert)")
    routing = routing_stats(model, mf.hf_encode(tok_dir, routing_text())[:192], args.top_k)
    step("routing on 192 tokens of docstrings: " + json.dumps(
        {k: v for k, v in routing.items() if not isinstance(v, list)}))
    for key in ("distinct_in_64_tokens", "usage_entropy", "prev_token_overlap"):
        step(f"  per layer {key}: {routing[key]}")

    hf_dir = work / "hf"
    shutil.rmtree(hf_dir, ignore_errors=True)
    shutil.copytree(tok_dir, hf_dir)
    model.save_pretrained(hf_dir, safe_serialization=True)
    del model
    step(f"saved {hf_dir}")

    # 3. f32 GGUF by llama.cpp's converter, then llama-quantize; drop the f32 file.
    f32 = work / "q3moe-0.9b-f32.gguf"
    mf.convert_to_gguf(lc, hf_dir, f32, TOKENIZER.pre, model_name="onebit-q3moe-0.9b")
    step(f"converted {f32} ({f32.stat().st_size / 2**30:.2f} GiB)")
    mf.quantize_gguf(lc, f32, out, args.quant)
    step(f"quantized {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    if not args.keep_f32:
        f32.unlink()
        shutil.rmtree(hf_dir)   # the safetensors are as big as the f32 GGUF
    types = mf.tensor_types(out)
    by_type: dict[str, int] = {}
    for t in types.values():
        by_type[t] = by_type.get(t, 0) + 1
    facts = dict(file=str(out), bytes=out.stat().st_size, params=n_params,
                 expert_params=n_expert, seed=SEED, quant=args.quant,
                 init=dict(initializer_range=0.02, router_gain=mf.ROUTER_GAIN,
                           embed_std=EMBED_STD, out_proj_gain=out_gain),
                 config=dict(vocab_size=config.vocab_size, **shape(args)),
                 routing=routing, tensor_types=by_type,
                 expert_tensor_types={n: t for n, t in types.items() if "_exps" in n})
    (out.parent / (out.stem + ".json")).write_text(json.dumps(facts, indent=1) + "\n")
    step(f"done; tensor types {by_type}")


if __name__ == "__main__":
    main()
