"""The engine-core process's transport (`cg_jax.core.wire`, `cg_jax.core.process.Outbox`): whole
messages out of any split of the byte stream, and a front end that stops reading never blocks
the sender."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from cg_jax.core import process, wire


def _messages(rng):
  """A few messages as the core and the front ends send them: headers with and without arrays."""
  ids = rng.integers(0, 1 << 40, size=7).astype(np.int64)
  tokens = rng.integers(0, 50_000, size=7).astype(np.int32)
  scores = rng.standard_normal((3, 5)).astype(np.float32)
  return [({"op": "step", "ends": [[1, "length"]], "errors": [], "width": 5},
           [ids, tokens, ids[:3], scores]),
          ({"op": "status", "ticket": -1}, []),
          ({"op": "add", "id": 4, "settings": {"temperature": 0.5}},
           [rng.integers(0, 100, size=513).astype(np.int32)]),
          ({"op": "step", "ends": [], "errors": [], "width": 0},
           [np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int64),
            np.zeros(0, np.float32)])]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reader_returns_whole_messages_from_any_split(seed):
  rng = np.random.default_rng(seed)
  messages = _messages(rng)
  stream = b"".join(wire.encode(header, *arrays) for header, arrays in messages)
  cuts = np.sort(rng.choice(np.arange(1, len(stream)), size=12, replace=False))
  reader, received = wire.Reader(), []
  for start, end in zip([0, *cuts], [*cuts, len(stream)]):
    received += reader.feed(stream[start:end])
  assert len(received) == len(messages)
  for (header, arrays), (got_header, buffers) in zip(messages, received):
    assert got_header == header
    assert len(buffers) == len(arrays)
    for array, buffer in zip(arrays, buffers):
      width = array.shape[1] if array.ndim == 2 else None
      np.testing.assert_array_equal(wire.array(buffer, array.dtype, width), array)
  assert reader.feed(b"") == []


def test_outbox_queues_what_a_full_socket_does_not_take_and_drops_a_peer_far_behind(
    monkeypatch):
  core_end, front_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
  try:
    core_end.setblocking(False)
    peer, outbox = process.Peer(core_end), process.Outbox()
    big = np.arange(1 << 20, dtype=np.int32)  # 4 MiB a message
    for rid in range(3):
      outbox.reply(peer, rid, None)
      outbox.token(peer, rid, 7, big.astype(np.float32))
      outbox.flush()  # never blocks, though nobody reads yet
    assert peer.pending and not peer.gone
    # The front end reads everything in order once the outbox drains.
    reader, received = wire.Reader(), []
    front_end.settimeout(5)
    while len(received) < 6:
      outbox.drain(peer)
      received += reader.feed(front_end.recv(1 << 20))
    assert [h["op"] for h, _ in received] == ["reply", "step"] * 3
    assert [h["ticket"] for h, _ in received[::2]] == [0, 1, 2]
    np.testing.assert_array_equal(wire.array(received[-1][1][3], np.float32, 1 << 20)[0], big)
    assert not peer.pending
    # A peer that falls MAX_PENDING behind is dropped, its buffers cleared.
    monkeypatch.setattr(process, "MAX_PENDING", 1 << 20)
    for rid in range(4):
      outbox.token(peer, rid, 7, big.astype(np.float32))
      outbox.flush()
    assert peer.gone and not peer.pending
    outbox.reply(peer, 9, None)  # dropped, no error
    assert not peer.pending
  finally:
    core_end.close()
    front_end.close()
