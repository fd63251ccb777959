"""Round trip of one small message between two processes (encoded and decoded with
`cg_jax.core.wire` at both ends, the echo answering what it decoded): ZMQ PUSH/PULL IPC sockets
(as the engine-core process used them before 2026-12-07: a polling main thread each side)
against one Unix-domain stream socket (today's transport). Needs pyzmq
(not a cg_jax dependency any more). Prints the median and 90th percentile of each, in us.

  python benchmarks/transport_pingpong.py [--count 2000]
"""
import argparse
import multiprocessing
import os
import socket
import statistics
import tempfile
import time

import numpy as np
import zmq

from cg_jax.core import wire


def _answer(reader: wire.Reader, data: bytes) -> list[bytes]:
  """The echo's replies to what it read: each message decoded and encoded again."""
  return [wire.encode(header, *(np.frombuffer(b, np.int32) for b in buffers))
          for header, buffers in reader.feed(data)]


def _zmq_echo(directory: str) -> None:
  context = zmq.Context()
  inbox = context.socket(zmq.PULL)
  inbox.bind(f"ipc://{directory}/core")
  outbox = context.socket(zmq.PUSH)
  outbox.connect(f"ipc://{directory}/front")
  reader = wire.Reader()
  while True:
    if inbox.poll(100):
      for answer in _answer(reader, inbox.recv(copy=True)):
        outbox.send(answer, copy=False)


def _socket_echo(address: str) -> None:
  listener = wire.listen(address)
  sock, _ = listener.accept()
  wire.configure(sock)
  reader = wire.Reader()
  while data := sock.recv(1 << 20):
    for answer in _answer(reader, data):
      sock.sendall(answer)


def _time(round_trip, count: int) -> list[float]:
  times = []
  for _ in range(count):
    start = time.perf_counter()
    round_trip()
    times.append(time.perf_counter() - start)
    time.sleep(0.0005)
  return times


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--count", type=int, default=2000)
  args = parser.parse_args()
  spawn = multiprocessing.get_context("spawn")
  directory = tempfile.mkdtemp(prefix="cg_jax-pingpong-")
  header, prompt = {"op": "add", "id": 1, "max_new_tokens": 128}, np.arange(256, dtype=np.int32)

  echo = spawn.Process(target=_zmq_echo, args=(directory,), daemon=True)
  echo.start()
  context = zmq.Context()
  inbox = context.socket(zmq.PULL)
  inbox.bind(f"ipc://{directory}/front")
  outbox = context.socket(zmq.PUSH)
  outbox.connect(f"ipc://{directory}/core")
  time.sleep(1)
  zmq_reader = wire.Reader()

  def zmq_round_trip():
    outbox.send(wire.encode(header, prompt), copy=False)
    inbox.poll(1000)
    assert zmq_reader.feed(inbox.recv(copy=True))

  echo2 = spawn.Process(target=_socket_echo, args=(os.path.join(directory, "sock"),),
                        daemon=True)
  echo2.start()
  time.sleep(1)
  sock = wire.connect(os.path.join(directory, "sock"))
  reader = wire.Reader()

  def socket_round_trip():
    sock.sendall(wire.encode(header, prompt))
    while not reader.feed(sock.recv(1 << 20)):
      pass

  for name, round_trip in (("zmq PUSH/PULL", zmq_round_trip), ("unix socket", socket_round_trip)):
    times = sorted(_time(round_trip, args.count))
    print(f"{name:14s} round trip: median {statistics.median(times) * 1e6:6.1f} us, "
          f"p90 {times[int(0.9 * len(times))] * 1e6:6.1f} us")


if __name__ == "__main__":
  main()
