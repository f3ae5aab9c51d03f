"""Errors a user can cause. The CLI prints them as one line and exits with code 2."""


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
