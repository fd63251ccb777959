"""The scheduler's policy without a device: the planner's plans for token-budgeted steps of
prompt chunks, decode batches, row compaction, admission by blocks, prefix-cache hits by shared
blocks and batch-invariant engines, from a fake config (nothing compiles); the planner module
imports no jax."""

import dataclasses
import pathlib
import subprocess
import sys
import types

from cg_jax.core.block_pool import BlockPool
from cg_jax.core.buckets import Buckets
from cg_jax.core.step_plan import DecodePlan, MovePlan, PlanConfig, Planner, StepPlan


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
  blocks: list[int] = dataclasses.field(default_factory=list)
  prefilled: int = 0
  position: int = 0
  emitted: int = 0
  decoding: bool = False
  finished: bool = False


def _planner(batch_sizes=(1, 2, 4, 8), token_buckets=(8, 16, 32), batch_invariant=False,
             prefix=False, blocks=64):
  config = types.SimpleNamespace(buckets=Buckets(batch_sizes, (8,)), token_buckets=token_buckets,
                                 prefix_block=4, max_seq_len=64, batch_invariant=batch_invariant,
                                 prefix_blocks=int(prefix))
  return Planner(PlanConfig.of(config), BlockPool(blocks, 4))


def _slots(*requests):
  for slot, request in enumerate(requests):
    request.slot = slot
  return list(requests)


def _run(step: StepPlan | None, slots) -> None:
  """What the engine thread does to the host state with a step (first token: 1)."""
  if step is not None:
    for slot, count in zip(step.slots, step.counts):
      slots[slot].prefilled += count
    for slot in step.done:
      live = slots[slot]
      live.decoding, live.position, live.emitted = True, len(live.prompt), 1


def _decoding(length, emitted=1, **fields):
  return Request(list(range(1, length + 1)), prefilled=length, decoding=True, position=length,
                 emitted=emitted, **fields)


def test_a_lone_short_prompt_takes_the_smallest_token_bucket():
  slots = _slots(Request([5, 6, 7, 8, 9]))
  assert _planner().step(slots) == StepPlan(tokens=8, rows=8, slots=(0,), starts=(0,),
                                            counts=(5,), done=(0,))


def test_waiting_prompts_share_one_step_unpadded_up_to_the_token_budget():
  slots = _slots(Request([1] * 5), Request([2] * 12), Request([3] * 3, settings=SAMPLED))
  step = _planner().step(slots)
  # 20 tokens end to end: the 32-token bucket, no prompt padded to a bucket of its own.
  assert step == StepPlan(tokens=32, rows=8, slots=(0, 1, 2), starts=(0, 0, 0),
                          counts=(5, 12, 3), done=(0, 1, 2), sample=True)
  assert step.keys == (("step", 32), ("first", 8, False))
  # A budget of 16 tokens: the second prompt's first 11 tokens, the third waits.
  step = _planner(token_buckets=(8, 16)).step(slots)
  assert (step.tokens, step.slots, step.counts, step.done) == (16, (0, 1), (5, 11), (0,))
  assert not step.sample


def test_new_prompts_need_not_hold_consecutive_rows():
  # Rows 0 and 3 decode: the new prompts of rows 1, 2 and 4 share one step (each row writes
  # its own blocks).
  slots = _slots(_decoding(4), Request([1] * 3), Request([2] * 3), _decoding(5), Request([3] * 3))
  step = _planner().step(slots)
  assert (step.key, step.slots, step.counts) == (("step", 16), (1, 2, 4), (3, 3, 3))


def test_a_long_prompt_is_chunked_by_the_token_budget_between_decode_steps():
  planner = _planner(token_buckets=(8, 16))
  slots = _slots(_decoding(4, max_new_tokens=8), Request(list(range(40))))
  plans = []
  for _ in range(3):
    step = planner.step(slots)
    _run(step, slots)
    plans.append((step, planner.decode(slots, in_flight=0)))
  decode_one = DecodePlan(batch=2, slots=(0,), greedy=True, scored=False)
  assert plans == [
      (StepPlan(16, 8, (1,), (0,), (16,), ()), decode_one),
      (StepPlan(16, 8, (1,), (16,), (16,), ()), decode_one),
      (StepPlan(8, 8, (1,), (32,), (8,), (1,)),
       DecodePlan(batch=2, slots=(0, 1), greedy=True, scored=False))]
  assert planner.step(slots) is None


def test_started_prompts_take_their_chunks_before_new_prompts_start():
  slots = _slots(Request([1] * 30, prefilled=16), Request([2] * 5), Request([3] * 20, prefilled=8))
  assert _planner().step(slots) == StepPlan(tokens=32, rows=8, slots=(0, 2, 1),
                                            starts=(16, 8, 0), counts=(14, 12, 5),
                                            done=(0, 2, 1))
  # With 16 tokens the first started prompt takes 14, the second the last 2.
  assert _planner(token_buckets=(16,)).step(slots) == StepPlan(16, 8, (0, 2), (16, 8), (14, 2),
                                                               (0,))


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


def test_finished_requests_free_their_rows_and_the_last_ones_move_in():
  planner = _planner()
  assert planner.moves([False, True, False, False, True]) == MovePlan(freed=(4, 1),
                                                                      order=(0, 3, 2))
  assert planner.moves([True, False, False]) == MovePlan(freed=(0,), order=(2, 1))
  assert planner.moves([False, True, True]) == MovePlan(freed=(2, 1), order=(0,))
  assert planner.moves([False, False]) == MovePlan(freed=(), order=(0, 1))


