"""The scheduler's policy without a device: the planner's plans for prompts, chunks, decode
batches, slot moves, admission, prefix-cache hits and batch-invariant engines, against a fake
executable table (nothing compiles); the planner module imports no jax."""

import dataclasses
import pathlib
import subprocess
import sys
import types

from cg_jax.core.buckets import Buckets
from cg_jax.core.prefix_cache import PrefixIndex
from cg_jax.core.step_plan import (ChunkPlan, CopyPlan, DecodePlan, MovePlan, PlanConfig, Planner,
                                   PrefillPlan)


@dataclasses.dataclass(frozen=True)
class Settings:
  greedy: bool


GREEDY, SAMPLED = Settings(greedy=True), Settings(greedy=False)


@dataclasses.dataclass
class Request:
  """The request state the planner reads (`step_plan.Scheduled`)."""

  prompt: list[int]
  max_new_tokens: int = 4
  settings: Settings = GREEDY
  logprobs: int | None = None
  slot: int | None = None
  prefilled: int = 0
  looked_up: bool = False
  position: int = 0
  emitted: int = 0
  decoding: bool = False
  finished: bool = False


class FakeTable:
  """The two fields of an `ExecutableTable` the plan config reads."""

  def __init__(self, prompt_batches, block_pairs=3):
    self._batches, self._pairs = prompt_batches, block_pairs

  def prompt_batches(self):
    return self._batches

  def block_pairs(self):
    return self._pairs


def _planner(batch_sizes=(1, 2, 4, 8), prompt_lengths=(8, 16), prompt_batches=(1, 2, 4, 8),
             batch_invariant=False, prefix=None, block_pairs=3, lookahead=16, **fields):
  config = types.SimpleNamespace(buckets=Buckets(batch_sizes, prompt_lengths), prefix_block=4,
                                 batch_invariant=batch_invariant)
  plan_config = PlanConfig.of(config, FakeTable(prompt_batches, block_pairs), lookahead)
  return Planner(dataclasses.replace(plan_config, **fields), prefix)


def _slots(*requests):
  for slot, request in enumerate(requests):
    request.slot = slot
  return list(requests)


def _run(plan: PrefillPlan, slots) -> None:
  """What the engine thread does to the host state with a prefill plan (first token: 1)."""
  for slot, cached in plan.lookups:
    slots[slot].looked_up, slots[slot].prefilled = True, cached
  if plan.chunk is not None:
    for slot, count in zip(plan.chunk.slots, plan.chunk.counts):
      slots[slot].prefilled += count
    for slot in plan.chunk.done:
      live = slots[slot]
      live.decoding, live.position, live.emitted = True, len(live.prompt), 1


def _decoding(length, emitted=1, **fields):
  return Request(list(range(1, length + 1)), prefilled=length, decoding=True, position=length,
                 emitted=emitted, **fields)


def test_a_lone_short_prompt_takes_the_smallest_prompt_bucket():
  slots = _slots(Request([5, 6, 7, 8, 9]))
  assert _planner().prefill(slots) == PrefillPlan(
      loads=CopyPlan("load"),
      chunk=ChunkPlan("prompts", rows=1, size=8, first_slot=0, slots=(0,), starts=(0,),
                      counts=(5,), done=(0,)))


def test_waiting_prompts_share_one_call_of_the_batch_bucket_that_holds_them():
  slots = _slots(Request([1] * 5), Request([2] * 12), Request([3] * 3, settings=SAMPLED))
  chunk = _planner().prefill(slots).chunk
  assert chunk == ChunkPlan("prompts", rows=4, size=16, first_slot=0, slots=(0, 1, 2),
                            starts=(0, 0, 0), counts=(5, 12, 3), done=(0, 1, 2), sample=True)
  assert chunk.keys == (("prompts", 4, 16), ("first", 4, False))
  # The padded-token budget (2 largest buckets: 32 tokens) stops the group at 2 rows of 16.
  assert _planner(prefill_tokens=2).prefill(slots).chunk.slots == (0, 1)
  # A prompt-batch bucket bounds the group too.
  assert _planner(prompt_batches=(1, 2)).prefill(slots).chunk.key == ("prompts", 2, 16)


