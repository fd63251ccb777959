"""Graph modes and layer loops give identical tokens; launch accounting parses real GPU traces."""

import os

import pytest

from cg_jax import Engine, profile
from cg_jax.core.graphs import GRAPH_MODES, compiler_options

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
def test_greedy_tokens_identical_across_modes_and_layer_loops(model):
  base = Engine.from_pretrained(model, batch_buckets=(2,), prompt_buckets=(16,), max_seq_len=48)
  prompts = [[5, 6, 7, 8, 9], [10, 11]]
  reference = base.generate(prompts, max_new_tokens=10, eos_token_id=[])
  for layer_loop in ("scan", "unroll"):
    for mode in GRAPH_MODES:
      engine = base.with_options(graphs=mode, layer_loop=layer_loop)
      assert engine.stats()["xla_options"] == GRAPH_MODES[mode]
      assert engine.generate(prompts, max_new_tokens=10, eos_token_id=[]) == reference, (
          layer_loop, mode)


def test_graph_mode_options():
  assert compiler_options("off") == {"xla_gpu_enable_command_buffer": ""}
  full = compiler_options("full", {"xla_gpu_graph_min_graph_size": 5})
  assert "WHILE" in full["xla_gpu_enable_command_buffer"]
  assert full["xla_gpu_graph_min_graph_size"] == 5
  with pytest.raises(ValueError, match="graphs must be one of"):
    compiler_options("fast")
  # Extra options survive a change of graph mode in with_options.
  engine = Engine.from_pretrained("tiny-gpt2", compiler_options={"xla_gpu_graph_min_graph_size": 3})
  assert engine.with_options(graphs="off").stats()["xla_options"] == {
      "xla_gpu_enable_command_buffer": "", "xla_gpu_graph_min_graph_size": 3}
  with pytest.raises(ValueError, match="layer_loop must be one of"):
    Engine.from_pretrained("tiny-gpt2", layer_loop="vectorised")


def test_parse_recorded_h200_trace_with_one_graph_per_step():
  """gpt2 shape, batch 1, unrolled layers, xla-default: 10 steps recorded on the H200."""
  report = profile.parse_trace(
      os.path.join(FIXTURES, "trace_h200_gpt2_b1_unroll_xla-default.json.gz"), steps=10)
  assert report.kernels_per_step == 296
  assert report.graph_launches_per_step == 1
  assert report.kernel_launches_outside_graphs_per_step == 0
  assert report.dispatch_event == "^PjitFunction"
  assert 0 < report.gpu_busy_us < report.device_window_us
  assert 0 < report.idle_gap_share < 1
  assert report.top_kernels[0][0] == "input_reduce_fusion"


def test_parse_recorded_h200_trace_without_graphs():
  report = profile.parse_trace(
      os.path.join(FIXTURES, "trace_h200_gpt2_b1_unroll_off.json.gz"), steps=10)
  assert report.graph_launches_per_step == 0
  assert report.kernel_launches_outside_graphs_per_step == report.kernels_per_step == 296


def test_parse_synthetic_trace():
  """Hand-computable: two steps, one graph launch each, 3 kernels (one outside a graph)."""
  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
  graph = {"cuda_graph_id": "7"}
  events = meta + [
      {"ph": "X", "pid": 2, "tid": 1, "name": "PjitFunction(jit(decode))", "ts": 0, "dur": 10},
      {"ph": "X", "pid": 2, "tid": 1, "name": "cuGraphLaunch (CudaGraph:1)", "ts": 2, "dur": 5},
      {"ph": "X", "pid": 1, "tid": 3, "name": "fusion_1", "ts": 20, "dur": 10, "args": graph},
      {"ph": "X", "pid": 1, "tid": 3, "name": "fusion_2", "ts": 30, "dur": 10, "args": graph},
      {"ph": "X", "pid": 2, "tid": 1, "name": "PjitFunction(jit(decode))", "ts": 50, "dur": 10},
      {"ph": "X", "pid": 2, "tid": 1, "name": "cuGraphLaunch (CudaGraph:1)", "ts": 52, "dur": 5},
      {"ph": "X", "pid": 1, "tid": 3, "name": "fusion_1", "ts": 60, "dur": 10, "args": graph},
      {"ph": "X", "pid": 1, "tid": 3, "name": "MemcpyDtoH", "ts": 70, "dur": 5, "args": {}},
      {"ph": "X", "pid": 1, "tid": 3, "name": "copy_3", "ts": 90, "dur": 10, "args": {}},
  ]
  report = profile.parse_trace({"traceEvents": events}, steps=2)
  assert report.kernels_per_step == 2.0
  assert report.graph_launches_per_step == 1.0
  assert report.kernel_launches_outside_graphs_per_step == 0.5
  assert report.memcpy_per_step == 0.5
  assert report.host_dispatch_us == 10.0
  assert report.gpu_busy_us == 22.5  # (10 + 10 + 10 + 5 + 10) / 2
  assert report.device_window_us == 40.0  # (100 - 20) / 2
  assert report.idle_gap_share == pytest.approx(1 - 45 / 80)


def test_profile_and_timing_run_on_cpu(tmp_path):
  engine = Engine.from_pretrained("tiny-llama", batch_buckets=(1,), prompt_buckets=(16,),
                                  max_seq_len=64)
  report, path = profile.profile_decode(engine, 1, position=20, steps=3, logdir=str(tmp_path))
  assert os.path.exists(path) and path.startswith(str(tmp_path))
  assert report.steps == 3 and report.graph_launches_per_step == 0  # no GPU here
  timing = profile.time_decode(engine, 1, position=20, steps=4, repeats=2)
  assert timing["step_us"] > 0 and timing["host_dispatch_wall_us"] > 0
  assert profile.time_prefill(engine, 1, 12, repeats=2) > 0
  # The engine still generates correctly after the profiling runs overwrote its cache.
  fresh = Engine.from_pretrained("tiny-llama", batch_buckets=(1,), prompt_buckets=(16,),
                                 max_seq_len=64)
  prompt = [[3, 4, 5]]
  assert engine.generate(prompt, 8, eos_token_id=[]) == fresh.generate(prompt, 8, eos_token_id=[])
  with pytest.raises(ValueError, match="position must be"):
    profile.time_decode(engine, 1, position=63)


def test_copy_overlap_synthetic():
  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}}]
  events = meta + [
      {"ph": "X", "pid": 1, "tid": 1, "name": "fusion", "ts": 0, "dur": 10},
      {"ph": "X", "pid": 1, "tid": 2, "name": "MemcpyDtoH", "ts": 5, "dur": 10},
      {"ph": "X", "pid": 1, "tid": 2, "name": "MemcpyDtoH", "ts": 30, "dur": 4},
  ]
  overlap = profile.copy_overlap({"traceEvents": events})
  assert overlap == {"memcpy_us": 14.0, "overlapped_us": 5.0, "overlap_share": 5.0 / 14.0}
