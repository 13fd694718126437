"""The op catalogue: what each op takes (FLA's argument names), what is static, how it is validated.

An op is an `OpSpec`. Plugins contribute specs through the hook `gla_ops()` (gla-core itself
contributes `simple_gla` and `gla`, gla-kda `kda` and `kda_gate`), so a package can add an op
without touching gla-core.

Every validated call reaches its implementation as ONE frozen record, the op's `arguments` class:
one field per array and keyword of the op (defaults filled in, normalized by the op's validator),
plus `interpret` and `options` (the chosen implementation's options, see `gla_core.options`). The
record is a pytree whose array fields are leaves and whose static fields (`OpSpec.static`,
`interpret`, `options`) are part of its structure, so `jax.jit(fn)(record)` retraces exactly when a
static value changes; the registry jits every implementation this way.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax

DEFAULT_CHUNK_SIZE = 64
CHUNK_SIZES = (16, 32, 64, 128)

# Keywords of every attention op (simple_gla, gla, kda), with FLA's defaults, and the static ones.
# state_v_first: the states are [N, H, V, K] (FLA's V-first layout) instead of [N, H, K, V].
# cu_seqlens_cpu: FLA's host copy of cu_seqlens (checked; kept only where a shape depends on it).
# ssm_state_indices, num_accepted_tokens, inplace_final_state: the serving decode path, where
# initial_state is a pool of states addressed per sequence or per token (`gla_core.state_args`).
ATTENTION_KEYWORDS = MappingProxyType(
    dict(
        scale=None,
        initial_state=None,
        output_final_state=False,
        cu_seqlens=None,
        chunk_size=DEFAULT_CHUNK_SIZE,
        state_v_first=False,
        cu_seqlens_cpu=None,
        ssm_state_indices=None,
        num_accepted_tokens=None,
        inplace_final_state=True,
    )
)
ATTENTION_STATIC = frozenset(
    {"scale", "output_final_state", "chunk_size", "state_v_first", "cu_seqlens_cpu", "inplace_final_state"}
)
# Fields every arguments record has besides the op's own.
CALL_FIELDS = ("interpret", "options")

# validate(arguments: dict, backend, interpret) -> Call: checks and normalizes `arguments` in place.
Validator = Callable[[dict, str, bool], Any]


@dataclasses.dataclass(frozen=True)
class ContextParallelSpec:
    """How an attention op takes part in context parallelism (`dispatch(..., context_axis=...)`).

    The op must be affine in its `[N, HV, K, V]` state, one value column at a time, with a
    transition that does not depend on v: run from state S0, a sequence gives
    `o = o|S0=0 + (scale q̂ᵀ M_t) S0` and `S_T = M_T S0 + C` (`gla_core.context_parallel`).

    Attributes:
      token_arrays: keyword arrays laid out `[B, T, ...]` (sharded along T like q, k, v).
      head_arrays: keyword arrays whose leading axis is the heads (`[H]`, `[HV]`, `[HV * K]`):
        sharded with the heads by `gla_core.dispatch_sharded`.
      log_decay: for a diagonal transition (M_t = diag(exp(cumulative gate))), the function
        `log_decay(arguments) -> [B, T, H, K or 1]` float32 giving each token's log decay from the
        op's validated arguments (a dict). None for a dense `[K, K]` transition (kda), which is
        obtained by running the op on K extra value columns from an identity state.
    """

    token_arrays: tuple[str, ...]
    head_arrays: tuple[str, ...] = ()
    log_decay: Callable[[Mapping[str, Any]], Any] | None = None


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op.

    Attributes:
      name: the op name given to `dispatch`.
      arrays: names of the positional array arguments, in order.
      keywords: every keyword argument with its default (FLA's names).
      static: keywords that are Python values (hashable, jit-static), e.g. `scale`, flags.
      validate: `validate(arguments, backend, interpret) -> Call`; raises `gla_core.errors`
        exceptions naming the argument, the expected and the received value, and normalizes the
        dict in place (defaults filled in before it is called).
      summary: one line for people.
      providers: the distributions that implement it, named when no implementation is installed.
      aliases: other accepted keyword names (e.g. FLA's `chunk_gla` calls gla's `gk` `g`).
      context_parallel: how its state carries across devices when T is sharded; None when the
        op does not support `context_axis`.
    """

    name: str
    arrays: tuple[str, ...]
    keywords: Mapping[str, Any]
    static: frozenset[str]
    validate: Validator
    summary: str
    providers: tuple[str, ...] = ()
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    context_parallel: ContextParallelSpec | None = None

    def __post_init__(self):
        object.__setattr__(self, "keywords", MappingProxyType(dict(self.keywords)))
        object.__setattr__(self, "aliases", MappingProxyType(dict(self.aliases)))
        object.__setattr__(self, "static", frozenset(self.static))
        unknown = self.static - set(self.keywords)
        if unknown:
            raise ValueError(f"op {self.name}: static names {sorted(unknown)} are not keywords")

    @functools.cached_property
    def arguments(self) -> type:
        """The frozen record class of this op's validated arguments (a pytree, see the module doc)."""
        return _arguments_class(self)

    @property
    def argument_names(self) -> tuple[str, ...]:
        """Every field of the arguments record, in order."""
        return (*self.arrays, *self.keywords, *CALL_FIELDS)


def _arguments_class(spec: OpSpec) -> type:
    names = spec.argument_names
    static = [n for n in names if n in spec.static or n in CALL_FIELDS]
    camel = "".join(part.capitalize() for part in spec.name.split("_"))
    # Arrays are required; keywords default to the op's defaults (records built by hand, e.g. in
    # tests, keep working when an op gains a keyword); dispatch always passes every field.
    defaults = {**spec.keywords, "interpret": False, "options": None}
    fields = [n if n in spec.arrays else (n, Any, dataclasses.field(default=defaults[n])) for n in names]
    cls = dataclasses.make_dataclass(
        f"{camel}Arguments",
        fields,
        frozen=True,
        namespace={
            "__doc__": f"Validated arguments of op {spec.name!r} (static: {', '.join(static)}).",
            "replace": lambda self, **changes: dataclasses.replace(self, **changes),
        },
    )
    cls.__module__ = __name__
    return jax.tree_util.register_dataclass(cls, data_fields=[n for n in names if n not in static], meta_fields=static)


def attention_spec(
    name: str,
    validate: Validator,
    summary: str,
    *,
    providers: tuple[str, ...],
    keywords: Mapping[str, Any],
    static: frozenset[str] = frozenset(),
    aliases: Mapping[str, str] | None = None,
    context_parallel: ContextParallelSpec | None = None,
) -> OpSpec:
    """An attention op on q, k, v: its own keywords before FLA's common ones (scale, initial_state,
    output_final_state, cu_seqlens, chunk_size)."""
    return OpSpec(
        name=name,
        arrays=("q", "k", "v"),
        keywords={**keywords, **ATTENTION_KEYWORDS},
        static=ATTENTION_STATIC | static,
        validate=validate,
        summary=summary,
        providers=providers,
        aliases=aliases or {},
        context_parallel=context_parallel,
    )
