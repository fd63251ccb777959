"""The scheduler's policy without a device: the planner's token-budgeted steps of decode rows and
prompt chunks, admission by blocks, prefix-cache hits by shared blocks and batch-invariant
engines, from a fake config (nothing compiles); the planner module imports no jax."""

import dataclasses
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest

from cg_jax.core.block_pool import BlockPool
from cg_jax.core.step_inputs import StepLayout
from cg_jax.core.step_plan import PlanConfig, Planner, StepPlan


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
  blocks: list[int] = dataclasses.field(default_factory=list)
  prefilled: int = 0
  launched: int = 0
  decoding: bool = False
  finished: bool = False


def _planner(max_batch=8, token_buckets=(8, 16, 32), batch_invariant=False, prefix=False,
             blocks=64, chunk=None):
  config = types.SimpleNamespace(step_rows=max_batch, token_buckets=token_buckets,
                                 prefix_block=4, max_seq_len=64, batch_invariant=batch_invariant,
                                 prefix_blocks=int(prefix),
                                 max_num_batched_tokens=chunk or token_buckets[-1])
  return Planner(PlanConfig.of(config), BlockPool(blocks, 4))


def _run(step: StepPlan | None, running) -> None:
  """What the engine thread does to the host state with a step."""
  if step is None:
    return
  for row, (i, count) in enumerate(zip(step.requests, step.counts)):
    if row >= step.decodes:
      running[i].prefilled += count
  for row in step.emitting:
    running[step.requests[row]].launched += 1
  for row in step.done:
    running[step.requests[row]].decoding = True


def _decoding(length, launched=1, **fields):
  return Request(list(range(1, length + 1)), prefilled=length, decoding=True, launched=launched,
                 **fields)


def test_a_lone_short_prompt_takes_the_smallest_token_bucket():
  running = [Request([5, 6, 7, 8, 9])]
  assert _planner().step(running) == StepPlan(tokens=8, rows=8, logit_rows=8, requests=(0,),
                                              starts=(0,), counts=(5,), decodes=0, done=(0,))


def test_waiting_prompts_share_one_step_unpadded_up_to_the_token_budget():
  running = [Request([1] * 5), Request([2] * 12), Request([3] * 3, settings=SAMPLED)]
  step = _planner().step(running)
  # 20 tokens end to end: the 32-token bucket, no prompt padded to a bucket of its own.
  assert step == StepPlan(tokens=32, rows=8, logit_rows=8, requests=(0, 1, 2),
                          starts=(0, 0, 0), counts=(5, 12, 3), decodes=0, done=(0, 1, 2),
                          sample=True)
  assert step.keys == (("step", 32), ("draw", 8))
  # A budget of 16 tokens: the second prompt's first 11 tokens, the third waits.
  step = _planner(token_buckets=(8, 16)).step(running)
  assert (step.tokens, step.requests, step.counts, step.done) == (16, (0, 1), (5, 11), (0,))
  assert not step.sample


def test_decode_rows_come_first_one_token_each_and_prompts_fill_the_rest():
  # Requests 0 and 3 decode (their last token at position len + launched - 1); the new
  # prompts of 1, 2 and 4 share the step after them.
  running = [_decoding(4), Request([1] * 3), Request([2] * 3), _decoding(5, launched=2),
             Request([3] * 3)]
  step = _planner().step(running)
  assert step == StepPlan(tokens=16, rows=8, logit_rows=8, requests=(0, 3, 1, 2, 4),
                          starts=(4, 6, 0, 0, 0), counts=(1, 1, 3, 3, 3), decodes=2,
                          done=(2, 3, 4))
  assert step.emitting == (0, 1, 2, 3, 4)
  # Decode-only steps take the smallest bucket holding their rows: a step of rows.
  running = [_decoding(4), _decoding(9)]
  assert _planner().step(running) == StepPlan(8, 8, 8, (0, 1), (4, 9), (1, 1), 2, ())
  assert _planner(max_batch=4).step(running).rows == 4


def test_steps_of_64_and_128_rows_share_the_logit_rows_of_one_draw_executable():
  # Up to 256 rows: steps of up to 32 rows have logits of their rows, the 64-row step pads its
  # logits to 128 rows: a sampling row's draw has one executable per logit row count.
  planner = _planner(max_batch=256, token_buckets=(8, 16, 32, 64, 128, 256, 512), blocks=512)
  config = planner.config
  assert [config.logit_rows(t) for t in config.token_buckets] == [8, 16, 32, 128, 128, 256, 256]
  lone = planner.step([Request([1] * 3, settings=SAMPLED)])
  assert (lone.tokens, lone.rows, lone.logit_rows) == (8, 8, 8)
  assert lone.keys == (("step", 8), ("draw", 8))
  many = planner.step([_decoding(4, settings=SAMPLED) for _ in range(40)])
  assert (many.tokens, many.rows, many.logit_rows) == (64, 64, 128)
  assert many.keys == (("step", 64), ("draw", 128))
  # At most max_num_seqs rows.
  assert _planner(max_batch=64, token_buckets=(8, 64)).config.logit_rows(64) == 64


