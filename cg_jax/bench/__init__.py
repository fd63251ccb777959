"""`python -m cg_jax bench latency|throughput|serve|startup`: the project's benchmarks on its
public APIs (`Engine.generate`, `submit`, an OpenAI-compatible endpoint, the CLI), writing one
row schema (`cg_jax.bench.rows`)."""
