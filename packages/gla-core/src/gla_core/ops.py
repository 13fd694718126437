"""The signature of every op: positional arrays and keyword arguments with defaults.

Keyword names follow flash-linear-attention. Validation fills in every keyword, so an
implementation's `fn` always receives the complete set listed here (plus `interpret`),
with `scale` resolved to a float, `chunk_size` to an int and `cu_seqlens` to int32.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

DEFAULT_CHUNK_SIZE = 64
CHUNK_SIZES = (16, 32, 64, 128)


@dataclasses.dataclass(frozen=True)
class OpSignature:
    """Positional array names and keyword defaults of one op."""

    name: str
    arrays: tuple[str, ...]
    keywords: MappingProxyType
    summary: str

    def keyword_names(self) -> tuple[str, ...]:
        return tuple(self.keywords)


def _signature(name: str, arrays: tuple[str, ...], summary: str, **keywords: Any) -> OpSignature:
    return OpSignature(name, arrays, MappingProxyType(dict(keywords)), summary)


_ATTENTION_COMMON = dict(
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    chunk_size=DEFAULT_CHUNK_SIZE,
)

SIGNATURES: MappingProxyType = MappingProxyType(
    {
        "simple_gla": _signature(
            "simple_gla",
            ("q", "k", "v"),
            "gated linear attention with a scalar decay per head and step (g [B,T,H], g_gamma [H])",
            g=None,
            g_gamma=None,
            **_ATTENTION_COMMON,
        ),
        "gla": _signature(
            "gla",
            ("q", "k", "v"),
            "gated linear attention with a per-key decay gk [B,T,H,K]",
            gk=None,
            **_ATTENTION_COMMON,
        ),
        "kda": _signature(
            "kda",
            ("q", "k", "v"),
            "Kimi Delta Attention: delta rule with per-key decay g [B,T,HV,K] and beta [B,T,HV]",
            g=None,
            beta=None,
            **_ATTENTION_COMMON,
            use_qk_l2norm_in_kernel=False,
            use_gate_in_kernel=False,
            A_log=None,
            dt_bias=None,
            lower_bound=None,
            use_beta_sigmoid_in_kernel=False,
        ),
        "kda_gate": _signature(
            "kda_gate",
            ("g",),
            "KDA log decay -exp(A_log)*softplus(g+dt_bias), or lower_bound*sigmoid(exp(A_log)*(g+dt_bias))",
            A_log=None,
            dt_bias=None,
            lower_bound=None,
            output_dtype=None,
        ),
    }
)

# Array-valued keywords per op: validated as arrays, passed through unchanged.
ARRAY_KEYWORDS = {
    "simple_gla": ("g", "g_gamma", "initial_state", "cu_seqlens"),
    "gla": ("gk", "initial_state", "cu_seqlens"),
    "kda": ("g", "beta", "initial_state", "cu_seqlens", "A_log", "dt_bias"),
    "kda_gate": ("A_log", "dt_bias"),
}
