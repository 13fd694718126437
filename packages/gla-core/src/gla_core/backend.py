"""Which backend a call runs on, and whether Pallas TPU kernels run in interpret mode."""

from __future__ import annotations

import os

import jax

from gla_core import overrides
from gla_core.errors import InvalidArgumentError
from gla_core.records import BACKENDS

INTERPRET_ENV = "GLA_INTERPRET"


def backend() -> str:
    """The target backend: `gla_core.use(backend=...)` if set, else JAX's default backend."""
    chosen = overrides.current().backend
    if chosen is not None:
        return chosen
    name = jax.default_backend()
    return name if name in BACKENDS else "gpu" if name in ("cuda", "rocm") else name


def interpret_default() -> bool:
    """Interpret mode unless the call says otherwise: `use(interpret=...)`, then `GLA_INTERPRET`."""
    chosen = overrides.current().interpret
    if chosen is not None:
        return chosen
    raw = os.environ.get(INTERPRET_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise InvalidArgumentError(f"{INTERPRET_ENV}: expected 1/0/true/false, got {raw!r}")
