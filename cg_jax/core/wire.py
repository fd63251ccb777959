"""The messages between the front ends and the engine-core process, over ZMQ IPC sockets.

A message is multipart: a small JSON header, then raw numpy buffers. Token ids and scores travel
as arrays (one step's outputs for one front end: one message), never as a Python object per
token, and nothing is pickled.

Front end -> core (one PULL socket, `core_address`; each front end PUSHes to it):
  hello {client}                                  the core connects back to `client`'s address
  status {client, ticket}                         -> reply: `status` below
  add {client, id, max_new_tokens, settings, logprobs, timeout} + prompt int32[S]
  cancel {client, ids}
  score {client, ticket, top} + prompt int32[S]   -> reply: `Engine.score`'s list
  client_gone {client}                            (the launcher: that front end died)
  shutdown {}
Core -> front end (the front end's PULL socket, `front_address`):
  step {ends: [[id, reason]], errors: [[id, kind, message]], width} + ids int64[N],
    tokens int32[N], scored ids int64[M], scores float32[M, width]
  reply {ticket, result | error: [kind, message]}
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from cg_jax.validation import SamplingSettings


def core_address(directory: str) -> str:
  return f"ipc://{os.path.join(directory, 'core')}"


def front_address(directory: str, index: int) -> str:
  return f"ipc://{os.path.join(directory, f'front-{index}')}"


def encode(header: dict[str, Any], *arrays: np.ndarray) -> list:
  """[header JSON, array buffers...] for `socket.send_multipart(..., copy=False)`."""
  return [json.dumps(header).encode(), *(np.ascontiguousarray(a).data for a in arrays)]


def decode(frames: Sequence) -> tuple[dict[str, Any], list]:
  """(header, the raw buffers after it)."""
  return json.loads(bytes(frames[0])), [frame.buffer if hasattr(frame, "buffer") else frame
                                        for frame in frames[1:]]


def array(buffer, dtype, width: int | None = None) -> np.ndarray:
  """A received buffer as an array (rows of `width` when given)."""
  values = np.frombuffer(buffer, dtype)
  return values if width is None else values.reshape(-1, width)


def settings_json(settings: SamplingSettings) -> dict[str, Any]:
  return dataclasses.asdict(settings)


def settings_from_json(data: dict[str, Any]) -> SamplingSettings:
  return SamplingSettings(**{**data, "eos_ids": tuple(data["eos_ids"])})
