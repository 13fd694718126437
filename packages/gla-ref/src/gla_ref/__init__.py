"""gla-ref: the float64 oracles of gla and the helpers every test uses.

Modules:
  recurrent   token-by-token recurrences (lax.scan) of simple_gla, gla, kda and kda_gate: the definition
  chunked     chunked forms (intra-chunk attention + inter-chunk state), equal to the recurrences in float64
  gates       input transforms shared by both: kda_gate, l2norm, grouped heads
  testing     Case / make_case, oracle, compare_with_oracle / check_against_oracle, tolerances
  plugin      the `reference` implementation of every op for gla_core.dispatch (priority 0)
"""
