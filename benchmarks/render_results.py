"""Render committed GPU result rows (benchmarks/results/*.json) as the Markdown tables beside them,
and the cg_jax-against-PyTorch comparison as a table and a PNG plot.

  python benchmarks/render_results.py attention benchmarks/results/attention_h200.json
  python benchmarks/render_results.py io benchmarks/results/io_h200.json
  python benchmarks/render_results.py dispatch benchmarks/results/dispatch_h200.json
  python benchmarks/render_results.py tp benchmarks/results/tp_h200.json
  python benchmarks/render_results.py comparison benchmarks/results/baselines_h200.json \\
      benchmarks/results/graphs_comparison_h200.json

Each writes <first json without .json>.md (comparison: comparison_h200.md and .png; of the
graphs files, later ones override earlier ones' rows of the same cell).
"""

from __future__ import annotations

import json
import os
import sys

HBM_TB_PER_S = 4.2


def _fmt(value, digits=1) -> str:
  return "-" if value is None else f"{value:.{digits}f}"


def _header(rows: list[dict], title: str) -> list[str]:
  first = rows[0]
  commits = sorted({str(r.get("commit")) for r in rows})
  jax_version = next((r["jax_version"] for r in rows if r.get("jax_version")), "-")
  return [f"# {title} ({first.get('gpu')}, jax {jax_version}, "
          f"commit {', '.join(commits)}, {first.get('date')})", ""]


def attention(rows: list[dict]) -> list[str]:
  out = _header(rows, "Pallas attention kernels")
  kernels = [r for r in rows
             if r["kernel"] not in ("mosaic_gpu_fa3_probe", "decode_attention_with_write")]
  probes = [r for r in rows if r["kernel"] == "mosaic_gpu_fa3_probe"]
  steps = [r for r in rows if r["kernel"] == "decode_attention_with_write"]
  if kernels:
    out += ["bfloat16; Llama-3.2-1B heads (32 query / 8 KV heads); every row full length. Per-call "
            "time of 20 back-to-back calls (queue kept full), median of 7; PyTorch "
            "`scaled_dot_product_attention` timed the same way with CUDA events; the best launch "
            "config of the search is shown. Decode: share = valid K/V bytes / time against "
            f"{HBM_TB_PER_S} TB/s (issue goal >= 70% at B=32, T=4096). Prefill (B=4, causal): "
            "TFLOP/s against the ~790 TFLOP/s bf16 matmul ceiling. rel err = max|pallas - jnp "
            "reference| / max|reference|.", "",
            "| kernel | shape | pallas us | XLA us | torch SDPA us | pallas vs torch | share of ceiling "
            "| rel err | config |", "|---|---|---|---|---|---|---|---|---|"]
  for r in kernels:
    decode = r["kernel"] == "decode_attention"
    shape = (f"B={r['batch']} T={r['cache_len']}" if decode
             else f"B={r['batch']} S={r['seq_len']} D={r['head_dim']}")
    share = r["pallas_bandwidth_share"] if decode else r["pallas_share_of_ceiling"]
    torch_us = r.get("torch_sdpa_us")
    ratio = "-" if not torch_us else f"{torch_us / r['pallas_us']:.2f}x"
    config = ", ".join(f"{k}={v}" for k, v in r["pallas_config"].items())
    out.append(f"| {r['kernel']} | {shape} | {_fmt(r['pallas_us'])} | {_fmt(r['xla_us'])} | "
               f"{_fmt(torch_us)} | {ratio} | {100 * share:.1f}% | {r['rel_error_vs_xla']:.1e} | "
               f"{config} |")
  if steps:
    out += ["", "Decode step (`--parts decode-step`): the cache write + attention kernel over every "
            "layer of each model's stacked cache, in one jitted program with the caches donated, "
            "us per layer; default launch config against pinned splits (keys per program) and "
            "warps; share = valid K/V bytes / time against the HBM floor.", "",
            "| model | batch | T | valid keys | default us (split x count) | best us | best config "
            "| floor us | share | every pinned config (us) |", "|---" * 10 + "|"]
    for r in steps:
      config = r["pallas_config"]
      every = ", ".join(f"{k} {v:.1f}" for k, v in r["all_us"].items())
      out.append(f"| {r['model']} | {r['batch']} | {r['cache_len']} | {r['length']} | "
                 f"{_fmt(r['default_us'])} ({r['default_split']} x {r['default_splits']}) | "
                 f"{_fmt(r['pallas_us'])} | split {config['split_size']}"
                 f"{' by length' if config.get('length_splits') else ''}, {config['num_warps']} "
                 f"warps, {config['num_stages']} stages | {_fmt(r['floor_us'])} | "
                 f"{100 * r['pallas_bandwidth_share']:.0f}% | {every} |")
  if probes:
    prefill = {(r["seq_len"], r["head_dim"]): r for r in kernels if r["kernel"] == "flash_attention"}
    out += ["", "Mosaic GPU probe: jax's bundled FlashAttention-3 example kernel "
            "(`jax.experimental.pallas.ops.gpu.attention_mgpu`, float16, causal, block_q 64, best "
            "block_kv; no padding lengths), timed on the same prefill shapes to choose a backend "
            "by measurement. cg_jax does not depend on it.", "",
            "| shape | Mosaic GPU FA3 us | cg_jax Triton flash us | torch SDPA us | Triton / Mosaic |",
            "|---|---|---|---|---|"]
    for r in probes:
      ours = prefill.get((r["seq_len"], r["head_dim"]), {})
      ratio = ("-" if not (ours and r.get("mosaic_us"))
               else f"{ours['pallas_us'] / r['mosaic_us']:.2f}")
      out.append(f"| B={r['batch']} S={r['seq_len']} D={r['head_dim']} | "
                 f"{_fmt(r.get('mosaic_us'))} | {_fmt(ours.get('pallas_us'))} | "
                 f"{_fmt(ours.get('torch_sdpa_us'))} | {ratio} |")
  return out


