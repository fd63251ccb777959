"""An OpenAI-compatible HTTP server over one `Engine` (FastAPI + uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions (server-sent events with
`stream: true`; plain ASGI in front of the FastAPI app, `routes.py`), GET /v1/models,
GET /health, GET /metrics (Prometheus text).

Rules:
  * Every request is validated on the host before anything is queued; a bad one gets a 400 in
    OpenAI's error format naming the parameter, the value and the allowed range (pydantic's
    validation errors included: never a 422); one validation pass a request (the engine takes
    it validated, `submit_validated`). An unknown model is a 404, a full queue (`QueueFull`) a
    429, a closed engine a 503, a request past its `request_timeout` a 504.
  * The event loop never blocks on the engine: tokens arrive through the handles' `async for`.
  * A client that disconnects cancels its requests, which frees their KV blocks.
  * `serve` binds its socket before anything compiles (a busy port fails at once,
    `ListenError`). The app's lifespan starts the engine's warm-up (`Warmup`) in a thread while
    the server already answers: until the serving executables are ready, /health is a 503 saying
    how far it got and the API a 503 (code "warming_up"); its progress goes to the log. Then the
    log-probabilities' executables (`LATER_PHASES`) are built while it serves, so nothing
    compiles on the request path: a request that needs one first waits for its build. A failed
    warm-up keeps /health at 500 with the reason and stops `serve` (`WarmupFailed`). At shutdown
    the lifespan stops a warm-up still running (the compiles in flight finish) and closes the
    engine; uvicorn's graceful shutdown lets in-flight requests finish for `graceful_timeout`
    seconds, then cancels them.
  * `temperature` 0 is greedy; `top_k` (0 or -1 = off), `ignore_eos` and `return_token_ids`
    (token ids in each choice and chunk) are extensions. `n`, `best_of` are 1; `suffix`,
    penalties, `logit_bias` and tools are not supported (400).
  * Log-probabilities are the model's (before temperature and filtering), natural-log, in
    OpenAI's formats (`Logprobs`): /v1/completions' `logprobs` (0 to `TOP_LOGPROBS`
    alternatives; OpenAI's legacy API allows up to 5), chat's `logprobs: true` with
    `top_logprobs` (0 to `TOP_LOGPROBS`; without `logprobs: true` a 400). They cover every
    generated token, the EOS token and the ones of a cut stop string included (as `token_ids`).
    A token's string is `tokenizer.decode([id], skip_special_tokens=False)` (`TokenText`).
  * `echo: true` (/v1/completions) starts each choice's text with its prompt (the string as
    given, or the token ids decoded) and, with `logprobs`, its logprobs with the prompt's tokens
    (`engine.score`; the first token's are null). `max_tokens: 0` needs `echo` and generates
    nothing (finish_reason "length"): how evaluation harnesses score prompts; then the prompt
    may fill the context (max_seq_len tokens), scored or not. Streamed, the prompt comes first,
    in a chunk of its own.
"""

from cg_jax.serving.app import (EngineDied, ListenError, WarmupFailed, create_app, listen,
                                load_chat_template, serve)
from cg_jax.serving.protocol import ApiError, engine_error
from cg_jax.serving.service import LATER_PHASES, WARMUP_PHASES, Service, Warmup

__all__ = ["LATER_PHASES", "WARMUP_PHASES", "ApiError", "EngineDied", "ListenError", "Service",
           "Warmup", "WarmupFailed", "create_app", "engine_error", "listen", "load_chat_template",
           "serve"]
