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


def json_object(text: str | bytes, what: str, example: str = "", advice: str = "") -> dict:
    """The JSON object `text` holds, or one UsageError naming `what` (a flag, a file): `example`
    shows what to give, `advice` what else to do when it is not JSON at all."""
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise UsageError(f"{what} is not valid JSON ({e}){advice}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{what} must be a JSON object{example}")
    return value


class BackendUnavailableError(OnebitError):
    """A backend cannot run here, or cannot run this model (the load falls to the next one)."""


class ModelFileChangedError(OnebitError):
    """The model file was truncated, rewritten or replaced while a model was using it."""

    exit_code = 1


class NonFiniteError(OnebitError):
    """A forward pass produced NaN or inf (corrupt weights, or values that overflow float32)."""

    exit_code = 1
