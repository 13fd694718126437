"""Pallas TPU kernels of the kda `chunk` implementation.

Modules (kernel bodies separate from their launchers in each):
  config     block sizes, dtypes and compiler parameters shared by every kernel
  chunk_math in-kernel building blocks: input cleaning, the decay cumsum, decay exponents,
             (I + A)^-1
  gated_grads in-kernel gradients of the gated intra-chunk products (rows, columns, gates)
  layout     XLA side: [B, T, H, D] inputs as token-major [B, T, H*D] views for the forward
             kernels, head-major [B, H, T, D] copies for the backward kernels, and back
  intra      forward intra-chunk kernel: (I + Akk)^-1 and Aqk per chunk
  state      forward inter-chunk state kernel: WY quantities, delta-rule state recurrence, and
             the output o = q S + Aqk v_new of every chunk as the recurrence passes it
  poison     in-kernel non-finite input handling: which outputs the recurrence makes NaN
  sequence_states  per-sequence states of packed rows, moved by DMA in the state kernels
  state_bwd  backward reverse-time state-gradient kernel (dh0)
  intra_bwd  backward per-chunk gradient kernel (dq, dk, dv, dbeta, dg), recomputing the states
  pipeline   the `jax.custom_vjp` tying the kernels together
"""