def io(rows: list[dict]) -> list[str]:
  out = _header(rows, "Host I/O")
  out += ["Transfers: 1 GiB, median of 5. Stream: per-token time of a streamed generation (64 "
          "tokens delivered to Python as they are produced, graphs `full`) against the pipelined "
          "step with no host reads, per read-back lag (0 = synchronous read each step). Swap: "
          "the KV cache of llama-3.2-1b at batch 8 x 4096 to pinned host memory and back.", "",
          "| kind | case | value |", "|---|---|---|"]
  for r in rows:
    if r["kind"] == "transfer":
      out.append(f"| transfer | {r['direction']} {r['host_memory']} | {r['gb_per_s']:.1f} GB/s |")
    elif r["kind"] == "stream":
      out.append(f"| stream | {r['model']} B={r['batch']} lag {r['readback_lag']} | "
                 f"{r['stream_token_us']:.1f} us/token vs step {r['step_us']:.1f} us = "
                 f"{r['stream_over_step']:.3f}x |")
    elif r["kind"] == "offload_in_step":
      out.append(f"| offload inside the decode step | {r['offloaded_bytes'] / 1e9:.2f} GB in "
                 f"{r['steps']} chunks, one per {r['model']} B={r['batch']} step | step "
                 f"{r['step_us']:.1f} us alone, {r['step_during_swap_us']:.1f} us with a chunk; "
                 f"copies {r['memcpy_us']:.0f} us, {100 * r['overlap_share']:.1f}% of it "
                 f"overlapping kernels (profile) |")
    elif r["kind"] == "swap_overlap":
      pool = f", {r['pinned_pool']} pinned pool" if r.get("pinned_pool") else ""
      out.append(f"| swap overlapped with decode | {r['swap_model']} cache swapped out (thread{pool}) "
                 f"while {r['model']} B={r['batch']} decodes | step {r['step_us']:.1f} us alone, "
                 f"{r['step_during_swap_us']:.1f} us during the swap; copies {r['memcpy_us']:.0f} "
                 f"us, {100 * r['overlap_share']:.1f}% of it overlapping kernels (profile) |")
    else:
      out.append(f"| swap | {r['bytes'] / 1e9:.2f} GB | out {r['swap_out_s'] * 1e3:.1f} ms "
                 f"({r['swap_out_gb_per_s']:.1f} GB/s), in {r['swap_in_s'] * 1e3:.1f} ms "
                 f"({r['swap_in_gb_per_s']:.1f} GB/s) |")
  return out


