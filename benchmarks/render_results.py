"""Render committed GPU result rows (benchmarks/results/) as the Markdown tables beside them.

  python benchmarks/render_results.py bench benchmarks/results/bench_h200.jsonl [more.jsonl ...]
  python benchmarks/render_results.py attention benchmarks/results/attention_h200.json
  python benchmarks/render_results.py io benchmarks/results/io_h200.json
  python benchmarks/render_results.py tp benchmarks/results/tp_h200.json

`bench` reads `python -m cg_jax bench` rows and the peers' (benchmarks/torch_peers.py), writes
the decode-step, `generate`, throughput, serving and start-up tables to <first file>.md and
rewrites the README's and benchmarks/README.md's marked blocks (<!-- bench:NAME --> ...
<!-- /bench:NAME -->) with them. The others write <json without .json>.md.
"""

from __future__ import annotations

import json
import os
import re
import sys

from cg_jax.bench import rows as cg_rows

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


# ------------------------------------------------------------------------------------------------
# `python -m cg_jax bench` rows and the peers' (benchmarks/torch_peers.py): the headline tables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The files whose marked blocks `bench` regenerates: <!-- bench:NAME --> ... <!-- /bench:NAME -->.
READMES = (os.path.join(ROOT, "README.md"), os.path.join(ROOT, "benchmarks", "README.md"))
BLOCK = re.compile(r"(<!-- bench:(\w+) -->\n).*?(<!-- /bench:\2 -->)", re.DOTALL)


def _name(row) -> str:
  return os.path.basename(row.model.rstrip("/"))


def _p50(row, figure: str, digits: int = 2) -> str:
  value = row.figures.get(f"{figure}_p50", row.figures.get(figure))
  return _fmt(value, digits)


def _where(found) -> str:
  """One line naming the device, versions, commits and dates of `found` rows."""
  software = sorted({f"{k} {v}" for r in found for k, v in r.software.items()})
  return (f"{', '.join(sorted({r.device for r in found}))}; jax "
          f"{', '.join(sorted({r.jax for r in found}))}"
          + (f", {', '.join(software)}" if software else "")
          + f"; commit {', '.join(sorted({r.commit for r in found}))}; "
          f"{', '.join(sorted({r.date for r in found}))}.")


def _is_ours(row) -> bool:
  return row.system == "cg_jax"


def decode_table(found) -> list[str]:
  """The decode step per (model, cache length, batch): cg_jax, the best peer, their ratio and
  the HBM floor (step_bytes / 4.2 TB/s)."""
  cells: dict[tuple, dict] = {}
  for r in found:
    if r.workload.get("kind") == "latency" and "step_us" in r.figures:
      cell = (_name(r), r.workload["max_seq_len"], r.workload["batch"])
      cells.setdefault(cell, {})[r.system] = r
  out = ["| model | T | B | cg_jax us | best peer us | peer / cg_jax | HBM floor us "
         "| cg_jax / floor |", "|---|---|---|---|---|---|---|---|"]
  for (model, length, batch), systems in sorted(cells.items()):
    ours = systems.get("cg_jax")
    peers = [r for s, r in systems.items() if s != "cg_jax"]
    best = min(peers, key=lambda r: r.figures["step_us"], default=None)
    floor = (ours.figures["step_bytes"] / (HBM_TB_PER_S * 1e12) * 1e6
             if ours and "step_bytes" in ours.figures else None)
    step = ours.figures["step_us"] if ours else None
    out.append(
        f"| {model} | {length} | {batch} | {_fmt(step)} | "
        + (f"{best.figures['step_us']:.1f} ({best.system})" if best else "-") + " | "
        + (f"{best.figures['step_us'] / step:.2f}x" if best and step else "-")
        + f" | {_fmt(floor)} | " + (f"{step / floor:.2f}x" if step and floor else "-") + " |")
  return out


def latency_table(found) -> list[str]:
  """What one `generate` call gives each system (medians over the calls)."""
  out = ["| model | T | B | system | TTFT ms | per token ms | tokens/s | tokens/s vs cg_jax |",
         "|---|---|---|---|---|---|---|---|"]
  groups: dict[tuple, list] = {}
  for r in found:
    if r.workload.get("kind") == "latency":
      key = (_name(r), r.workload["max_seq_len"], r.workload["batch"])
      groups.setdefault(key, []).append(r)
  for (model, length, batch), group in sorted(groups.items()):
    ours = next((r for r in group if _is_ours(r)), None)
    for r in sorted(group, key=lambda r: (not _is_ours(r), r.system)):
      ratio = ("-" if ours is None or r is ours else
               f"{r.figures['tokens_per_s_p50'] / ours.figures['tokens_per_s_p50']:.2f}x")
      out.append(f"| {model} | {length} | {batch} | {r.system} | {_p50(r, 'ttft_ms')} | "
                 f"{_p50(r, 'tpot_ms', 3)} | {_p50(r, 'tokens_per_s', 0)} | {ratio} |")
  return out


def _request_key(r) -> tuple:
  w = r.workload
  return (_name(r), w["num_requests"], w["prompt_len"], w["output_len"], str(w["rate"]))


