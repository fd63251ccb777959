"""The messages between the front ends and the engine-core process, over one Unix-domain stream
socket per front end (the core listens at `core_address`; a front end connects once and both
directions share the connection).

A message is a small JSON header, then raw numpy buffers. Token ids and scores travel as arrays
(one step's outputs for one front end: one message), never as a Python object per token, and
nothing is pickled. Framing: the body's length (u64), then the number of parts (u32) and each
part's length (u64), then the parts (all little-endian).

Why plain sockets and not ZMQ: a message goes from the sending thread into the kernel and wakes
the receiving thread directly; ZMQ's PUSH/PULL sockets pass each message through an I/O thread on
either side, and both legs are on every first token's way
(benchmarks/results/core_transport_cpu.md).

Front end -> core:
  hello {client}                                  -> reply: `status` below
  status {ticket}                                 -> reply: `status` below
  add {id, max_new_tokens, settings, logprobs, timeout} + prompt int32[S]
  cancel {ids}
  score {ticket, top} + prompt int32[S]           -> reply: `Engine.score`'s list
  shutdown {}                                     (the launcher, on a connection of its own)
A closed connection is a front end gone: its requests are cancelled.
Core -> front end:
  step {ends: [[id, reason]], errors: [[id, kind, message]], width} + ids int64[N],
    tokens int32[N], scored ids int64[M], scores float32[M, width]
  reply {ticket, result | error: [kind, message]}
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import struct
from typing import Any

import numpy as np

from cg_jax.validation import SamplingSettings

_LENGTH = struct.Struct("<Q")
_COUNT = struct.Struct("<I")
# The kernel's buffer for each direction of a connection: a step's message for 256 requests
# with scores is tens of kilobytes; a front end that falls behind queues in it first.
SOCKET_BUFFER = 4 << 20


def core_address(directory: str) -> str:
  """The path the core listens at (a Unix-domain socket in the serving run's directory)."""
  return os.path.join(directory, "core.sock")


def listen(address: str) -> socket.socket:
  """The core's listening socket at `address`."""
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  sock.bind(address)
  sock.listen(64)
  return sock


def connect(address: str) -> socket.socket:
  """A connection to the core at `address` (OSError if it does not listen there)."""
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  try:
    sock.connect(address)
  except OSError:
    sock.close()
    raise
  configure(sock)
  return sock


def configure(sock: socket.socket) -> None:
  """Either end's connection: kernel buffers of SOCKET_BUFFER each way."""
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def encode(header: dict[str, Any], *arrays: np.ndarray) -> bytes:
  """One message: the JSON header and the arrays' bytes, framed."""
  parts = [json.dumps(header).encode(), *(np.ascontiguousarray(a).tobytes() for a in arrays)]
  lengths = struct.pack(f"<I{len(parts)}Q", len(parts), *map(len, parts))
  body_length = len(lengths) + sum(map(len, parts))
  return b"".join([_LENGTH.pack(body_length), lengths, *parts])


class Reader:
  """Whole messages out of a connection's byte stream: `feed` what `recv` gave, get the
  (header, [buffer, ...]) of every message it completes."""

  def __init__(self):
    self._pending = bytearray()

  def feed(self, data: bytes) -> list[tuple[dict[str, Any], list[bytes]]]:
    pending = self._pending
    pending += data
    messages, at = [], 0
    view = memoryview(pending)
    while len(pending) - at >= _LENGTH.size:
      (length,) = _LENGTH.unpack_from(pending, at)
      end = at + _LENGTH.size + length
      if len(pending) < end:
        break
      body = bytes(view[at + _LENGTH.size:end])
      (count,) = _COUNT.unpack_from(body, 0)
      sizes = struct.unpack_from(f"<{count}Q", body, _COUNT.size)
      start, parts = _COUNT.size + 8 * count, []
      for size in sizes:
        parts.append(body[start:start + size])
        start += size
      messages.append((json.loads(parts[0]), parts[1:]))
      at = end
    view.release()  # (a bytearray with a view on it cannot be resized)
    del pending[:at]
    return messages


def array(buffer, dtype, width: int | None = None) -> np.ndarray:
  """A received buffer as an array (rows of `width` when given)."""
  values = np.frombuffer(buffer, dtype)
  return values if width is None else values.reshape(-1, width)


def settings_json(settings: SamplingSettings) -> dict[str, Any]:
  return dataclasses.asdict(settings)


def settings_from_json(data: dict[str, Any]) -> SamplingSettings:
  return SamplingSettings(**{**data, "eos_ids": tuple(data["eos_ids"])})
