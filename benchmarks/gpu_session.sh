#!/usr/bin/env bash
# One device call's worth of GPU work, each part time-boxed so a slow part cannot eat the others.
# Usage (on the device machine, from the repo root):
#   CG_JAX_COMMIT=<hash> bash benchmarks/gpu_session.sh "$OUT" [parts]
# parts (comma list, run in this order):
#   train          the bundled model (scripts/train_default_model.py; needs .train/kjv carried)
#   dispatch       host dispatch of one decode step under command-buffer variants
#   dispatch-temp-color  the same with the temp buffer at a fixed address (XLA_FLAGS)
#   attention      Pallas attention kernels: correctness, config search, XLA and torch SDPA
#   io             host I/O: streamed tokens, pinned transfers, KV swap
#   graphs-pallas  graph modes with Pallas attention in the decode step
#   io-overlap, dispatch-loop, mosaic-probe, graphs-b32   short follow-ups (see below)
#   io-offload     a 1 GB buffer offloaded to pinned host in chunks inside the decode steps
#   attention-decode  the decode-attention rows of `attention` only
#   attention-step the decode step's cache write + attention per model shape at B=8/32: default
#                  launch config against pinned splits (the B=32 attention is 19 us/layer in gpt2)
#   matmul-rows    the step with its products on 1, 8 or 16 rows (Engine(min_matmul_rows=...))
#   graphs-all     every graph mode x model x batch with Pallas attention
#   graphs-final   off/xla-default on gpt2, full on every model at batch 1, 8, 32
#   graphs-write   full mode, gpt2 and llama-3.2-1b at batch 1, 8, 32: fused cache write vs scatter
#   graphs-large   full mode, gpt2-large at batch 1, 8, 32
#   graphs-long    full mode, llama-3.2-1b with a 4096-long cache (position 512)
#   graphs-gemm    cg_jax's comparison rows (same checkpoint files) over both GPUs, with gpt2 and
#                  llama-3.2-1b also under cuBLAS / cuBLASLt GEMMs instead of XLA's Triton ones
#                  (CELLS0 / CELLS1: each GPU's model:max_len:gemms list; BATCHES)
#   tp             tensor parallelism over the host's GPUs (nvidia-h200-x2)
#   baselines      PyTorch / HF systems (MODELS, SYSTEMS as in run_baselines.sh)
#   ttft           where generate's TTFT goes (ttft_probe.py) and the host-path A/B (host_path_probe.py), gpt2 and
#                  llama-3.2-1b)
#   user-latency   generate's TTFT and per-token time (user_latency_bench.py, default GEMMs) and
#                  the best TTFT peers (gpt2 torch_compile, llama-3.2-1b torch_gptfast; PEERS)
#   ttft-peers     the other two TTFT peer cells (a second call; PEERS)
#                  (PEERS: space-separated model:system[:batches] cells, batches 1,8 by default)
#   prompt-dispatch  the prompt call's host time before the GPU starts (prompt_dispatch_probe.py,
#                  gpt2 and llama-3.2-1b; then gpt2 B=8 under the command-buffer log)
#   decode-kernels the decode step's kernels by kind (decode_kernels.py; DECODE_CELLS model:batch)
#   invariance     batch invariance and its cost (batch_invariance_bench.py)
#   tp-8b          llama-3.1-8b on one GPU (tp_bench.py: decode B=1/8/32, TTFT)
#   comparison     the whole cg_jax-against-PyTorch comparison over every GPU of the host
#                  (comparison_session.py; resumable: call again on the warm machine for the rest)
set -u
out=${1:?usage: gpu_session.sh OUT_DIR [parts]}
parts=${2:-attention,io,graphs-pallas}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$out"
has() { case ",$parts," in *,$1,*) return 0 ;; esac; return 1; }
run() {  # name, timeout seconds, command... (gets --out OUT/name)
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s, $(date +%T)) ==="
  mkdir -p "$out/$name"
  timeout "$limit" "$@" --out "$out/$name" 2>&1 | grep -v -i warning | tail -30
}
if has train; then
  run train 150 python3 scripts/train_default_model.py --work .train/kjv