def throughput_table(found) -> list[str]:
  """Requests through each system's continuous batching, against cg_jax's."""
  groups: dict[tuple, list] = {}
  for r in found:
    if r.workload.get("kind") == "throughput":
      groups.setdefault(_request_key(r), []).append(r)
  out = ["| model | requests | prompt tokens | output tokens | system | tokens/s | vs cg_jax "
         "| TTFT p50 / p99 ms | TPOT p50 / p99 ms |", "|---|---|---|---|---|---|---|---|---|"]
  for (model, count, prompt, output, _), group in sorted(groups.items()):
    ours = next((r for r in group if _is_ours(r)), None)
    for r in sorted(group, key=lambda r: (not _is_ours(r), r.system)):
      f = r.figures
      ratio = "-" if ours is None or r is ours else (
          f"{f['tokens_per_s'] / ours.figures['tokens_per_s']:.3g}x")
      out.append(f"| {model} | {count} | {prompt} | {output} | {r.system} | "
                 f"{f['tokens_per_s']:.0f} | {ratio} | {_fmt(f.get('ttft_ms_p50'))} / "
                 f"{_fmt(f.get('ttft_ms_p99'))} | {_fmt(f.get('tpot_ms_p50'), 3)} / "
                 f"{_fmt(f.get('tpot_ms_p99'), 3)} |")
  return out


def serve_table(found) -> list[str]:
  """`bench serve` against a live `serve`, beside the in-process `bench throughput` row of the
  same requests at the same commit (the same run)."""
  inside = {(_request_key(r), r.commit): r for r in found
            if r.workload.get("kind") == "throughput" and _is_ours(r)}
  out = ["| model | requests | client processes | HTTP tokens/s | in-process tokens/s | ratio "
         "| TTFT p50 ms HTTP / in-process | TPOT p50 ms HTTP / in-process | errors |",
         "|---|---|---|---|---|---|---|---|---|"]
  served = [r for r in found if r.workload.get("kind") == "serve"]
  for r in sorted(served, key=lambda r: (_name(r), -r.workload["num_requests"])):
    base = inside.get((_request_key(r), r.commit))
    f, g = r.figures, base.figures if base else {}
    ratio = f"{f['tokens_per_s'] / g['tokens_per_s']:.2f}x" if base else "-"
    out.append(f"| {_name(r)} | {r.workload['num_requests']} | {r.workload.get('clients', 1)} | "
               f"{f['tokens_per_s']:.0f} | {_fmt(g.get('tokens_per_s'), 0)} | {ratio} | "
               f"{_fmt(f.get('ttft_ms_p50'))} / {_fmt(g.get('ttft_ms_p50'))} | "
               f"{_fmt(f.get('tpot_ms_p50'), 3)} / {_fmt(g.get('tpot_ms_p50'), 3)} | "
               f"{f.get('errors', 0):.0f} |")
  return out


def startup_table(found) -> list[str]:
  out = ["| model | what | cache | until ready s | first answer s | own decode steps s |",
         "|---|---|---|---|---|---|"]
  for r in found:
    if r.workload.get("kind") == "startup":
      f = r.figures
      ready = f.get("ready_s", f.get("warmup_s"))
      out.append(f"| {_name(r)} | {r.workload['which']} | {r.workload['cache']} | "
                 f"{_fmt(ready)} | {_fmt(f.get('first_answer_s'))} | "
                 f"{_fmt(f.get('final_steps_s'))} |")
  return out


TABLES = {"decode": decode_table, "latency": latency_table, "throughput": throughput_table,
          "serve": serve_table, "startup": startup_table}


def bench_blocks(found) -> dict[str, str]:
  """Each table with rows, as a Markdown block: its source line, then the table."""
  blocks = {}
  for name, table in TABLES.items():
    lines = table(found)
    if len(lines) > 2:
      blocks[name] = f"{_where(found)}\n\n" + "\n".join(lines) + "\n"
  return blocks


def replace_blocks(path: str, blocks: dict[str, str]) -> list[str]:
  """Rewrite the marked blocks of `path` that `blocks` has; returns the names rewritten."""
  with open(path) as f:
    text = f.read()
  done = []

  def fill(match):
    name = match.group(2)
    if name not in blocks:
      return match.group(0)
    done.append(name)
    return match.group(1) + blocks[name] + match.group(3)

  text = BLOCK.sub(fill, text)
  with open(path, "w") as f:
    f.write(text)
  return done


def bench(paths: list[str], readmes=READMES) -> None:
  """The tables of the rows in `paths` to <first path without .jsonl>.md and into the READMEs'
  marked blocks."""
  found = cg_rows.read(paths)
  blocks = bench_blocks(found)
  with open(os.path.splitext(paths[0])[0] + ".md", "w") as f:
    f.write(f"# `python -m cg_jax bench` and the PyTorch / HF peers\n\nRows: "
            f"{', '.join(os.path.basename(p) for p in paths)} (one row schema, "
            "`cg_jax.bench.rows`). Rendered by `benchmarks/render_results.py bench`.\n")
    for name, block in blocks.items():
      f.write(f"\n## {name}\n\n{block}")
  for readme in readmes:
    print(f"{readme}: {', '.join(replace_blocks(readme, blocks)) or 'no marked block'}")


def main(argv: list[str]) -> None:
  kind, paths = argv[0], argv[1:]
  if kind == "bench":
    bench(paths)
    return
  rows = json.load(open(paths[0]))
  lines = {"attention": attention, "io": io, "tp": tensor_parallel}[kind](rows)
  with open(paths[0][:-len(".json")] + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main(sys.argv[1:])
