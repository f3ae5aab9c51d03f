"""What a GGUF model is, from its header alone: `onebit info`."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from ..config import ModelConfig
from ..chat_formats.chat_template import fallback_template
from ..formats.gguf_file import GGUFFile, is_expert_tensor


def model_info(g: GGUFFile, cfg: ModelConfig, cpu_target: dict | None = None) -> dict[str, Any]:
    """The model's header facts; `cpu_target`: what the cpu backend's kernels are compiled for
    here (its model and instruction sets), None where that backend cannot run."""
    by_type: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "params": 0})
    total = expert_params = 0
    for t in g.tensors.values():
        row = by_type[t.type_name]
        row["tensors"] += 1
        row["bytes"] += t.n_bytes
        row["params"] += t.n_elements
        total += t.n_elements
        if is_expert_tensor(t.name):
            expert_params += t.n_elements
    # Active per token: everything but the routed experts, plus k of E experts in each MoE layer.
    active = total - expert_params
    if cfg.n_experts:
        active += expert_params * cfg.n_experts_used // cfg.n_experts
    meta = g.metadata
    return {
        "file": g.path,
        "parts": len(g.paths),
        "file_bytes": g.file_bytes,
        "name": meta.get("general.name"),
        "architecture": cfg.arch,
        "parameters": total,
        "active_parameters": active,
        "layers": cfg.n_layers,
        "nextn_layers": cfg.n_nextn_layers,  # NextN / MTP layers in the file, not run nor counted above
        "nextn_bytes": sum(t.n_bytes for t in getattr(g, "set_aside", {}).values()),
        "dim": cfg.dim,
        "heads": cfg.n_heads,
        "kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "experts": cfg.n_experts,
        "experts_used": cfg.n_experts_used,
        "expert_hidden_dim": cfg.expert_hidden_dim,
        "shared_expert_hidden_dim": cfg.shared_expert_hidden_dim,
        "context_length": cfg.context_length,
        "vocab_size": cfg.vocab_size,
        "tokenizer": {
            "model": meta.get("tokenizer.ggml.model"),
            "pre": meta.get("tokenizer.ggml.pre"),
            "tokens": len(meta.get("tokenizer.ggml.tokens") or []),
        },
        "chat_template": "tokenizer.chat_template" in meta,
        "chat_template_fallback": fallback_template(meta.get("tokenizer.ggml.tokens"))[0],
        "types": dict(sorted(by_type.items(), key=lambda kv: -kv[1]["bytes"])),
        "cpu_target": cpu_target,
    }


def format_info(info: dict[str, Any]) -> str:
    def n(x: int) -> str:
        for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if x >= div:
                return f"{x / div:.2f}{unit}"
        return str(x)

    lines = [
        f"file            {info['file']}" + (f" ({info['parts']} parts)" if info["parts"] > 1 else ""),
        f"name            {info['name'] or '-'}",
        f"architecture    {info['architecture']}",
        f"parameters      {n(info['parameters'])} total, {n(info['active_parameters'])} active per token",
        f"layers          {info['layers']} (dim {info['dim']}, heads {info['heads']}/{info['kv_heads']} kv, "
        f"head dim {info['head_dim']})",
    ]
    if info.get("nextn_layers"):
        mib = info["nextn_bytes"] / 2**20
        lines.append(f"nextn layers    {info['nextn_layers']} (MTP, {mib:.2f} MiB: in the file, not run, not counted here)")
    if info["experts"]:
        shared = f", shared expert {info['shared_expert_hidden_dim']}" if info["shared_expert_hidden_dim"] else ""
        lines.append(f"experts         {info['experts']}, {info['experts_used']} used per token "
                     f"(width {info['expert_hidden_dim']}{shared})")
    tok = info["tokenizer"]
    lines += [
        f"context length  {info['context_length']}",
        f"tokenizer       {tok['model']}" + (f" (pre {tok['pre']})" if tok["pre"] else "") + f", {tok['tokens']} tokens",
        "chat template   " + ("yes" if info["chat_template"] else f"no ({info['chat_template_fallback']} fallback)"),
        f"size            {info['file_bytes'] / 2**20:.2f} MiB",
    ]
    if info.get("cpu_target"):
        target = info["cpu_target"]
        lines.append(f"cpu target      {target['cpu']}: {' '.join(target['isa'])}")
    lines += [
        "types:",
    ]
    for name, row in info["types"].items():
        lines.append(f"  {name:<8} {row['tensors']:>5} tensors  {row['bytes'] / 2**20:>10.2f} MiB  {n(row['params']):>8} params")
    return "\n".join(lines)
