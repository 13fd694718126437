"""Context parallelism on 8 fake CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`).

JAX fixes the CPU device count when its backend starts, so these tests run in their own process:
`tests/test_context_parallel.py` starts it; the rest of the suite keeps one CPU device.

  conftest.py     collects these tests only in a process started with 8 CPU devices
  checks.py       meshes, cases, the runners (dispatch_sharded, or dispatch inside a jax.shard_map
                  of the test) and the comparison with the single-device run and the float64 oracle
  test_oracle.py  every op, fixed and packed, h0/ht, on meshes of 2, 4, 8 and 2x4 (data parallel),
                  heads sharded, both exchanges, the xla/recurrent/reference implementations, the
                  Pallas chunk kernel in TPU interpret mode
  test_errors.py  bad input: errors naming the argument, the expected and the received value
  test_explain.py the per-device call explain shows, and which implementations decline and why
"""