fi
if has dispatch; then
  # Variants already measured (benchmarks/results/dispatch_h200.md) can be re-run with
  # --variants '{"name": {xla option: value}}'.
  run dispatch 150 python3 benchmarks/dispatch_bench.py --modes off,full
  echo "=== dispatch-vlog (command-buffer update log of the full-mode steps) ==="
  TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 TF_CPP_MIN_LOG_LEVEL=0 \
    timeout 70 python3 benchmarks/dispatch_bench.py --modes full --out "$out/dispatch-vlog" \
    > "$out/dispatch-vlog.log" 2>&1
  # Executions per number of changed allocations (the decode step, then the no-emitted step).
  grep -o -E "num_commands=[0-9]+; updated_allocs=[0-9]+" "$out/dispatch-vlog.log" | sort | uniq -c
  grep -i -E "Updated [0-9]+ commands" "$out/dispatch-vlog.log" | tail -4
  gzip "$out/dispatch-vlog.log"
fi
if has dispatch-temp-color; then
  # The temp buffer in its own pool at a fixed address (an allocator setting: XLA_FLAGS only).
  echo "=== dispatch-temp-color ==="
  XLA_FLAGS=--xla_gpu_temp_buffer_use_separate_color=true \
    TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 TF_CPP_MIN_LOG_LEVEL=0 \
    timeout 70 python3 benchmarks/dispatch_bench.py --modes full --out "$out/dispatch-temp-color" \
    > "$out/dispatch-temp-color.log" 2>&1
  grep -v -i warning "$out/dispatch-temp-color.log" | grep -E "^\{|^full" | tail -3
  grep -o -E "updated_allocs=[0-9]+" "$out/dispatch-temp-color.log" | sort | uniq -c
  grep -E "Updated [0-9]+ commands" "$out/dispatch-temp-color.log" | tail -2
  gzip "$out/dispatch-temp-color.log"
fi
if has attention; then run attention 200 python3 benchmarks/attention_bench.py; fi
if has io; then run io 200 python3 benchmarks/io_bench.py; fi
if has graphs-pallas; then
  run graphs-pallas 170 python3 benchmarks/graphs_bench.py --attention pallas \
    --models gpt2,llama-3.2-1b --modes full --layer-loops unroll --batches 1,8 --traces none
fi
# Short follow-ups (one small device call): swap/compute overlap, device-loop dispatch, the
# Mosaic GPU backend probe, batch-32 rows.
if has io-overlap; then run io-overlap 50 python3 benchmarks/io_bench.py --parts swap-overlap; fi
if has io-offload; then  # 1 GB offloaded in 32 chunks by the decode steps' own programs
  run io-offload 90 python3 benchmarks/io_bench.py --parts offload-in-step
fi
if has dispatch-loop; then run dispatch-loop 50 python3 benchmarks/dispatch_bench.py --modes full; fi
if has mosaic-probe; then
  run mosaic-probe 45 python3 benchmarks/attention_bench.py --parts mosaic-probe
fi
if has graphs-b32; then
  run graphs-b32 75 python3 benchmarks/graphs_bench.py --attention pallas --models gpt2 \
    --modes full --layer-loops unroll --batches 32 --traces none
fi
if has graphs-all; then  # every mode, with the idle-queue dispatch column (issue #4's table)
  run graphs-all 420 python3 benchmarks/graphs_bench.py --attention pallas \
    --models gpt2,gpt2-large,llama-3.2-1b --modes off,xla-default,full --layer-loops unroll \
    --batches 1,8 --traces none
fi
if has graphs-final; then  # the other modes on gpt2, then full mode on every model and batch
  run graphs-modes 150 python3 benchmarks/graphs_bench.py --attention pallas --models gpt2 \
    --modes off,xla-default --layer-loops unroll --batches 1,8 --traces none --ttft-len 0
  run graphs-full 300 python3 benchmarks/graphs_bench.py --attention pallas \
    --models gpt2,gpt2-large,llama-3.2-1b --modes full --layer-loops unroll --batches 1,8,32 \
    --traces gpt2,llama-3.2-1b
fi
if has graphs-write; then  # the decode attention storing the new K/V itself, against a scatter
  run graphs-write 330 python3 benchmarks/graphs_bench.py --attention pallas \
    --models gpt2,llama-3.2-1b --modes full --layer-loops unroll --batches 1,8,32 \
    --cache-writes fused,scatter --traces gpt2,llama-3.2-1b
