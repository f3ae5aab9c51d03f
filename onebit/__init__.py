"""onebit: run GGUF mixture-of-experts language models on unified-memory machines."""

from .errors import OnebitError

__version__ = "0.1.0"


def load(model=None, **overrides):
    """Open a GGUF model: a path or a LoadSpec, and LoadSpec fields as keywords; see `onebit.model.load`."""
    from .model import load as _load

    return _load(model, **overrides)


def __getattr__(name: str):
    if name in ("LoadSpec", "Model"):  # (imported when asked: `import onebit` stays light)
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module 'onebit' has no attribute {name!r}")


__all__ = ["load", "LoadSpec", "Model", "OnebitError", "__version__"]
