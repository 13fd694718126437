"""The one way both fused_chunk kernels are launched: a sequential time walk with a float32
`[Vt, K]` carry in VMEM, and the same per-chunk cost (one gated `[C, C]` product, two
`[C, K] x [K, Vt]` products and a state-sized update)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_core.kit import compiler_params, cost_estimate, interpret_params, intra_costs
from gla_fused.fused_chunk.specs import FusedSpecs


def sequential_call(kernel, name: str, inputs, in_specs, out_shape, out_specs, *, specs: FusedSpecs, interpret: bool):
    """Runs `kernel` over the grid `(B, H, NV, NT / num_steps)` (time "arbitrary") under the
    named scope `name`. `inputs[0]` is a `[B, H, Tp, K]` operand; returns the outputs."""
    b, hh, _, kdim = inputs[0].shape
    c, bv = specs.chunk, specs.block_v
    gate_flops, gate_transcendentals = intra_costs("scalar", c, kdim, products=1)
    per_chunk = gate_flops + 2 * c * bv * (2 * kdim + c) + 3 * kdim * bv
    chunks = b * hh * specs.num_value_tiles * specs.num_chunks
    cost = cost_estimate(chunks * per_chunk, chunks * (gate_transcendentals + 1), [*inputs, *out_shape])
    with jax.named_scope(name):
        return pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=specs.grid(b, hh),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((bv, kdim), jnp.float32)],
            compiler_params=compiler_params("parallel", "parallel", "parallel", "arbitrary"),
            interpret=interpret_params(interpret),
            cost_estimate=cost,
            name=name,
        )(*inputs)
