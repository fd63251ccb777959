"""The engine core: what runs in the engine-core process (or, in-process, behind `Engine`).

It owns the device: the weights placed once, the executables compiled ahead of time (`executables`,
over the step functions of `steps` and `attention`), the KV cache (`kv_cache`, its blocks kept by
`block_pool`), the scheduling policy (`step_plan`, pure host code) and the engine thread that runs
it (`scheduler`). `process` is the engine-core process's loop: requests arrive as token ids and
sampling settings over Unix-domain sockets (`wire`), and each step's new tokens leave in one
message per front end. Nothing here formats text or speaks HTTP (`cg_jax.serving` does).
"""
