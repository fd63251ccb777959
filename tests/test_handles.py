"""`Group` and `Handle` without an engine: tokens emitted from another thread (as the engine
thread or the core client's reader does) reach asyncio consumers, in order, all of them, and a
step that gives many requests a token wakes their loop once."""

import asyncio
import threading

import pytest

from cg_jax.handles import Group, Handle


def _handles(count: int) -> list[Handle]:
  return [Handle(Group([3], lambda: None), None, ()) for _ in range(count)]


def _steps(handles: list[Handle], tokens: int, fail: int | None = None) -> None:
  """Each step gives every request its next token; request `fail` fails half-way."""
  for step in range(tokens):
    for index, handle in enumerate(handles):
      if index == fail and step == tokens // 2:
        handle._group._fail(ValueError("boom"))
      elif not handle.done:
        handle._group._emit({0: index * 1000 + step}, {})
  for handle in handles:
    handle._group._finish(0, "length")


async def _collect(handle: Handle) -> list[int]:
  return [delta.token async for delta in handle]


def test_async_consumers_get_every_token_in_order():
  async def main():
    handles = _handles(8)
    consumers = [asyncio.create_task(_collect(h)) for h in handles]
    await asyncio.sleep(0)  # (they watch before the first token)
    thread = threading.Thread(target=_steps, args=(handles, 500))
    thread.start()
    results = await asyncio.gather(*consumers)
    thread.join()
    return results

  results = asyncio.run(main())
  assert results == [[index * 1000 + step for step in range(500)] for index in range(8)]


def test_a_failed_request_raises_and_the_others_finish():
  async def main():
    handles = _handles(4)
    consumers = [asyncio.create_task(_collect(h)) for h in handles]
    await asyncio.sleep(0)
    thread = threading.Thread(target=_steps, args=(handles, 100, 2))
    thread.start()
    results = await asyncio.gather(*consumers, return_exceptions=True)
    thread.join()
    return results

  results = asyncio.run(main())
  assert isinstance(results[2], ValueError) and str(results[2]) == "boom"
  for index in (0, 1, 3):
    assert results[index] == [index * 1000 + step for step in range(100)]


def test_a_step_for_many_requests_wakes_the_loop_once():
  async def main():
    handles = _handles(16)
    loop = asyncio.get_running_loop()
    calls = []
    original = loop.call_soon_threadsafe

    def counted(*args, **kwargs):
      calls.append(args)
      return original(*args, **kwargs)

    loop.call_soon_threadsafe = counted
    ready = asyncio.Event()
    for handle in handles:
      handle.watch(ready)
    # One step from another thread while the loop is held here: one wake-up for the 16.
    thread = threading.Thread(target=lambda: [h._group._emit({0: 7}, {}) for h in handles])
    thread.start()
    thread.join()
    assert len(calls) == 1
    await asyncio.wait_for(ready.wait(), 5)
    deltas = [h.poll() for h in handles]
    assert [([d.token for d in ds], ended) for ds, ended in deltas] == [([7], False)] * 16
    # The next step after the loop ran the first wake-up: one more.
    ready.clear()
    thread = threading.Thread(target=lambda: [h._group._emit({0: 8}, {}) for h in handles])
    thread.start()
    thread.join()
    await asyncio.wait_for(ready.wait(), 5)
    assert len(calls) == 2

  asyncio.run(main())


def test_poll_after_the_end_returns_nothing_more():
  async def main():
    (handle,) = _handles(1)
    handle._group._emit({0: 5}, {})
    handle._group._finish(0, "stop")
    assert [d.token for d in handle.poll()[0]] == [5]
    assert handle.poll() == ([], True)

  asyncio.run(main())


@pytest.mark.parametrize("closed_first", [True, False])
def test_a_closed_loop_does_not_break_the_emitter(closed_first):
  loop = asyncio.new_event_loop()
  (handle,) = _handles(1)

  async def watch():
    handle.watch(asyncio.Event())

  loop.run_until_complete(watch())
  if closed_first:
    loop.close()
  handle._group._emit({0: 1}, {})  # (no exception: nobody listens any more)
  handle._group._finish(0, "length")
  if not closed_first:
    loop.close()
  assert handle.result().tokens == [1]