def test_a_long_prompt_is_chunked_beside_the_decode_rows():
  planner = _planner(token_buckets=(8, 16))
  running = [_decoding(4, max_new_tokens=8), Request(list(range(40)))]
  plans = []
  for _ in range(4):
    step = planner.step(running)
    _run(step, running)
    plans.append(step)
  # Each step: the decode row, then 15 prompt tokens while the budget of 16 lasts.
  assert plans == [StepPlan(16, 8, 8, (0, 1), (4, 0), (1, 15), 1, ()),
                   StepPlan(16, 8, 8, (0, 1), (5, 15), (1, 15), 1, ()),
                   StepPlan(16, 8, 8, (0, 1), (6, 30), (1, 10), 1, (1,)),
                   StepPlan(8, 8, 8, (0, 1), (7, 40), (1, 1), 2, ())]


def test_started_prompts_take_their_chunks_before_new_prompts_start():
  running = [Request([1] * 30, prefilled=16), Request([2] * 5), Request([3] * 20, prefilled=8)]
  assert _planner().step(running) == StepPlan(tokens=32, rows=8, logit_rows=8,
                                              requests=(0, 2, 1), starts=(16, 8, 0),
                                              counts=(14, 12, 5), decodes=0, done=(0, 1, 2))
  # With 16 tokens the first started prompt takes 14, the second the last 2.
  assert _planner(token_buckets=(16,)).step(running) == StepPlan(16, 8, 8, (0, 2), (16, 8),
                                                                 (14, 2), 0, (0,))


def test_prefilling_while_a_prompt_has_unlaunched_tokens_or_a_request_waits():
  planner = _planner(token_buckets=(8, 16))
  running = [_decoding(4, max_new_tokens=8), Request(list(range(20)))]
  assert planner.prefilling(running, waiting=[])
  _run(planner.step(running), running)  # 15 of the prompt's 20 tokens
  assert planner.prefilling(running, waiting=[])
  _run(planner.step(running), running)  # its last 5: the prompt is complete
  assert not planner.prefilling(running, waiting=[])
  assert planner.prefilling(running, waiting=[Request([1, 2])])
  # A finished request's prompt is not prefilled any more.
  assert not planner.prefilling([Request([1] * 9, prefilled=3, finished=True)], waiting=[])


def test_requests_whose_launched_steps_cover_their_budget_take_no_row():
  running = [_decoding(3, launched=4), _decoding(6, launched=2), Request([1] * 4, finished=True)]
  assert _planner().step(running).requests == (1,)
  running[1].launched = 4
  assert _planner().step(running) is None
  # A step holds at most max_batch rows: prompts past them wait for the next step.
  running = [_decoding(3), Request([1] * 2), Request([2] * 2)]
  assert _planner(max_batch=2).step(running).requests == (0, 1)


def test_admission_takes_free_places_and_a_whole_life_of_blocks():
  """Blocks of 4 tokens for prompt + max_new_tokens: a request waits (and those behind it)
  until its blocks are free; one that could never fit is refused by `fits`."""
  planner = _planner(blocks=8)
  waiting = [Request([1] * 10, max_new_tokens=6), Request([2] * 3, max_new_tokens=5),
             Request([3] * 2, max_new_tokens=2)]
  # 4 blocks, then 2; the third (1 block) waits behind nothing: 7 of 8 taken.
  admitted = planner.admit(waiting, running=0)
  assert [(len(a.blocks), a.cached) for a in admitted] == [(4, 0), (2, 0), (1, 0)]
  assert len({b for a in admitted for b in a.blocks}) == 7 and planner.pool.available == 1
  assert not planner.admissible([Request([4] * 4, max_new_tokens=4)], running=3)  # needs 2
  assert planner.admit([Request([4] * 4, max_new_tokens=4)], running=3) == ()
  assert planner.admissible([Request([4] * 2, max_new_tokens=2)], running=3)
  assert not planner.admissible(waiting, running=8) and not planner.admissible([], 0)
  assert planner.admit(waiting, running=8) == ()  # no free place
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
  (admission,) = planner.admit([first], running=0)
  first.blocks = list(admission.blocks)
  planner.commit(first)  # its prompt ran
  planner.release(first)
  second = Request(cached + [7, 8, 9, 10])
  (hit,) = planner.admit([second], running=0)
  # The same three blocks (no copy), then fresh ones for the rest of its life (20 tokens).
  assert hit.blocks[:3] == admission.blocks[:3] and hit.cached == 12 and len(hit.blocks) == 5
  second.blocks, second.prefilled = list(hit.blocks), hit.cached
  assert planner.step([second]) == StepPlan(tokens=8, rows=8, logit_rows=8, requests=(0,),
                                            starts=(12,), counts=(4,), decodes=0, done=(0,))
  assert planner.pool.stats()["prefix_cache_hits"] == 1
  # With the prefix cache off, nothing is shared.
  off = _planner()
  (a,) = off.admit([Request(cached + [5])], running=0)
  off.commit(Request(cached + [5], blocks=list(a.blocks)))
  off.pool.release(list(a.blocks))
  assert off.admit([Request(cached + [6])], running=0)[0].cached == 0