fi
if has graphs-large; then
  run graphs-large 260 python3 benchmarks/graphs_bench.py --attention pallas \
    --models gpt2-large --modes full --layer-loops unroll --batches 1,8,32 --traces gpt2-large \
   
fi
if has graphs-long; then
  run graphs-long 170 python3 benchmarks/graphs_bench.py --attention pallas \
    --models llama-3.2-1b --modes full --layer-loops unroll --batches 1,8,32 --traces none \
    --max-seq-len 4096
fi
if has attention-decode; then
  run attention-decode 150 python3 benchmarks/attention_bench.py --parts decode
fi
if has attention-step; then
  run attention-step 300 python3 benchmarks/attention_bench.py --parts decode-step --batches 8,32 \
    --cache-lens 1024
fi
if has matmul-rows; then  # the step with its products on 1/8/16 rows
  run matmul-rows 200 python3 benchmarks/graphs_bench.py --attention pallas \
    --models gpt2,llama-3.2-1b --modes full --layer-loops unroll --batches 1 --traces gpt2 \
    --matmul-rows 1,8,16 --ttft-len 0
fi
if has graphs-gemm; then  # on nvidia-h200-x2; checkpoints made on the host while GPUs wait
  echo "=== graphs-gemm ($(date +%T)) ==="
  ck=/tmp/cg_jax_ckpt_gemm
  mkdir -p $ck
  cells0=${CELLS0:-gpt2:1024:xla,cublas,cublaslt gpt2-large:1024:xla}
  cells1=${CELLS1:-llama-3.2-1b:1024:xla,cublas,cublaslt llama-3.2-1b:4096:xla}
  for m in $(for cell in $cells0 $cells1; do echo "${cell%%:*}"; done | sort -u); do
    (CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=4 python3 benchmarks/make_checkpoints.py --out-dir $ck \
       --models $m > "$out/checkpoint_$m.log" 2>&1; echo $? > $ck/$m.exit) &
  done
  cells() {  # gpu, then model:max_len:gemms ...
    local gpu=$1 cell m t gemms; shift
    for cell in "$@"; do
      IFS=: read -r m t gemms <<< "$cell"
      for _ in $(seq 240); do [ -e $ck/$m.exit ] && break; sleep 1; done
      CUDA_VISIBLE_DEVICES=$gpu run "gemm-$m-$t" 300 python3 benchmarks/graphs_bench.py \
        --attention pallas --checkpoint-dir $ck --models $m --modes full --layer-loops unroll \
        --batches "${BATCHES:-1,8,32}" --traces none --max-seq-len $t \
        --gemms $gemms
    done
  }
  cells 0 $cells0 > "$out/gemm-gpu0.log" 2>&1 &
  cells 1 $cells1 > "$out/gemm-gpu1.log" 2>&1
  wait
  grep -h " step " "$out"/gemm-gpu*.log | cut -c1-150 | sort
  grep -h -E "FAILED|Error" "$out"/gemm-gpu*.log | cut -c1-300
  (cd "$out" && tar czf gemm_logs.tar.gz gemm-gpu*.log checkpoint_*.log && rm gemm-gpu*.log checkpoint_*.log)
fi
if has tp; then  # on nvidia-h200-x2: tensor-parallel correctness and latency (issue #9)
  run tp 500 python3 benchmarks/tp_bench.py
fi
if has ttft || has invariance || has user-latency || has ttft-peers || has prompt-dispatch \
    || has decode-kernels; then  # issues #18 and #20
  python3 benchmarks/make_checkpoints.py --out-dir /tmp/ck --models gpt2,llama-3.2-1b \
    > "$out/checkpoints.log" 2>&1
fi
if has ttft; then
  for model in gpt2 llama-3.2-1b; do
    run "ttft-$model" 120 python3 benchmarks/ttft_probe.py --checkpoint "/tmp/ck/$model"
    run "host-path-$model" 220 python3 benchmarks/host_path_probe.py --checkpoint "/tmp/ck/$model"
  done
