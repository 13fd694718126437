"""gla-ref: the float64 oracles of gla and the helpers every test uses.

Modules:
  recurrent   token-by-token recurrences (lax.scan) of simple_gla, gla, kda and kda_gate: the definition
  chunked     chunked forms (intra-chunk attention + inter-chunk state), equal to the recurrences in float64
  gates       input transforms shared by both: kda_gate, l2norm, grouped heads
  parallel    the attention matrix of simple_gla (FLA's parallel_simple_gla with output_attentions)
  decode      the serving decode path with a state pool (ssm_state_indices), on the recurrences
  chunk_states  the state entering every chunk (kda's return_intermediate_states), from per-token states
  testing     Case / make_case, oracle, compare_with_oracle / check_against_oracle, tolerances
  decode_cases  test problems of the decode path (prepared inputs, a pool, slots, the oracle)
  plugin      the `reference` implementation of every op for gla_core.dispatch (priority 0)
"""
