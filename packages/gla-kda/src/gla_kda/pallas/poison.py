"""Non-finite inputs reach exactly the outputs the recurrence lets them reach, inside the kernels.

The kernels read every input cleaned (non-finite entries as 0, `chunk_math.finite`): the matrix
products of a chunk would otherwise carry a NaN at step t to the rows before t (0 * NaN). What the
recurrence would make non-finite is put back as NaN where the outputs are written (the rules are
`gla_kda.nonfinite`'s, which the `xla` implementation applies outside its chunked form):
  - a non-finite k_t, beta_t or g_t (NaN or +inf; -inf is a hard reset) reaches every column of
    the state from step t on, a non-finite v_t[c] column c, a non-finite column of the initial
    state column c from the sequence's first step: column c of o from the first such step on;
  - a non-finite q_t reaches o_t only.
The state kernel finds, per chunk and value column, the first row of the chunk from which the
state's column is non-finite (the chunk's *poison row*: 0 when it already is at the chunk's start,
C when it stays finite), the initial state's non-finite columns included, and writes o with NaN
from there on and in the rows of a non-finite q. The backward kernels poison dO in the same places
as they read it, which is what the chain rule through `o * NaN` gives, so the gradients of a
poisoned sequence and head carry NaN as the recurrence's own backward would.

Most of that runs only in the grid steps that need it. The forward's intra-chunk and state kernels
and the backward's gradient kernel (`intra_bwd`) walk each grid step first on the inputs as they
are (g raised to its floor, dO not poisoned), folding what decides whether the step is finite into
`StepFlags`: the raw inputs (forward), or the forward's poison rows and q (gradient kernel). Where
that finds anything non-finite or poisoned, the step runs again from the states it started from,
with the inputs cleaned and dO poisoned, and the state kernel finds its poison rows and poisons o
(`poison_step`); every other step writes poison rows of C. Where every input is finite the cleaning
is the identity, so the first walk's outputs stand. libtpu's static estimate charges the first walk
only. The state-gradient kernel (`state_bwd`) cleans and poisons in every step.

Poison rows are float32 [B, NT * 8, HV * V]: chunk n's row of value head j at rows 8n..8n+7
(repeated, one (8, 128) tile per chunk and head), lanes j*V...
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

ROWS_PER_CHUNK = 8


def _finite(x):
    return jnp.abs(x.astype(jnp.float32)) < jnp.inf


def _nonfinite_flags(x, axis: int):
    """x [R, D] reduced along `axis` (kept as 1): 1.0 where a NaN or an infinity is there, else 0.0
    (float flags: Mosaic relayouts of one-row boolean vectors do not lower)."""
    return jnp.max(jnp.where(_finite(x), 0.0, 1.0), axis=axis, keepdims=True)


def nonfinite_columns(x):
    """[R, V] -> [1, V] float32: 1 where the column holds a NaN or an infinity, else 0."""
    return _nonfinite_flags(x, 0)


def nonfinite_rows(x):
    """[C, D] -> [C, 1] bool: the row holds a NaN or an infinity."""
    return _nonfinite_flags(x, 1) > 0.0


def _first(bad, axis: int):
    """The first index along `axis` where `bad` (its length when none), float32, that axis kept as 1."""
    index = jax.lax.broadcasted_iota(jnp.int32, bad.shape, axis).astype(jnp.float32)
    return jnp.min(jnp.where(bad, index, float(bad.shape[axis])), axis=axis, keepdims=True)


def chunk_poison(k, g, beta, v, poisoned_before):
    """The chunk's poison row [1, V] float32: the first row from which column c of the state is
    non-finite (0 where it already was before the chunk, C when it stays finite).

    Args:
      k: [C, K] raw keys; g: [C, K] raw log decays (NaN or +inf poison; -inf is a hard reset);
      beta: [1, C] raw; v: [C, V] raw values; poisoned_before: [1, V] float32, 1 where the column
        was poisoned before the chunk, else 0 (float flags: Mosaic relayouts of one-row boolean
        vectors do not lower).
    """
    # The first step that reaches every column: per key lane, then over the lanes (one lane
    # reduction of one row instead of one per row).
    key_first = jnp.min(_first(~_finite(k) | ~(g < jnp.inf), axis=0), axis=1, keepdims=True)  # [1, 1]
    every_column = jnp.minimum(key_first, _first(~_finite(beta), axis=1))  # [1, 1]
    first = jnp.minimum(_first(~_finite(v), axis=0), every_column)  # [1, V]
    return jnp.where(poisoned_before > 0.0, 0.0, first)


class StepFlags:
    """Whether anything a grid step reads or carries is non-finite, found on the common path at
    little cost, so that the poison rows and the poisoning of the outputs (`chunk_poison`, `poison`)
    run only in the steps that need them.

    Running folds, each reduced over sublane tiles as its terms come: sums of the raw inputs (in
    their own dtype, two rows per 32-bit word for 16-bit inputs), one addition per vector register,
    and maxima of 0/1 flags. A sum is NaN or infinite when a term is (+inf beside -inf sums to NaN);
    a sum of finite terms that overflows flags the step too, which then merely runs the poison
    search and finds nothing. The raw log decays' sum flags NaN and +inf only: -inf is a hard reset,
    and a sum with -inf terms stays -inf unless a NaN or +inf term is there too.
    """

    def __init__(self):
        self._folds: dict[tuple, jax.Array] = {}

    def _fold(self, kind: str, x, combine):
        rows, width = x.shape
        tile = ROWS_PER_CHUNK * max(1, 4 // x.dtype.itemsize)
        if rows > tile and rows % tile == 0:
            parts = x.reshape(rows // tile, tile, width)
            x = jnp.max(parts, axis=0) if kind == "max" else jnp.sum(parts, axis=0)
        key = (kind, x.dtype.name, x.shape)
        seen = self._folds.get(key)
        self._folds[key] = x if seen is None else combine(seen, x)

    def add_mask(self, bad):
        """Folds in bad [R, D] bool."""
        self._fold("max", jnp.where(bad, 1.0, 0.0), jnp.maximum)

    def add_values(self, x):
        """Folds in x [R, D] (any float dtype): NaN and +-inf are found."""
        self._fold("sum", x, jnp.add)

    def add_log_decays(self, g):
        """Folds in raw log decays g [R, K]: NaN and +inf are found, -inf is not."""
        self._fold("log_decay", g.astype(jnp.float32), jnp.add)

    def add_inputs(self, k, g, beta, v, q=None):
        """Folds in what `chunk_poison` and `poison` look at: non-finite raw k [C, K], beta [1, C],
        v [C, V] and q [C, K], and g [C, K] NaN or +inf (-inf is a hard reset, not poison)."""
        for x in (k, v, beta) + (() if q is None else (q,)):
            self.add_values(x)
        self.add_log_decays(g)

    def add_poisoned(self, poisoned):
        """Folds in poisoned columns [1, V] float32 (1: poisoned)."""
        self.add_mask(poisoned > 0.0)

    def any(self):
        """Scalar bool: something folded in is non-finite or poisoned."""
        flags = {
            "sum": lambda x: jnp.where(_finite(x), 0.0, 1.0),
            "log_decay": lambda x: jnp.where(x < jnp.inf, 0.0, 1.0),
            "max": lambda x: x,
        }
        found = [jnp.max(flags[kind](x)) for (kind, _, _), x in self._folds.items()]
        return functools.reduce(jnp.maximum, found) > 0.0


def poison(x, poison_row, q):
    """x [C, V] (a chunk's o or dO) with NaN in column c from row `poison_row[0, c]` on (its poison
    row [1, V] float32), and in the rows where q [C, K] (raw) is not finite."""
    rows = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0).astype(jnp.float32)
    return jnp.where((rows >= poison_row) | nonfinite_rows(q), jnp.nan, x)


def poison_chunk(x, poison_ref, n: int, q, lanes=slice(None)):
    """`poison` with chunk n's poison row from a kernel's poison block [chunks * 8, lanes]."""
    return poison(x, poison_ref[pl.ds(n * ROWS_PER_CHUNK, 1), lanes], q)


def write_chunk_row(poison_ref, n: int, lanes, row):
    """Stores chunk n's poison row [1, V] (as its 8 rows) into a kernel's poison block."""
    poison_ref[pl.ds(n * ROWS_PER_CHUNK, ROWS_PER_CHUNK), lanes] = jnp.broadcast_to(row, (ROWS_PER_CHUNK, row.shape[1]))


def final_columns(poison_rows, chunk_size: int, last, chunk_sequence, num_states: int):
    """XLA side: [N, HV*V] bool, column c of sequence n's final state is non-finite (its last
    chunk's poison row is below C).

    Args:
      last: [NT] int32, 1 where a chunk ends its sequence.
      chunk_sequence: [NT] int32, each chunk's sequence (packed, B = 1), or None (N = B: the
        row's last chunk ends it).
    """
    ends_poisoned = poison_rows[:, ::ROWS_PER_CHUNK] < chunk_size  # [B, NT, HV*V]
    if chunk_sequence is None:
        return ends_poisoned[:, -1]
    counted = jnp.where((last == 1)[:, None], ends_poisoned[0], False).astype(jnp.int32)  # [NT, HV*V]
    return jax.ops.segment_sum(counted, chunk_sequence, num_segments=num_states) > 0
