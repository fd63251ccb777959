#!/usr/bin/env bash
# The GPU benchmarks, one device call's worth of parts at a time, each part time-boxed so a slow
# part cannot eat the others. Usage (on the device machine, from the repo root):
#   CG_JAX_COMMIT=<hash> bash benchmarks/gpu_session.sh "$OUT" [parts]
# parts (comma list, run in this order):
#   bench       for each of MODELS (default llama-3.2-1b), on one random-weight checkpoint
#               (make_checkpoints.py) that every system loads: `python -m cg_jax bench latency`
#               (BATCHES, default 1,8,32; prompts of 512, 128 new tokens, cache 1024) and the
#               peers torch_compile and torch_gptfast with the same options (torch_peers.py);
#               `bench throughput` and hf_continuous on 64 requests at once. LATENCY_SYSTEMS and
#               THROUGHPUT_SYSTEMS (comma lists) choose among these (empty: none)
#   serve       for each of MODELS: `bench throughput` at 64 and 16 requests at once and 16
#               arriving 2 a second (one stream), then `python -m cg_jax serve` and `bench serve`
#               on the same three workloads (--clients 8; one stream: 1) and 256 at once
#               (needs .whl carried: the offline install below)
#   startup     `bench startup` of the engine, cold and warm, for each of MODELS
#   train       the bundled model (scripts/train_default_model.py; needs .train/kjv carried)
#   attention   Pallas attention kernels: correctness, config search, XLA and torch SDPA
#   paged       the ragged paged-attention kernel against the slot decode kernel (gpt2 and
#               llama-3.2-1b heads, BATCHES, cache 1024) and the flash kernel / SDPA (prompts)
#   io          host I/O: streamed tokens, pinned transfers, KV swap
#   tp          tensor parallelism over the host's GPUs (nvidia-h200-x2)
#   invariance  batch invariance and its cost (batch_invariance_bench.py)
# Rows of bench, serve and startup go to OUT/bench.jsonl (one schema, cg_jax.bench.rows); then
#   python benchmarks/render_results.py bench benchmarks/results/bench_h200.jsonl
# (the file copied into results/) regenerates the README's and benchmarks/README.md's tables.
#
# The GPU machine has no package index. `serve` installs fastapi, uvicorn, openai, ... from the
# wheels in .whl/ into a directory of their own (never into the interpreter's environment; only
# what it lacks, and never numpy, jax or torch). The wheels (about 16 MB), on a machine with an
# index, from the repo root:
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --implementation cp -d .whl \
#     fastapi "uvicorn[standard]" pyzmq openai httpx prometheus-client jinja2 pip
set -u
out=${1:?usage: gpu_session.sh OUT_DIR [parts]}
parts=${2:-bench}
MODELS=${MODELS:-llama-3.2-1b}
BATCHES=${BATCHES:-1,8,32}
LATENCY_SYSTEMS=${LATENCY_SYSTEMS-cg_jax,torch_compile,torch_gptfast}
THROUGHPUT_SYSTEMS=${THROUGHPUT_SYSTEMS-cg_jax,hf_continuous}
PEER_LIMIT_S=${PEER_LIMIT_S:-300}  # per latency peer and model
CKPT=${CKPT:-/tmp/cg_jax_ckpt}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$out"
rows=$out/bench.jsonl
has() { case ",$parts," in *,$1,*) return 0 ;; esac; return 1; }
run() {  # name, timeout seconds, command... (gets --out OUT/name)
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s, $(date +%T)) ==="
  mkdir -p "$out/$name"
  timeout "$limit" "$@" --out "$out/$name" 2>&1 | grep -v -i warning | tail -30
}
bench() {  # limit, `cg_jax bench` subcommand and its options (rows to OUT/bench.jsonl)
  local limit=$1; shift
  echo "=== bench $* ($(date +%T)) ==="
  timeout "$limit" python3 -m cg_jax bench "$@" --output "$rows" 2>>"$out/bench.err" | tail -1
}
peer() {  # limit, torch_peers.py subcommand and its options (rows to OUT/bench.jsonl)
  # A peer past its limit gets SIGABRT: faulthandler writes its Python stacks to peers.err.
  local limit=$1; shift
  echo "=== peer $* ($(date +%T)) ==="
  timeout -s ABRT "$limit" python3 -X faulthandler benchmarks/torch_peers.py "$@" \
    --output "$rows" 2>>"$out/peers.err" | grep --line-buffered -E '^  batch |^\| (torch|hf)'
}
checkpoint() {  # model -> its directory under CKPT (written once)
  [ -f "$CKPT/$1/config.json" ] || python3 benchmarks/make_checkpoints.py --out-dir "$CKPT" \
    --models "$1" >>"$out/checkpoints.log" 2>&1
  echo "$CKPT/$1"
}
http_install() {  # the serve extra and the openai client from .whl into $1; PYTHONPATH gets it
  local dest=$1 wheels pip_wheel plan
  wheels=$(cd .whl && pwd) || { echo "no .whl carried" >&2; return 1; }
  pip_wheel=$(ls "$wheels"/pip-*.whl | tail -1)
  local pip=(python3 "$pip_wheel/pip" --isolated --disable-pip-version-check --no-input)
  local offline=(--no-index --find-links "$wheels" --only-binary=:all: --root-user-action=ignore)
  # (as pyproject's serve extra: uvicorn[standard] brings httptools, without which uvicorn
  # parses HTTP in pure Python, h11; and pyzmq for trees older than 83a1128, whose engine core
  # talked ZMQ)
  local wanted=("fastapi>=0.115" "uvicorn[standard]>=0.30" "prometheus-client>=0.20"
                "jinja2>=3.1.6" "pyzmq>=25" httpx "openai>=1.40")
  rm -rf "$dest" && mkdir -p "$dest"
  # What pip would add to this interpreter (nothing it has at a fitting version), then only that.
  "${pip[@]}" install --dry-run --quiet --report "$dest.plan.json" "${offline[@]}" "${wanted[@]}"
  plan=$(python3 - "$dest.plan.json" <<'EOF'
import json, sys, urllib.parse, urllib.request
for item in json.load(open(sys.argv[1]))["install"]:
  name = item["metadata"]["name"].lower()
  assert name not in ("numpy", "jax", "jaxlib", "torch"), f"the plan would install {name}"
  print(urllib.request.url2pathname(urllib.parse.urlparse(item["download_info"]["url"]).path))
EOF
) || return 1
  # shellcheck disable=SC2086  # one wheel path per word
  [ -z "$plan" ] || "${pip[@]}" install --quiet --no-deps --target "$dest" \
    --no-warn-script-location "${offline[@]}" $plan
  export PYTHONPATH=$dest:$PYTHONPATH
  python3 -c "import fastapi, uvicorn, uvloop, httptools, zmq, openai, prometheus_client, jinja2, numpy, jax"
}
device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
latency=(--prompt-len 512 --output-len 128 --max-seq-len 1024)
if has bench; then
  for model in ${MODELS//,/ }; do
    dir=$(checkpoint "$model")
    for system in ${LATENCY_SYSTEMS//,/ }; do
      if [ "$system" = cg_jax ]; then
        bench 240 latency --model "$dir" --batch "$BATCHES" "${latency[@]}"
      else
        peer "$PEER_LIMIT_S" latency --system "$system" --model "$dir" --batch "$BATCHES" \
          "${latency[@]}"
      fi
    done
    for system in ${THROUGHPUT_SYSTEMS//,/ }; do
      if [ "$system" = cg_jax ]; then
        bench 300 throughput --model "$dir" --max-seq-len 1024 --num-requests 64
      else
        peer 120 throughput --system "$system" --model "$dir" --max-seq-len 1024 \
          --num-requests 64
      fi
    done
  done
fi
if has serve; then
  http_install /tmp/cg_jax_http > "$out/http_install.log" 2>&1 || echo "!! http_install failed"
  for model in ${MODELS//,/ }; do
    dir=$(checkpoint "$model")
    for n in 64 16; do bench 150 throughput --model "$dir" --max-seq-len 1024 --num-requests $n; done
    # one stream: 16 requests arriving 2 a second (a request is served in about 0.15 s)
    bench 120 throughput --model "$dir" --max-seq-len 1024 --num-requests 16 --rate 2
    python3 -m cg_jax serve --model "$dir" --max-seq-len 1024 --port 8123 \
      > "$out/serve-$model.log" 2>&1 &
    server=$!
    for _ in $(seq 400); do curl -sf http://127.0.0.1:8123/health >/dev/null && break; sleep 1; done
    for n in 64 16; do
      bench 120 serve --base-url http://127.0.0.1:8123/v1 --model "$dir" --num-requests $n \
        --clients 8 --device "$device"
    done
    bench 120 serve --base-url http://127.0.0.1:8123/v1 --model "$dir" --num-requests 16 \
      --rate 2 --clients 1 --device "$device"
    bench 120 serve --base-url http://127.0.0.1:8123/v1 --model "$dir" --num-requests 256 \
      --clients 16 --device "$device"
    kill -TERM $server; wait $server
  done
fi
if has startup; then
  for model in ${MODELS//,/ }; do
    bench 500 startup --model "$(checkpoint "$model")" --max-seq-len 1024 --which engine
  done
fi
if has train; then
  run train 150 python3 scripts/train_default_model.py --work .train/kjv
fi
if has attention; then run attention 200 python3 benchmarks/attention_bench.py; fi
if has paged; then
  run paged 300 python3 benchmarks/attention_bench.py --parts paged --batches "$BATCHES" \
    --step-models gpt2,llama-3.2-1b --cache-lens 1024
fi
if has io; then run io 200 python3 benchmarks/io_bench.py; fi
if has tp; then run tp 500 python3 benchmarks/tp_bench.py; fi
if has invariance; then
  models=${INVARIANCE_MODELS:-gpt2,llama-3.2-1b}
  dirs=$(for m in ${models//,/ }; do checkpoint "$m"; done | paste -sd,)
  echo "=== batch invariance ($(date +%T)) ==="
  timeout "${INVARIANCE_LIMIT_S:-360}" python3 benchmarks/batch_invariance_bench.py \
    --models "$dirs" --out "$out/batch_invariance.json" 2>&1 | grep -v -i warning | tail -8
fi
if [ -f "$rows" ]; then
  python3 benchmarks/render_results.py bench "$rows" >/dev/null 2>&1
  cat "${rows%.jsonl}.md"
fi
