"""Validation of the state arguments every attention op shares: layout, state pool, host boundaries.

`validate_state_arguments` runs inside `validation.validate_common` (after `cu_seqlens`):

- `state_v_first` (FLA's name; `transpose_state_layout` is its old name): the states are
  `[N, H, V, K]` instead of `[N, H, K, V]`: `initial_state`, the final state and every other
  state a call returns.
- `cu_seqlens_cpu` (FLA's name): a host copy of `cu_seqlens`. gla needs none (traced boundaries
  work under `jax.jit` without a host sync), so it is checked against `cu_seqlens` and then
  dropped, except where a result's shape depends on the boundaries (`host_boundaries`).
- The state pool of the serving decode path (FLA/vLLM's `fused_recurrent_*_fwd` semantics):
  with `ssm_state_indices`, `initial_state` is a pool `[P, H, K, V]` (`[P, H, V, K]` with
  `state_v_first`) of P slots, and

    1-D `ssm_state_indices [N]`: sequence n starts from `pool[idx[n]]` and its state after its
        last token is written to `idx[n]` (one slot per sequence);
    2-D `ssm_state_indices [N, S]` (speculative decoding): sequence n (at most S tokens) starts
        from `pool[idx[n, a_n - 1]]`, a_n = `num_accepted_tokens[n]` (1 without it), and its
        state after token t is written to `idx[n, t]` (one slot per token);

  a negative index (vLLM's PAD_SLOT_ID = -1) or one >= P is padding: reading it gives a zero
  state, writing it is skipped. Slots not written keep their values bit for bit. With
  `inplace_final_state=True` (FLA's default) the call returns the updated pool as its final state
  (JAX's functional "in place": the implementations alias the pool buffer, donate it to update it
  without a copy); with False it returns the state after every token `[B, T, H, K, V]` instead and
  leaves the pool alone. N is B, or the number of packed sequences with `cu_seqlens`; a sequence
  without tokens reads and writes nothing. Sequences must not share slots (a slot written by one
  sequence is neither read nor written by another); concrete indices are checked.

Errors name the argument, the expected and the received value. Checks on values run only on
concrete arrays (not under `jax.jit`).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gla_core.errors import DTypeError, InvalidArgumentError, ShapeError, describe

# Call.options names (present only when they differ from the default).
STATE_V_FIRST = "state_v_first"
STATE_POOL = "state_pool"  # "sequence" (1-D ssm_state_indices) or "token" (2-D)
TOKEN_STATES = "token_states"  # True: inplace_final_state=False with a pool, the per-token states are returned


def _array_shape(name: str, x: Any) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None or getattr(x, "dtype", None) is None:
        raise DTypeError(f"{name}: expected an array, got {type(x).__name__}")
    return tuple(int(d) for d in shape)


def _concrete(x: Any) -> bool:
    return not isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct))


def _require_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentError(f"{name}: expected a bool, got {value!r}")
    return bool(value)


def _int32(name: str, x: Any, shape: tuple[int, ...]):
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise DTypeError(f"{name}: expected an integer dtype (int32), got {x.dtype}")
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, jnp.int32)
    return jnp.asarray(x).astype(jnp.int32)


def state_shape(num_states: int, heads: int, key_dim: int, value_dim: int, v_first: bool) -> tuple[int, ...]:
    """The shape of `num_states` states: [N, H, K, V], or [N, H, V, K] when `v_first`."""
    return (num_states, heads, value_dim, key_dim) if v_first else (num_states, heads, key_dim, value_dim)


def state_layout_name(v_first: bool) -> str:
    return "[N, H, V, K] (state_v_first)" if v_first else "[N, H, K, V]"


def state_v_first_of(state_v_first: Any, transpose_state_layout: Any = None) -> Any:
    """FLA's `state_v_first`, given directly or by its deprecated name `transpose_state_layout`
    (a DeprecationWarning, as FLA; both at once is an error)."""
    if transpose_state_layout is None:
        return state_v_first
    if state_v_first:
        raise InvalidArgumentError(
            "transpose_state_layout: the deprecated name of state_v_first; give one of them, got both"
        )
    warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning, 3)
    return transpose_state_layout


# --------------------------------------------------------------------------- host boundaries


def _check_host_copy(args: dict[str, Any], seq_len: int, num_sequences: int | None) -> tuple[int, ...] | None:
    """Validates `cu_seqlens_cpu` and returns its values as a tuple (None when absent)."""
    host = args["cu_seqlens_cpu"]
    if host is None:
        return None
    if args["cu_seqlens"] is None:
        raise InvalidArgumentError(
            f"cu_seqlens_cpu: the host copy of cu_seqlens needs cu_seqlens, got {describe(host)} without it"
        )
    if isinstance(host, (jax.core.Tracer, jax.ShapeDtypeStruct)):
        raise InvalidArgumentError(
            f"cu_seqlens_cpu: expected host values (a numpy array, list or concrete array), got {describe(host)}"
        )
    values = np.asarray(host)
    if values.ndim != 1 or values.shape[0] != num_sequences + 1:
        raise ShapeError(
            f"cu_seqlens_cpu: expected shape [N+1] = ({num_sequences + 1},) (as cu_seqlens), got {values.shape}"
        )
    if not np.issubdtype(values.dtype, np.integer):
        raise DTypeError(f"cu_seqlens_cpu: expected an integer dtype, got {values.dtype}")
    values = values.astype(np.int64)
    if values[0] != 0 or values[-1] != seq_len or (np.diff(values) < 0).any():
        raise InvalidArgumentError(
            f"cu_seqlens_cpu: expected non-decreasing values from 0 to T = {seq_len}, got {values.tolist()}"
        )
    device = args["cu_seqlens"]
    if _concrete(device) and not np.array_equal(np.asarray(device).astype(np.int64), values):
        raise InvalidArgumentError(
            f"cu_seqlens_cpu: expected the values of cu_seqlens {np.asarray(device).tolist()}, got {values.tolist()}"
        )
    return tuple(int(v) for v in values)


def host_boundaries(args: dict[str, Any]) -> tuple[int, ...] | None:
    """The packed-sequence boundaries as host integers: `cu_seqlens_cpu`, else a concrete `cu_seqlens`.

    None when there are no boundaries on the host (no `cu_seqlens`, or a traced one without a copy).
    """
    if args["cu_seqlens_cpu"] is not None:
        return tuple(args["cu_seqlens_cpu"])
    cu_seqlens = args["cu_seqlens"]
    if cu_seqlens is not None and _concrete(cu_seqlens):
        return tuple(int(v) for v in np.asarray(cu_seqlens))
    return None


# --------------------------------------------------------------------------- state pool


def _check_pool_values(idx: np.ndarray, accepted: np.ndarray | None, pool_size: int, lengths: np.ndarray | None):
    """Checks concrete indices: below the pool size, and no slot shared between sequences."""
    if (idx >= pool_size).any():
        where = tuple(int(i) for i in np.argwhere(idx >= pool_size)[0])
        raise InvalidArgumentError(
            f"ssm_state_indices: expected slots < P = {pool_size} (the pool size; negative = padding), "
            f"got {int(idx[where])} at {where}"
        )
    num_sequences = idx.shape[0]
    if idx.ndim == 1:
        reads, writes = idx[:, None], idx[:, None]
    else:
        steps = np.arange(idx.shape[1])[None, :]
        used = steps < (idx.shape[1] if lengths is None else lengths[:, None])
        writes = np.where(used, idx, -1)
        last = (np.ones(num_sequences, np.int64) if accepted is None else accepted) - 1
        reads = idx[np.arange(num_sequences), last][:, None]
    owner: dict[int, int] = {}
    for n in range(num_sequences):
        for slot in {int(s) for s in np.concatenate([reads[n], writes[n]]) if s >= 0}:
            if owner.setdefault(slot, n) != n:
                raise InvalidArgumentError(
                    f"ssm_state_indices: expected every pool slot to belong to one sequence, got slot {slot} "
                    f"used by sequences {owner[slot]} and {n}"
                )


def _validate_pool(args, batch, seq_len, state_heads, key_dim, value_dim, num_sequences, v_first) -> None:
    """Checks and normalizes the pool arguments."""
    idx = args["ssm_state_indices"]
    shape = _array_shape("ssm_state_indices", idx)
    n = batch if num_sequences is None else num_sequences
    if len(shape) not in (1, 2) or shape[0] != n or (len(shape) == 2 and shape[1] < 1):
        raise ShapeError(
            f"ssm_state_indices: expected [N] (a slot per sequence) or [N, S] (a slot per token) with N = {n} "
            f"sequences, got shape {shape}"
        )
    args["ssm_state_indices"] = _int32("ssm_state_indices", idx, shape)
    pool = args["initial_state"]
    layout = "[P, H, V, K] (state_v_first)" if v_first else "[P, H, K, V]"
    if pool is None:
        raise InvalidArgumentError(f"initial_state: ssm_state_indices addresses a pool of states {layout}, got None")
    pool_shape = _array_shape("initial_state", pool)
    expected_tail = state_shape(1, state_heads, key_dim, value_dim, v_first)[1:]
    if len(pool_shape) != 4 or pool_shape[1:] != expected_tail or pool_shape[0] < 1:
        raise ShapeError(
            f"initial_state: expected a pool {layout} with {layout[4:-1]} = {expected_tail}, got {pool_shape}"
        )
    if not jnp.issubdtype(pool.dtype, jnp.floating):
        raise DTypeError(f"initial_state: expected a floating dtype for the pool, got {pool.dtype}")
    accepted = args["num_accepted_tokens"]
    if accepted is not None:
        if len(shape) != 2:
            raise InvalidArgumentError(
                "num_accepted_tokens: needs 2-D ssm_state_indices [N, S] (a slot per token), "
                f"got ssm_state_indices of shape {shape}"
            )
        if _array_shape("num_accepted_tokens", accepted) != (n,):
            raise ShapeError(f"num_accepted_tokens: expected shape [N] = ({n},), got {tuple(accepted.shape)}")
        args["num_accepted_tokens"] = accepted = _int32("num_accepted_tokens", accepted, (n,))
        if _concrete(accepted):
            values = np.asarray(accepted)
            if ((values < 1) | (values > shape[1])).any():
                raise InvalidArgumentError(
                    f"num_accepted_tokens: expected values in [1, S = {shape[1]}], got {values.tolist()}"
                )
    boundaries = host_boundaries(args)
    lengths = None
    if num_sequences is None:
        lengths = np.full((n,), seq_len, np.int64)
    elif boundaries is not None:
        lengths = np.diff(np.asarray(boundaries, np.int64))
    if len(shape) == 2 and lengths is not None and (lengths > shape[1]).any():
        raise InvalidArgumentError(
            f"ssm_state_indices: a sequence has {int(lengths.max())} tokens, more than its S = {shape[1]} slots"
        )
    if len(shape) == 1 and num_sequences is not None and boundaries is None:
        raise InvalidArgumentError(
            "ssm_state_indices: 1-D indices with packed sequences need the longest sequence at trace time: "
            "pass cu_seqlens_cpu (the host copy of cu_seqlens), a concrete cu_seqlens, or 2-D indices [N, S]"
        )
    if _concrete(args["ssm_state_indices"]):
        values = None if accepted is None or not _concrete(accepted) else np.asarray(accepted).astype(np.int64)
        _check_pool_values(np.asarray(args["ssm_state_indices"]).astype(np.int64), values, pool_shape[0], lengths)


# --------------------------------------------------------------------------- entry point


def validate_state_arguments(args, batch, seq_len, state_heads, key_dim, value_dim, num_sequences) -> None:
    """Checks and normalizes `state_v_first`, `initial_state`, `cu_seqlens_cpu` and the pool arguments.

    Args:
      args: the op's arguments (normalized in place; `cu_seqlens` already checked).
      batch, seq_len: B and T of q.
      state_heads, key_dim, value_dim: the state's H (HV for kda), K and V.
      num_sequences: N of packed sequences, or None without `cu_seqlens`.
    """
    v_first = args["state_v_first"] = _require_bool("state_v_first", args["state_v_first"])
    args["inplace_final_state"] = _require_bool("inplace_final_state", args["inplace_final_state"])
    host = _check_host_copy(args, seq_len, num_sequences)
    args["cu_seqlens_cpu"] = host
    if args["ssm_state_indices"] is None:
        for name, default in (("num_accepted_tokens", None), ("inplace_final_state", True)):
            if args[name] is not default:
                got = describe(args[name])
                raise InvalidArgumentError(
                    f"{name}: only used with ssm_state_indices (a state pool), got {got} without it"
                )
        if args["initial_state"] is not None:
            n = batch if num_sequences is None else num_sequences
            expected = state_shape(n, state_heads, key_dim, value_dim, v_first)
            got = _array_shape("initial_state", args["initial_state"])
            if got != expected:
                raise ShapeError(f"initial_state: expected shape {state_layout_name(v_first)} = {expected}, got {got}")
            if not jnp.issubdtype(args["initial_state"].dtype, jnp.floating):
                raise DTypeError(f"initial_state: expected a floating dtype, got {args['initial_state'].dtype}")
        return
    _validate_pool(args, batch, seq_len, state_heads, key_dim, value_dim, num_sequences, v_first)


def state_options(args: dict[str, Any], keep_host_boundaries: bool = False) -> list[tuple[str, Any]]:
    """The Call options of the state arguments (non-default ones only), and the final say on
    `cu_seqlens_cpu`: kept (as a tuple of ints, static) when a result's shape depends on the
    boundaries (`keep_host_boundaries`, or 1-D pool indices with packed sequences), else None.

    Call it after `validate_state_arguments`.
    """
    indices = args["ssm_state_indices"]
    pool = None if indices is None else ("sequence" if len(indices.shape) == 1 else "token")
    if keep_host_boundaries or (pool == "sequence" and args["cu_seqlens"] is not None):
        args["cu_seqlens_cpu"] = host_boundaries(args)
    else:
        args["cu_seqlens_cpu"] = None
    options = []
    if args["state_v_first"]:
        options.append((STATE_V_FIRST, True))
    if pool is not None:
        options.append((STATE_POOL, pool))
        if not args["inplace_final_state"]:
            options.append((TOKEN_STATES, True))
    return options