def test_new_prompts_write_only_free_rows_of_consecutive_slots():
  # Slot 3 decodes: a padding row must not write it, so slots 1 and 2 take a 2-row call.
  slots = _slots(_decoding(4), Request([1] * 3), Request([2] * 3), _decoding(5), Request([3] * 3))
  chunk = _planner().prefill(slots).chunk
  assert (chunk.key, chunk.first_slot, chunk.slots) == (("prompts", 2, 8), 1, (1, 2))
  assert _planner().prefill(_slots(*slots[:3], slots[4])).chunk.slots == (1, 2, 3)


def test_a_long_prompt_is_chunked_between_decode_steps():
  planner = _planner()
  slots = _slots(_decoding(4, max_new_tokens=8), Request(list(range(40))))
  plans = []
  for _ in range(3):
    prefill = planner.prefill(slots)
    _run(prefill, slots)
    plans.append((prefill.chunk, planner.decode(slots, in_flight=0)))
  decode_one = DecodePlan(batch=2, slots=(0,), greedy=True, scored=False)
  assert plans == [
      (ChunkPlan("prompts", 1, 16, 1, (1,), (0,), (16,), ()), decode_one),
      (ChunkPlan("chunk", 1, 16, 1, (1,), (16,), (16,), ()), decode_one),
      (ChunkPlan("chunk", 1, 8, 1, (1,), (32,), (8,), (1,)),
       DecodePlan(batch=2, slots=(0, 1), greedy=True, scored=False))]
  assert planner.prefill(slots) == PrefillPlan()


def test_started_prompts_take_their_chunks_before_new_prompts_start():
  slots = _slots(Request([1] * 30, prefilled=16), Request([2] * 5), Request([3] * 20, prefilled=8))
  chunk = _planner().prefill(slots).chunk
  assert chunk == ChunkPlan("chunk", rows=2, size=16, first_slot=0, slots=(0, 2), starts=(16, 8),
                            counts=(14, 12), done=(0, 2))


def test_decode_takes_the_smallest_batch_bucket_over_the_occupied_slots():
  planner = _planner()
  slots = _slots(_decoding(3), Request([1] * 20, prefilled=16), _decoding(6))
  assert planner.decode(slots, 0) == DecodePlan(batch=4, slots=(0, 2), greedy=True,
                                                scored=False)
  assert planner.decode(slots[:1], 0).key == ("decode", 1, True)
  slots[2].settings = SAMPLED
  assert planner.decode(slots, 0).key == ("decode", 4, False)
  slots[0].logprobs = 2
  assert planner.decode(slots, 0).key == ("logprobs", 4)
  # Three steps in flight cover every row's budget (4 tokens, 1 emitted): launch nothing.
  assert planner.decode(slots, 2).launch and not planner.decode(slots, 3).launch
  slots[0].finished = slots[2].finished = True
  assert planner.decode(slots, 0) is None


def test_finished_requests_free_their_slots_and_the_last_ones_move_in():
  planner = _planner()
  assert planner.moves([False, True, False, False, True]) == MovePlan(
      freed=(4, 1), moves=((3, 1),), order=(0, 3, 2))
  assert planner.moves([True, False, False]) == MovePlan(freed=(0,), moves=((2, 0),),
                                                         order=(2, 1))
  # A batch that finished together moves nothing.
  assert planner.moves([False, True, True]) == MovePlan(freed=(2, 1), moves=(), order=(0,))
  assert planner.moves([False, False]) == MovePlan(freed=(), moves=(), order=(0, 1))


def test_admission_fills_the_free_slots_only():
  planner = _planner()
  assert planner.admit(waiting=5, occupied=6) == (6, 7)
  assert planner.admit(waiting=2, occupied=1) == (1, 2)
  assert planner.admit(waiting=3, occupied=8) == ()
  assert planner.admit(waiting=0, occupied=0) == ()


