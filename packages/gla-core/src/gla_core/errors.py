"""Exceptions raised by gla.

Every exception derives from `GlaError` and from the builtin a caller would expect
(`ValueError` for bad shapes and values, `TypeError` for bad dtypes and unknown
arguments), so `except ValueError` keeps working for code that does not know gla.
Messages name the argument, what was expected and what was received.
"""

from __future__ import annotations


class GlaError(Exception):
    """Base class of every error raised by gla."""


class ShapeError(GlaError, ValueError):
    """An array argument has the wrong rank or a dimension that does not match."""


class DTypeError(GlaError, TypeError):
    """An array argument has a dtype the op does not accept."""


class InvalidArgumentError(GlaError, ValueError):
    """A non-array argument (scale, chunk_size, cu_seqlens values, flags) is invalid."""


class UnknownArgumentError(GlaError, TypeError):
    """A keyword argument that the op does not define was passed."""


class UnknownOpError(GlaError, ValueError):
    """`dispatch` was asked for an op that gla does not define."""


class UnknownImplementationError(GlaError, ValueError):
    """An implementation name was requested that is not registered for the op."""


class ImplementationDeclinedError(GlaError, ValueError):
    """An explicitly requested implementation cannot serve the call.

    `reason` holds the implementation's own explanation.
    """

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class NoImplementationError(GlaError, ValueError):
    """No registered implementation accepts the call on the current backend."""


class RegistrationError(GlaError, ValueError):
    """A plugin registered an invalid or conflicting implementation."""


class HigherOrderDerivativeError(GlaError, NotImplementedError):
    """A Pallas implementation's first-order backward was differentiated (second-order autodiff).

    The message names the implementation and what to use instead (`gla_core.pallas_transforms`).
    """


class PluginWarning(GlaError, UserWarning):
    """A plugin, or some of its implementations, could not be loaded (they are skipped)."""


def describe(value) -> str:
    """A short, readable rendering of a received value for error messages."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"array of shape {tuple(shape)} and dtype {dtype}"
    return repr(value)