def dispatch(rows: list[dict]) -> list[str]:
  out = _header(rows, "Host dispatch of one decode step")
  out += ["gpt2 shape, batch 1, bfloat16, unrolled layers. dispatch = host time of one step "
          "call into an idle GPU queue (median of 16); trivial = the same for an executable with "
          "the step's arguments and no real work; step = pipelined step time; loop = host time "
          "of one device-loop call (K=16 tokens) into an idle queue, per token; no emitted = "
          "dispatch of the same step returning only its donated state.", "",
          "| variant | XLA options / flags | step us | dispatch us | trivial us | no emitted us "
          "| loop us/token |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    options = ", ".join(f"{k}={v}" for k, v in r.get("extra_options", {}).items())
    options = "; ".join(x for x in (options, r.get("xla_flags", "")) if x) or "-"
    if "error" in r:
      out.append(f"| {r['variant']} | {options} | error: {r['error'][:120]} | | | | |")
    else:
      out.append(f"| {r['variant']} | {options} | {_fmt(r['step_us'])} | "
                 f"{_fmt(r['host_dispatch_wall_us'])} | {_fmt(r['trivial_dispatch_us'])} | "
                 f"{_fmt(r.get('no_emitted_dispatch_us'))} | "
                 f"{_fmt(r.get('loop_dispatch_per_token_us'))} |")
  logs = [f"- {r['variant']}: {r['command_buffer_log']}" for r in rows if r.get("command_buffer_log")]
  if logs:
    out += ["", "XLA's own command-buffer log (`TF_CPP_VMODULE=command_buffer_thunk=3,"
            "command_executor=1`):", ""] + logs
  return out


def tensor_parallel(rows: list[dict]) -> list[str]:
  out = _header(rows, "Tensor-parallel decode step")
  out += [f"bfloat16, random weights, Pallas attention, unrolled layers, KV cache "
          f"{rows[0]['max_seq_len']} long, decode at position {rows[0]['position']}; medians of "
          "pipelined steps. Modes: graphs `full`; `+collectives` adds XLA's COLLECTIVES command "
          "type; `+nccl-graph` also turns XLA's own collective kernels off, so the NCCL "
          "all-reduces are recorded in the graph (`-sync`: synchronous all-reduces). Kernels and "
          "graph launches per step are summed over the devices' traces; floor = the one-GPU HBM "
          "floor over the devices; vs 1 GPU = against the one-GPU row of the same commit; "
          "tokens / logits = greedy tokens equal to, and the full forward's max relative logits "
          "difference from, the one-GPU engine; TTFT = `generate`'s time to first token for "
          "512-token prompts at B=1 / B=8 (where measured).", "",
          "| commit | model | GPUs | mode | batch | step us | floor us | vs 1 GPU | dispatch us | "
          "kernels/step | graph launches/step | idle share | tokens equal | logits rel diff | "
          "TTFT ms B=1 / 8 |",
          "|---" * 15 + "|"]
  one_gpu = {(r.get("commit"), r["model"], r["batch"]): r["step_us"] for r in rows
             if r.get("tensor_parallel") == 1 and r.get("status") != "failed"}
  for r in rows:
    if r.get("status") == "failed":
      out.append(f"| {r.get('commit')} | {r['model']} | {r['tensor_parallel']} | {r['mode']} | "
                 f"failed: {r['error'][:200]} |")
      continue
    base = one_gpu.get((r.get("commit"), r["model"], r["batch"]))
    ratio = "-" if base is None else f"{r['step_us'] / base:.2f}x"
    out.append(f"| {r.get('commit')} | {r['model']} | {r['tensor_parallel']} | {r['mode']} | "
               f"{r['batch']} | "
               f"{r['step_us']:.1f} | {r['floor_us']:.0f} | {ratio} | "
               f"{r['host_dispatch_wall_us']:.1f} | {r['kernels_per_step']:.0f} | "
               f"{r['graph_launches_per_step']:.0f} | {r['idle_gap_share']:.2f} | "
               f"{'yes' if r['tokens_match_one_gpu'] else 'NO'} | "
               f"{r['logits_rel_error_vs_one_gpu']:.1e} | "
               f"{' / '.join(f'{v:.1f}' for v in r.get('ttft_ms', {}).values()) or '-'} |")
  return out


def _cg_jax_rows(paths: list[str]) -> list[dict]:
  """cg_jax's `full`-mode rows with its default cache write and GEMMs, later files overriding
  earlier."""
  rows = []
  for path in paths:
    for r in json.load(open(path)):
      if (r.get("mode") == "full" and r.get("layer_loop") == "unroll"
          and r.get("cache_write") != "scatter" and r.get("gemm", "xla") == "xla"
          and r.get("decode_splits", "fixed") == "fixed" and r.get("decode_qkv", "xla") == "xla"
          and r.get("decode_combine", "xla") == "xla"
          and r.get("status") != "failed"):
        rows.append(dict(r, system=f"cg_jax ({r.get('attention', 'xla')} attention)",
                         max_len=r["max_seq_len"]))
  return rows


def comparison(baseline_path: str, graph_paths: list[str], md_path: str, png_path: str):
  baselines = [dict(r, max_len=r.get("max_len", 1024)) for r in json.load(open(baseline_path))]
  ours = _cg_jax_rows(graph_paths)
  rows = baselines + ours
  floors = {(r["model"], r["max_len"], r["batch"]): r["floor_us"] for r in ours}
  systems = sorted({r["system"] for r in rows}, key=lambda s: (not s.startswith("cg_jax"), s))
  # (model, cache length, batch)
  cells = sorted({(r["model"], r["max_len"], r["batch"]) for r in rows})
  step = {(r["system"], r["model"], r["max_len"], r["batch"]): r.get("step_us") for r in rows}
  out = _header(baselines + ours, "Decode step: cg_jax against PyTorch and HF transformers")
  position = next((r["position"] for r in rows if r.get("position")), "-")
  versions = sorted({f"torch {r['torch_version']}, transformers {r['transformers_version']}"
                     for r in baselines if r.get("torch_version")})
  out += ["bfloat16, random weights (the same files for every system), KV cache T long, decode "
          f"at position {position}; medians; us per step (HF generate: per token); "
          f"{'; '.join(versions) or 'no PyTorch rows'}. cg_jax: graphs `full`, unrolled layers, "
          "pipelined steps (of the graphs files given, later ones override earlier ones' rows "
          "per cell). floor = (weights + valid KV bytes) / 4.2 TB/s. `-` = not run (see the "
          "JSON rows' `status` and `error`).", "",
          "| model | T | batch | floor us | " + " | ".join(systems)
          + " | best cg_jax vs best other |",
          "|---|---|---|---|" + "---|" * len(systems) + "---|"]
  for model, max_len, batch in cells:
    values = [step.get((s, model, max_len, batch)) for s in systems]
    ours_best = min((v for s, v in zip(systems, values) if v and s.startswith("cg_jax")),
                    default=None)
    other_best = min((v for s, v in zip(systems, values) if v and not s.startswith("cg_jax")),
                     default=None)
    ratio = "-" if not (ours_best and other_best) else f"{other_best / ours_best:.2f}x"
    out.append(f"| {model} | {max_len} | {batch} | {_fmt(floors.get((model, max_len, batch)))} | "
               + " | ".join(_fmt(v) for v in values) + f" | {ratio} |")
  ttft = {(r["system"], r["model"], r["max_len"], r["batch"]): r.get("ttft_ms") for r in rows}
  out += ["", "Time to first token (ms): prefill of a 512-token prompt per row and the first "
          "greedy token, on the device (no host read-back); HF generate: one new token.", "",
          "| model | T | batch | " + " | ".join(systems) + " |",
          "|---|---|---|" + "---|" * len(systems)]
  for model, max_len, batch in cells:
    out.append(f"| {model} | {max_len} | {batch} | "
               + " | ".join(_fmt(ttft.get((s, model, max_len, batch)), 2) for s in systems)
               + " |")
  out += ["", "Tokens per second (batch / decode step) and achieved HBM bandwidth (the floor's "
          "bytes, weights + valid KV, over the step: TB/s, and the step as a multiple of the "
          "floor).", "",
          "| model | T | batch | " + " | ".join(systems) + " |",
          "|---|---|---|" + "---|" * len(systems)]
  for model, max_len, batch in cells:
    floor = floors.get((model, max_len, batch))
    entries = []
    for system in systems:
      step_us = step.get((system, model, max_len, batch))
      if not step_us:
        entries.append("-")
        continue
      entry = f"{batch * 1e6 / step_us:.0f} tok/s"
      if floor:
        entry += f", {HBM_TB_PER_S * floor / step_us:.2f} TB/s ({step_us / floor:.1f}x)"
      entries.append(entry)
    out.append(f"| {model} | {max_len} | {batch} | " + " | ".join(entries) + " |")
  with open(md_path, "w") as f:
    f.write("\n".join(out) + "\n")

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cells)), 4.5))
  width = 0.8 / len(systems)
  for i, system in enumerate(systems):
    values = [step.get((system, *cell)) or 0 for cell in cells]
    ax.bar([c + i * width for c in range(len(cells))], values, width, label=system)
  ax.scatter([c + 0.4 - width / 2 for c in range(len(cells))],
             [floors.get(cell, 0) for cell in cells], marker="_", s=400, color="k",
             label="HBM floor", zorder=3)
  ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cells))])
  ax.set_xticklabels([f"{m}\nT={t} B={b}" for m, t, b in cells], fontsize=7)
  ax.set_yscale("log")
  ax.set_ylabel("decode step (us, log)")
  ax.set_title(f"Decode step on {baselines[0].get('gpu')}, bf16, position {position}")
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)


def main(argv: list[str]) -> None:
  kind, paths = argv[0], argv[1:]
  if kind == "comparison":
    directory = os.path.dirname(paths[0])
    comparison(paths[0], paths[1:], os.path.join(directory, "comparison_h200.md"),
               os.path.join(directory, "comparison_h200.png"))
    return
  rows = json.load(open(paths[0]))
  lines = {"attention": attention, "io": io, "dispatch": dispatch,
           "tp": tensor_parallel}[kind](rows)
  with open(paths[0][:-len(".json")] + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main(sys.argv[1:])