def test_prefix_hits_load_their_blocks_and_skip_the_cached_tokens():
  index = PrefixIndex(blocks=8, block=4)
  cached = list(range(10, 22))  # 3 blocks
  assert index.insert(cached) == [0, 1, 2]
  planner = _planner(prefix=index, block_pairs=2)
  slots = _slots(Request(cached + [7, 8, 9, 10]), Request([99] * 6))
  plan = planner.prefill(slots)
  assert plan == PrefillPlan(
      lookups=((0, 12), (1, 0)),
      loads=CopyPlan("load", (((0, 0, 0), (0, 1, 1)), ((0, 2, 2),))),
      chunk=ChunkPlan("chunk", rows=1, size=8, first_slot=0, slots=(0,), starts=(12,),
                      counts=(4,), done=(0,)))
  _run(plan, slots)
  # The miss asked once; it starts the next iteration. The completed prompt saves its new block.
  assert planner.prefill(slots) == PrefillPlan(chunk=ChunkPlan(
      "prompts", rows=1, size=8, first_slot=1, slots=(1,), starts=(0,), counts=(6,), done=(1,)))
  assert planner.saves(slots[:1]) == CopyPlan("save", (((0, 3, 3),),))
  assert index.stats()["prefix_cache_hits"] == 1


def test_only_the_prompts_next_in_line_ask_the_prefix_cache():
  index = PrefixIndex(blocks=8, block=4)
  slots = _slots(*(Request([slot] * 6) for slot in range(3)))
  assert _planner(prefix=index, lookahead=2).prefill(slots).lookups == ((0, 0), (1, 0))


def test_batch_invariant_plans_one_prompt_per_call_in_whole_chunks():
  index = PrefixIndex(blocks=8, block=4)
  cached = list(range(10, 22))  # 3 blocks: one whole chunk of 8 tokens and a half
  index.insert(cached)
  planner = _planner(batch_sizes=(1, 2, 4), prompt_lengths=(8,), prompt_batches=(1,),
                     batch_invariant=True, prefix=index)
  slots = _slots(Request(cached + [1, 2, 3, 4, 5, 6, 7]), Request([3] * 5))
  plan = planner.prefill(slots)
  assert plan == PrefillPlan(
      lookups=((0, 8), (1, 0)), loads=CopyPlan("load", (((0, 0, 0), (0, 1, 1)),)),
      chunk=ChunkPlan("chunk", rows=1, size=8, first_slot=0, slots=(0,), starts=(8,),
                      counts=(8,), done=()))
  _run(plan, slots)
  chunks = []
  while (chunk := planner.prefill(slots).chunk) is not None:
    chunks.append(chunk)
    _run(PrefillPlan(chunk=chunk), slots)
  assert chunks == [ChunkPlan("chunk", 1, 8, 0, (0,), (16,), (3,), (0,)),
                    ChunkPlan("prompts", 1, 8, 1, (1,), (0,), (5,), (1,))]
  # Decode steps take the batch bucket of the occupied slots (the executables pad their
  # products to the largest one).
  assert planner.decode(slots, 0) == DecodePlan(batch=2, slots=(0, 1), greedy=True,
                                                scored=False)


def test_completing_rows_that_ask_for_logprobs_score_their_first_token():
  slots = _slots(Request([1] * 20, logprobs=3), Request([2] * 4, logprobs=3))
  chunk = _planner().prefill(slots).chunk
  assert (chunk.done, chunk.scored) == ((1,), True)
  assert chunk.keys == (("prompts", 2, 16), ("token_logprobs", 2))


def test_the_planner_imports_no_jax():
  path = pathlib.Path(__file__).parent.parent / "cg_jax" / "core" / "step_plan.py"
  code = ("import importlib.util, sys\n"
          f"spec = importlib.util.spec_from_file_location('plan', {str(path)!r})\n"
          "module = sys.modules['plan'] = importlib.util.module_from_spec(spec)\n"
          "spec.loader.exec_module(module)\n"
          "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'cg_jax')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"
