#!/usr/bin/env python3
"""Make a mid-size synthetic qwen3next GGUF (hybrid Gated-DeltaNet MoE, ~0.23B parameters) for
the decode and streaming benches.

What it makes (outside the repo; default /tmp/onebit-big/q3next-0.2b-Q8_0.gguf): a random
HF `Qwen3NextForCausalLM`, converted by llama.cpp's convert_hf_to_gguf.py (--no-mtp) at f32
and quantized by llama-quantize (default Q8_0; the f32 file is deleted after).

Shape (defaults): hidden 512, 8 layers with a full attention layer every 4th (layers 3 and 7;
the other 6 are Gated DeltaNet), attention 8 query heads x 64 (2 KV heads), DeltaNet 4 key
heads / 8 value heads x 64, conv kernel 4, 64 routed experts top-8 (moe_intermediate 256), a
shared expert of 256, vocab 4096 (make_big_moe's tokenizer recipe). 201M of its 0.23B
parameters are routed experts.

Weights: make_fixtures' init (norm weights N(0, 0.2) around 0 for Qwen3-Next's 1 + w norms,
the DeltaNet output norm around 1, router x ROUTER_GAIN), token embeddings N(0, 0.2) and the
residual branches' output projections x 1/sqrt(layers), as tools/make_big_moe.py does, so that
routing is spread over the experts rather than collapsed onto a few.

Usage: python tools/make_big_hybrid.py --llama-cpp /work/deps/llama_cpp_python-0.3.36
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402
from make_big_moe import EMBED_STD, TOKENIZER  # noqa: E402

SEED = 13


def shape(args) -> dict:
    return dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                num_key_value_heads=2, head_dim=64, num_experts=args.experts,
                num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_ff,
                shared_expert_intermediate_size=args.moe_ff, intermediate_size=4 * args.hidden,
                max_position_embeddings=8192, initializer_range=0.02, tie_word_embeddings=False,
                norm_topk_prob=True, rms_norm_eps=1e-6, full_attention_interval=4,
                linear_conv_kernel_dim=4, linear_key_head_dim=args.linear_head_dim,
                linear_value_head_dim=args.linear_head_dim,
                linear_num_key_heads=4, linear_num_value_heads=8,
                rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0, partial_rotary_factor=0.25))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, default=Path("/work/deps/llama_cpp_python-0.3.36"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/onebit-big/q3next-0.2b-Q8_0.gguf"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/onebit-big/work"))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-ff", type=int, default=256)
    ap.add_argument("--quant", default="Q8_0")
    ap.add_argument("--linear-head-dim", type=int, default=64, help="the DeltaNet heads' width (Qwen3-Next: 128)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import torch
    import transformers

    lc = mf.find_llama_cpp(args.llama_cpp.resolve())
    out, work = args.out.resolve(), args.work.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def step(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    tok_dir = work / "tokenizer"
    shutil.rmtree(tok_dir, ignore_errors=True)
    mf.train_bpe(TOKENIZER, mf.build_corpus(), tok_dir)
    config = transformers.Qwen3NextConfig(vocab_size=TOKENIZER.vocab_size, **mf.token_ids(TOKENIZER, tok_dir),
                                          **shape(args))
    model = mf.init_hf_model("Qwen3NextForCausalLM", config, SEED, norm_center=0.0)
    gain = 1.0 / args.layers ** 0.5
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, EMBED_STD)
        for name, p in model.named_parameters():
            if name.endswith(("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.experts.down_proj")):
                p.mul_(gain)
    n = sum(p.numel() for p in model.parameters())
    n_exp = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    step(f"HF model: {n / 1e9:.3f}B parameters ({n_exp / 1e6:.0f}M routed-expert)")
    hf_dir = work / "hf"
    shutil.rmtree(hf_dir, ignore_errors=True)
    shutil.copytree(tok_dir, hf_dir)
    model.save_pretrained(hf_dir, safe_serialization=True)
    del model
    f32 = work / "q3next-f32.gguf"
    mf.convert_to_gguf(lc, hf_dir, f32, TOKENIZER.pre, model_name="onebit-q3next-0.2b", extra=("--no-mtp",))
    step(f"converted {f32} ({f32.stat().st_size / 2**30:.2f} GiB)")
    mf.quantize_gguf(lc, f32, out, args.quant)
    f32.unlink()
    shutil.rmtree(hf_dir)
    step(f"quantized {out} ({out.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
