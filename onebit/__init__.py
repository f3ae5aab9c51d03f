"""onebit: run GGUF mixture-of-experts language models on unified-memory machines."""

from .errors import OnebitError

__version__ = "0.1.0"


def load(path, backend: str = "auto", n_ctx=None, slots=None, budget=None, pool_policy: str = "global",
         predict=None, device=None):
    """Open a GGUF model; see `onebit.model.load`."""
    from .model import load as _load

    return _load(path, backend=backend, n_ctx=n_ctx, slots=slots, budget=budget, pool_policy=pool_policy,
                 predict=predict, device=device)


__all__ = ["load", "OnebitError", "__version__"]
