"""Architectures, one file each, found by GGUF `general.architecture` name."""

from __future__ import annotations

import importlib

from ..errors import UnsupportedModelError

# GGUF architecture name -> module under onebit.models
ARCHITECTURES = {
    "qwen3moe": "qwen3moe",
    "qwen2moe": "qwen2moe",
    "olmoe": "olmoe",
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "gpt-oss": "gpt_oss",
    "glm4moe": "glm4moe",
    "qwen3next": "qwen3next",
    "qwen35moe": "qwen35moe",
}


def network_class(arch: str, source: str):
    """The network class (a `TransformerLM`) of GGUF architecture `arch`; `source` names the file in errors."""
    module = ARCHITECTURES.get(arch)
    if module is None:
        raise UnsupportedModelError(
            f"{source}: architecture {arch!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return importlib.import_module(f"{__name__}.{module}").Network