def test_admission_takes_free_rows_and_a_whole_life_of_blocks():
  """Blocks of 4 tokens for prompt + max_new_tokens: a request waits (and those behind it)
  until its blocks are free; one that could never fit is refused by `fits`."""
  planner = _planner(blocks=8)
  waiting = [Request([1] * 10, max_new_tokens=6), Request([2] * 3, max_new_tokens=5),
             Request([3] * 2, max_new_tokens=2)]
  # 4 blocks, then 2; the third (1 block) waits behind nothing: 7 of 8 taken.
  admitted = planner.admit(waiting, occupied=0)
  assert [(a.slot, len(a.blocks), a.cached) for a in admitted] == [(0, 4, 0), (1, 2, 0), (2, 1, 0)]
  assert len({b for a in admitted for b in a.blocks}) == 7 and planner.pool.available == 1
  assert not planner.admissible([Request([4] * 4, max_new_tokens=4)], occupied=3)  # needs 2
  assert planner.admit([Request([4] * 4, max_new_tokens=4)], occupied=3) == ()
  assert planner.admissible([Request([4] * 2, max_new_tokens=2)], occupied=3)
  assert not planner.admissible(waiting, occupied=8) and not planner.admissible([], 0)
  assert planner.admit(waiting, occupied=8) == ()  # no free row
  for request, admission in zip(waiting, admitted):
    request.blocks = list(admission.blocks)
  planner.release(waiting[0])
  assert planner.pool.available == 5
  assert planner.fits(Request([1] * 30, max_new_tokens=2))  # 8 blocks: the whole pool
  assert not planner.fits(Request([1] * 30, max_new_tokens=3))


def test_a_prefix_hit_shares_the_cached_blocks_and_skips_their_tokens():
  planner = _planner(prefix=True)
  cached = list(range(10, 22))  # 3 blocks
  first = Request(cached + [5])
  (admission,) = planner.admit([first], occupied=0)
  first.blocks = list(admission.blocks)
  planner.commit(first)  # its prompt ran
  planner.release(first)
  second = Request(cached + [7, 8, 9, 10])
  (hit,) = planner.admit([second], occupied=0)
  # The same three blocks (no copy), then fresh ones for the rest of its life (20 tokens).
  assert hit.blocks[:3] == admission.blocks[:3] and hit.cached == 12 and len(hit.blocks) == 5
  second.blocks, second.prefilled = list(hit.blocks), hit.cached
  assert planner.step(_slots(second)) == StepPlan(tokens=8, rows=8, slots=(0,), starts=(12,),
                                                  counts=(4,), done=(0,))
  assert planner.pool.stats()["prefix_cache_hits"] == 1
  # With the prefix cache off, nothing is shared.
  off = _planner()
  (a,) = off.admit([Request(cached + [5])], occupied=0)
  off.commit(Request(cached + [5], blocks=list(a.blocks)))
  off.pool.release(list(a.blocks))
  assert off.admit([Request(cached + [6])], occupied=0)[0].cached == 0


def test_batch_invariant_plans_one_prompt_per_call_in_whole_chunks():
  planner = _planner(batch_sizes=(1, 2, 4), token_buckets=(8,), batch_invariant=True,
                     prefix=True)
  cached = list(range(10, 22))  # 3 blocks: one whole chunk of 8 tokens and a half
  owner = Request(cached + [0])
  owner.blocks = list(planner.admit([owner], 0)[0].blocks)
  planner.commit(owner)
  planner.release(owner)
  slots = [Request(cached + [1, 2, 3, 4, 5, 6, 7]), Request([3] * 5)]
  for request, admission in zip(slots, planner.admit(slots, occupied=0)):
    request.slot, request.blocks, request.prefilled = (admission.slot, list(admission.blocks),
                                                       admission.cached)
  assert [r.prefilled for r in slots] == [8, 0]  # the hit in whole chunks
  chunks = []
  while (step := planner.step(slots)) is not None:
    chunks.append(step)
    _run(step, slots)
  # One request per step, in steps of the one bucket.
  assert chunks == [StepPlan(8, 4, (0,), (8,), (8,), ()), StepPlan(8, 4, (0,), (16,), (3,), (0,)),
                    StepPlan(8, 4, (1,), (0,), (5,), (1,))]
  # Decode steps take the batch bucket of the occupied slots (the executables pad their
  # products to the largest one).
  assert planner.decode(slots, 0) == DecodePlan(batch=2, slots=(0, 1), greedy=True,
                                                scored=False)


def test_completing_rows_that_ask_for_logprobs_score_their_first_token():
  slots = _slots(Request([1] * 4), Request([2] * 40, logprobs=3))
  step = _planner().step(slots)
  assert (step.counts, step.done, step.scored) == ((4, 28), (0,), False)
  _run(step, slots)
  step = _planner().step(slots)
  assert (step.counts, step.done, step.scored) == ((12,), (1,), True)
  assert step.keys == (("step", 16), ("token_logprobs", 8))


def test_the_planner_imports_no_jax():
  path = pathlib.Path(__file__).parent.parent / "cg_jax" / "core" / "step_plan.py"
  code = ("import importlib.util, sys\n"
          f"spec = importlib.util.spec_from_file_location('plan', {str(path)!r})\n"
          "module = sys.modules['plan'] = importlib.util.module_from_spec(spec)\n"
          "spec.loader.exec_module(module)\n"
          "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'cg_jax')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"
