"""Errors a user can cause. The CLI prints them as one line and exits with the class's `exit_code`:
2 for bad input (the default), 1 for a failure while running."""


class OnebitError(Exception):
    """Base class: a problem with the user's input, reported without a traceback."""

    exit_code = 2


class ModelFileError(OnebitError):
    """A GGUF file is unreadable, corrupt, truncated or inconsistent."""


class UnsupportedModelError(OnebitError):
    """A well-formed file that uses an architecture or tensor type onebit does not run."""


class TemplateError(OnebitError):
    """A chat template failed to render, raised, or tried to leave its sandbox."""


class UsageError(OnebitError):
    """Bad arguments to a command or API call."""


class BackendUnavailableError(OnebitError):
    """A backend cannot run here, or cannot run this model (the load falls to the next one)."""


class ModelFileChangedError(OnebitError):
    """The model file was truncated, rewritten or replaced while a model was using it."""

    exit_code = 1


class NonFiniteError(OnebitError):
    """A forward pass produced NaN or inf (corrupt weights, or values that overflow float32)."""

    exit_code = 1
