"""Pallas kernels, one per module, each with its block config, an `interpret` flag (CPU tests)
and a plain-jnp reference.

Lowering: the kernels lower through Pallas's Triton backend on the GPU, selected by passing
`pltriton.CompilerParams` explicitly (the default GPU backend differs between jax versions):

| module | kernel | GPU lowering |
|---|---|---|
| `flash_attention` | causal prefill attention | Triton |
| `ragged_paged_attention` | decode rows and prompt chunks over a paged cache, fused write | Triton |

jax 0.11 deprecated the Triton backend and jax 0.12 warns (`DeprecationWarning: The Pallas
Triton backend is deprecated and will be removed in a future JAX version`) on every lowering;
it still lowers and runs, and the tests check it on jax 0.10.2, 0.11.2 and the newest release.
When it is removed these kernels move to Mosaic GPU (`jax.experimental.pallas.mosaic_gpu`) or to
Triton through jax_triton. Mosaic GPU lowered, compiled and ran a port of the slot-cache decode
kernel (since deleted: the ragged paged kernel serves decode) on the H200 at jax 0.11.2, correct
but slower than the Triton kernel in most measured cells
([benchmarks/results/mosaic_gpu_decode_h200.md](../../benchmarks/results/mosaic_gpu_decode_h200.md));
for prefill, jax's own Mosaic GPU FlashAttention-3 example was faster than the Triton kernel at
2048 tokens ([benchmarks/results/attention_h200.md](../../benchmarks/results/attention_h200.md)).
Its interpreter cannot run wgmma on the CPU, so a Mosaic GPU kernel's CPU tests need a jnp
stand-in for the MMA.
"""