def test_batch_invariant_plans_one_prompt_chunk_per_step_beside_the_decode_rows():
  # Chunks of 8 prompt tokens; the one bucket holds a chunk and a decode row per request.
  planner = _planner(max_batch=4, token_buckets=(12,), batch_invariant=True, prefix=True,
                     chunk=8)
  cached = list(range(10, 22))  # 3 blocks: one whole chunk of 8 tokens and a half
  owner = Request(cached + [0])
  owner.blocks = list(planner.admit([owner], 0)[0].blocks)
  planner.commit(owner)
  planner.release(owner)
  running = [Request(cached + [1, 2, 3, 4, 5, 6, 7]), Request([3] * 5)]
  for request, admission in zip(running, planner.admit(running, running=0)):
    request.blocks, request.prefilled = list(admission.blocks), admission.cached
  assert [r.prefilled for r in running] == [8, 0]  # the hit in whole chunks
  steps = []
  while (step := planner.step(running)) is not None and len(steps) < 4:
    steps.append(step)
    _run(step, running)
  # One prompt's whole chunk per step, in steps of the one bucket, decode rows first.
  assert steps == [StepPlan(12, 4, 4, (0,), (8,), (8,), 0, ()),
                   StepPlan(12, 4, 4, (0,), (16,), (3,), 0, (0,)),
                   StepPlan(12, 4, 4, (0, 1), (19, 0), (1, 5), 1, (1,)),
                   StepPlan(12, 4, 4, (0, 1), (20, 5), (1, 1), 2, ())]


def test_emitting_rows_that_ask_for_logprobs_score_their_tokens():
  running = [Request([1] * 4), Request([2] * 40, logprobs=3)]
  step = _planner().step(running)
  assert (step.counts, step.done, step.scored) == ((4, 28), (0,), False)
  _run(step, running)
  step = _planner().step(running)
  assert (step.counts, step.decodes, step.done, step.scored) == ((1, 12), 1, (1,), True)
  assert step.keys == (("step", 16), ("token_logprobs", 8))
  _run(step, running)
  running[1].settings = SAMPLED
  step = _planner().step(running)
  assert step.decodes == 2 and step.keys == (("step", 8), ("draw", 8), ("token_logprobs", 8))


def _packages_imported(module: str) -> str:
  """The jax, jaxlib and cg_jax modules that loading cg_jax/core/`module` alone imports (a
  printed list)."""
  path = pathlib.Path(__file__).parent.parent / "cg_jax" / "core" / module
  code = ("import importlib.util, sys\n"
          f"spec = importlib.util.spec_from_file_location('alone', {str(path)!r})\n"
          "module = sys.modules['alone'] = importlib.util.module_from_spec(spec)\n"
          "spec.loader.exec_module(module)\n"
          "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'cg_jax')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  return out.stdout.strip()


def test_the_planner_and_the_step_layout_import_no_jax():
  assert _packages_imported("step_plan.py") == "[]"
  assert _packages_imported("step_inputs.py") == "[]"


def test_a_steps_index_arrays_pack_into_the_staged_buffer_and_split_back():
  layout = StepLayout(token_buckets=(2, 8, 64), step_rows=4, width=3)
  # The largest step's: 4 lengths, 2 x 64 tokens, 4 tables of 3 blocks, 5 starts, 4 counts.
  assert layout.size == 4 + 2 * 64 + 4 * 3 + 5 + 4
  rng = np.random.default_rng(0)
  for size in layout.token_buckets:
    rows = layout.rows(size)
    arrays = (rng.integers(0, 99, (size,)), rng.integers(-1, 4, (size,)),
              rng.integers(0, 50, (rows, 3)), rng.integers(0, size, (rows + 1,)),
              rng.integers(0, 9, (rows,)), rng.integers(1, 99, (rows,)))
    arrays = tuple(a.astype(np.int32) for a in arrays)
    packed = layout.pack(*arrays)
    assert packed.shape == (layout.size,) and packed.dtype == np.int32
    # the lengths first, at [0, rows) whatever the bucket; zeros where no array lies
    np.testing.assert_array_equal(packed[:rows], arrays[-1])
    assert not packed[rows:4].any() and not packed[layout.length(size):].any()
    for got, want in zip(layout.split(packed, size), arrays):
      np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match=r"a step of 8 tokens takes arrays of shapes"):
    layout.pack(*(np.zeros((8,), np.int32),) * 6)
