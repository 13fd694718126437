"""The state entering every chunk (FLA's `return_intermediate_states`), from the per-token states.

FLA's `chunk_kda(..., return_intermediate_states=True)` also returns `h [B, NT, HV, K, V]`: the state
before each chunk of C tokens. Without `cu_seqlens` NT = ceil(T / C) per batch row; with packed
sequences B = 1 and NT = sum_n ceil(len_n / C), the chunks of each sequence in order (a sequence
without tokens has none), each sequence's first chunk holding its initial state.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np


def chunk_start_tokens(seq_len: int, chunk_size: int, boundaries=None) -> tuple[np.ndarray, np.ndarray]:
    """(token index before which each chunk starts, sequence of each chunk), host int arrays `[NT]`.

    Without `boundaries` the chunks are those of one row of length `seq_len`.
    """
    if boundaries is None:
        starts = np.arange(0, seq_len, chunk_size)
        return starts, np.zeros_like(starts)
    starts, sequences = [], []
    for n, (begin, end) in enumerate(itertools.pairwise(boundaries)):
        chunk_starts = list(range(int(begin), int(end), chunk_size))
        starts += chunk_starts
        sequences += [n] * len(chunk_starts)
    return np.asarray(starts, np.int64), np.asarray(sequences, np.int64)


def states_before_chunks(token_states, initial, chunk_size: int, boundaries=None):
    """The state entering every chunk.

    Args:
      token_states: `[B, T, HV, X, Y]` the state after every token (any state layout).
      initial: `[N, HV, X, Y]` the initial states (N = B, or the packed sequences).
      chunk_size: C.
      boundaries: host `cu_seqlens` values (B == 1), or None.

    Returns:
      `[B, NT, HV, X, Y]` (NT as in the module doc), in the dtype of `token_states`.
    """
    seq_len = token_states.shape[1]
    starts, sequences = chunk_start_tokens(seq_len, chunk_size, boundaries)
    sequence_start = np.zeros_like(starts) if boundaries is None else np.asarray(boundaries)[sequences]
    first = jnp.asarray(starts == sequence_start)[None, :, None, None, None]
    carried = token_states[:, np.maximum(starts - 1, 0)]  # the state after the token before the chunk
    entering = initial[:, None] if boundaries is None else initial[sequences][None]
    return jnp.where(first, entering.astype(token_states.dtype), carried)
