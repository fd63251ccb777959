#!/usr/bin/env bash
# One device call's worth of GPU work, each part time-boxed so a slow part cannot eat the others.
# Usage (on the device machine, from the repo root):
#   CG_JAX_COMMIT=<hash> bash benchmarks/gpu_session.sh "$OUT" [parts]
# parts (comma list, run in this order):
#   train        the bundled model (scripts/train_default_model.py; needs .train/kjv carried)
#   bench        `python -m cg_jax bench latency|throughput|serve|startup` on MODELS (default
#                gpt2,llama-3.2-1b: random weights of their shapes), rows in OUT/bench.jsonl;
#                `serve` needs .whl carried (benchmarks/http_install.sh) and runs from 8 clients
#   attention    Pallas attention kernels: correctness, config search, XLA and torch SDPA
#   io           host I/O: streamed tokens, pinned transfers, KV swap
#   graphs       full command-buffer mode with Pallas attention, gpt2 and llama-3.2-1b, B=1/8/32
#   tp           tensor parallelism over the host's GPUs (nvidia-h200-x2)
#   invariance   batch invariance and its cost (batch_invariance_bench.py)
#   comparison   the whole cg_jax-against-PyTorch comparison over every GPU of the host
#                (comparison_session.py; resumable: call again on the warm machine for the rest)
#   baselines    PyTorch / HF systems (MODELS, SYSTEMS as in run_baselines.sh)
# The one-off probes that used to live here (dispatch, ttft, host-path, prompt-dispatch,
# decode-kernels, user-latency, ...) were removed once their findings were in benchmarks/results;
# `git log -- benchmarks/` has them.
set -u
out=${1:?usage: gpu_session.sh OUT_DIR [parts]}
parts=${2:-bench}
MODELS=${MODELS:-gpt2,llama-3.2-1b}
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
if has bench; then
  rows=$out/bench.jsonl
  bench() {  # limit, subcommand and its options (the row goes to OUT/bench.jsonl)
    local limit=$1; shift
    echo "=== bench $* ($(date +%T)) ==="
    timeout "$limit" python3 -m cg_jax bench "$@" --output "$rows" 2>>"$out/bench.err" | tail -2
  }
  for model in ${MODELS//,/ }; do
    bench 240 latency --model "$model" --batch 1,8 --prompt-len 512 --output-len 128 \
      --max-seq-len 1024
    bench 240 throughput --model "$model" --max-seq-len 1024 --num-requests 64
    bench 240 startup --model "$model" --max-seq-len 1024 --which engine
  done
  if [ -d .whl ]; then
    eval "$(bash benchmarks/http_install.sh 2>"$out/http_install.log")"
    for model in ${MODELS//,/ }; do
      python3 -m cg_jax serve --model "$model" --max-seq-len 1024 --port 8123 \
        > "$out/serve-$model.log" 2>&1 &
      server=$!
      for _ in $(seq 400); do curl -sf http://127.0.0.1:8123/health >/dev/null && break; sleep 1; done
      for n in 64 16 1; do
        bench 120 serve --base-url http://127.0.0.1:8123/v1 --model "$model" --num-requests $n \
          --clients 8 --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
      done
      kill -TERM $server; wait $server
    done
  fi
fi
if has attention; then run attention 200 python3 benchmarks/attention_bench.py; fi
if has io; then run io 200 python3 benchmarks/io_bench.py; fi
if has graphs; then
  run graphs 300 python3 benchmarks/graphs_bench.py --attention pallas \
    --models gpt2,llama-3.2-1b --modes full --layer-loops unroll --batches 1,8,32 --traces none
fi
if has tp; then  # on nvidia-h200-x2: tensor-parallel correctness and latency
  run tp 500 python3 benchmarks/tp_bench.py
fi
if has invariance; then
  python3 benchmarks/make_checkpoints.py --out-dir /tmp/ck --models gpt2,llama-3.2-1b \
    > "$out/checkpoints.log" 2>&1
  echo "=== batch invariance ($(date +%T)) ==="
  models=${INVARIANCE_MODELS:-gpt2,llama-3.2-1b}
  timeout "${INVARIANCE_LIMIT_S:-360}" python3 benchmarks/batch_invariance_bench.py \
    --models "$(echo ",$models" | sed 's|,|,/tmp/ck/|g; s|^,||')" \
    --out "$out/batch_invariance.json" 2>&1 | grep -v -i warning | tail -8
fi
if has comparison; then
  echo "=== comparison ($(date +%T)) ==="
  python3 benchmarks/comparison_session.py --out "$out" --deadline-s "${DEADLINE_S:-540}" 2>&1 \
    | grep -v -i warning | tail -40
fi
if has baselines; then
  echo "=== baselines ($(date +%T)) ==="
  RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-120} bash benchmarks/run_baselines.sh "$out/baselines" 2>&1 | tail -40
fi