fi
if has invariance; then
  echo "=== batch invariance ($(date +%T)) ==="
  models=${INVARIANCE_MODELS:-gpt2,llama-3.2-1b}
  timeout "${INVARIANCE_LIMIT_S:-360}" python3 benchmarks/batch_invariance_bench.py \
    --models "$(echo ",$models" | sed 's|,|,/tmp/ck/|g; s|^,||')" \
    --out "$out/batch_invariance.json" 2>&1 | grep -v -i warning | tail -8
fi
if has tp-8b; then  # issue #21 on one GPU: llama-3.1-8b decode at B=1/8/32 and TTFT
  run tp-8b 240 python3 benchmarks/tp_bench.py --models llama-3.1-8b --devices 1 \
    --batches 1,8,32 --variants full
fi
if has comparison; then
  echo "=== comparison ($(date +%T)) ==="
  python3 benchmarks/comparison_session.py --out "$out" --deadline-s "${DEADLINE_S:-540}" 2>&1 \
    | grep -v -i warning | tail -40
fi
if has user-latency; then  # what generate users see (typically 100 s), then its peers below
  echo "=== user-latency (limit 240s, $(date +%T)) ==="
  mkdir -p "$out/user-latency"
  timeout 240 python3 benchmarks/user_latency_bench.py --models /tmp/ck/gpt2,/tmp/ck/llama-3.2-1b \
    --gemms default --out "$out/user-latency/user_latency.json" 2>&1 | grep -v -i warning | tail -8
fi
if has user-latency || has ttft-peers; then
  # cells model:system; the default list fits one call after user-latency's rows
  cells=${PEERS:-gpt2:torch_compile llama-3.2-1b:torch_gptfast}
  has ttft-peers && cells=${PEERS:-llama-3.2-1b:torch_compile gpt2:torch_gptfast}
  mkdir -p "$out/user-latency"
  for cell in $cells; do
    IFS=: read -r model system batches <<< "$cell"
    echo "=== peer $cell ($(date +%T)) ==="
    # torch_gptfast compiles its decode and prefill graphs for about 100 s a batch.
    timeout 240 python3 benchmarks/torch_baselines.py --system "$system" \
      --model-dir "/tmp/ck/$model" --batches "${batches:-1,8}" --position 512 --max-len 1024 \
      --no-profile --out "$out/user-latency/peers.json" 2>&1 | tail -3
  done
fi
if has prompt-dispatch; then
  for model in gpt2 llama-3.2-1b; do
    run "prompt-dispatch-$model" 110 python3 benchmarks/prompt_dispatch_probe.py \
      --checkpoint "/tmp/ck/$model"
  done
fi
if has decode-kernels; then
  for cell in ${DECODE_CELLS:-gpt2:32}; do
    run "decode-kernels-${cell%%:*}" 90 python3 benchmarks/decode_kernels.py \
      --checkpoint "/tmp/ck/${cell%%:*}" --batch "${cell#*:}"
  done
fi
if has prompt-dispatch; then  # the prompt graph's updates per call, from XLA's own log
  echo "=== prompt-dispatch-vlog ($(date +%T)) ==="
  mkdir -p "$out/prompt-dispatch-vlog"
  TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 TF_CPP_MIN_LOG_LEVEL=0 \
    timeout 80 python3 benchmarks/prompt_dispatch_probe.py --checkpoint /tmp/ck/gpt2 --batches 8 \
    --out "$out/prompt-dispatch-vlog" > "$out/prompt-dispatch-vlog.log" 2>&1
  grep -o -E "num_commands=[0-9]+; updated_allocs=[0-9]+" "$out/prompt-dispatch-vlog.log" \
    | sort | uniq -c | sort -rn | head -8
  grep -o -E "Updated [0-9]+ commands in [0-9.]+ [mu]s \(skipped [0-9]+" \
    "$out/prompt-dispatch-vlog.log" | sed -E 's/in [0-9.]+/in N/' | sort | uniq -c | sort -rn | head -8
  grep -o -E "Updated [0-9]+ commands in [0-9.]+ [mu]s" "$out/prompt-dispatch-vlog.log" | tail -4
  grep -E "^gpt2" "$out/prompt-dispatch-vlog.log" | tail -2
  gzip "$out/prompt-dispatch-vlog.log"
fi
if has baselines; then
  echo "=== baselines ($(date +%T)) ==="
  RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-120} bash benchmarks/run_baselines.sh "$out/baselines" 2>&1 | tail -40
fi
