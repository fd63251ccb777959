#!/usr/bin/env bash
# `serve` against in-process, and source trees against each other, on one machine start: PLAN
# is a list of steps (bash) over the functions below, run in order, e.g.
#   PLAN='L=$(ck llama-3.2-1b); serve_run new-cold . $L 16,64,1; \
#         serve_run main-stored TREE $L 16,64,1; inproc_run new . $L' \
#     bash benchmarks/serve_ab.sh OUT
# TREE: another checkout's files (`git archive REV | tar -x -C TREE`, inside the repo so it
# travels to the device), first on the path for its steps. serve_run NAME TREE DIR LIST [serve
# options]: `serve` (the first of a machine start compiles, later ones load stored executables)
# and, once its decode steps are its own (no stand-in left: a cold start builds and stores them
# behind /health), `bench serve` for each of LIST (N at once from 8 client processes, 16 past
# 64; "1": 16 arriving 2 a second from one). inproc_run NAME TREE DIR [LIST]: `bench
# throughput` for each of LIST (as serve_run's; default 16,64,1). startup_run NAME TREE DIR
# [WHICH [STARTS]]: `bench startup` (default: serve, cold then warm). Each row goes to
# OUT/bench.jsonl with `probe`: its label and the front end's and the core's CPU seconds (from
# /proc), and a line is printed.
# Results: results/serving_front_end_h100. The device's serving packages come from .whl
# (gpu_session.sh's http_install).
set -u
out=$1; mkdir -p "$out"
PORT=8123
CKPT=/tmp/ck; export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
rows=$out/bench.jsonl
eval "$(sed -n '/^http_install() {/,/^}/p' benchmarks/gpu_session.sh)"
python3 -c "import fastapi, uvicorn, openai, zmq" 2>/dev/null ||
  PYTHONPATH=$PWD http_install /tmp/cg_jax_http > "$out/http_install.log" 2>&1 ||
  { echo "!! http_install failed"; tail -5 "$out/http_install.log"; }
HTTP=/tmp/cg_jax_http
device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo cpu)
cpu() { awk '{print $14+$15}' /proc/$1/stat 2>/dev/null || echo 0; }
bench() {  # label tree args...
  local label=$1 tree=$2; shift 2
  local t0=$(date +%s.%N) fa=$(cpu ${FRONT:-1}) ca=$(cpu ${CORE:-1})
  PYTHONPATH=$PWD/$tree:$HTTP timeout 150 python3 -m cg_jax bench "$@" --output $out/tmp.jsonl \
    > $out/b.log 2>&1 || tail -3 $out/b.log
  local t1=$(date +%s.%N) fb=$(cpu ${FRONT:-1}) cb=$(cpu ${CORE:-1})
  python3 - "$label" $t0 $t1 $fa $fb $ca $cb $out/tmp.jsonl $rows <<'P'
import json, sys
label, t0, t1, fa, fb, ca, cb, tmp, rows = sys.argv[1:]
wall = float(t1) - float(t0)
for line in open(tmp):
  r = json.loads(line); r["probe"] = {"label": label, "front_cpu_s": (int(fb)-int(fa))/100,
    "core_cpu_s": (int(cb)-int(ca))/100, "bench_wall_s": wall}
  open(rows, "a").write(json.dumps(r) + "\n")
  f = r["figures"]
  g = lambda k: f.get(k, 0)
  print(f"{label:28s} tok/s {g('tokens_per_s'):8.0f} ttft p50 {g('ttft_ms_p50'):7.2f} "
        f"mean {g('ttft_ms_mean'):7.2f} srv {g('server_ttft_ms_mean'):7.2f} | tpot p50 "
        f"{g('tpot_ms_p50'):6.3f} mean {g('tpot_ms_mean'):6.3f} srv {g('server_tpot_ms_mean'):6.3f}"
        f" | front {r['probe']['front_cpu_s']:.2f}s core {r['probe']['core_cpu_s']:.2f}s / "
        f"{wall:.1f}s")
P
  rm -f $out/tmp.jsonl
}
serve_run() {  # name tree model-dir bench-list extra-serve-args...
  local name=$1 tree=$2 dir=$3 list=$4; shift 4
  local t0=$(date +%s)
  PYTHONPATH=$PWD/$tree:$HTTP python3 -m cg_jax serve --model $dir --max-seq-len 1024 \
    --port $PORT "$@" > $out/serve-$name.log 2>&1 &
  local server=$!
  for _ in $(seq 300); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
  echo "=== $name: /health after $(( $(date +%s) - t0 )) s"
  for _ in $(seq 300); do
    curl -sf http://127.0.0.1:$PORT/metrics | grep -q '^cg_jax_steps_on_stand_ins 0' && break
    sleep 1
  done
  echo "=== $name: own decode steps after $(( $(date +%s) - t0 )) s"
  FRONT=$server; sleep 1; CORE=$(pgrep -P $server -f spawn_main | tail -1)
  local base=(--base-url http://127.0.0.1:$PORT/v1 --model $dir --device "$device")
  for b in ${list//,/ }; do
    case $b in
      1) bench "$name http 1 (16 at 2/s)" $tree serve "${base[@]}" --num-requests 16 --rate 2 \
           --clients 1 ;;
      *) bench "$name http $b" $tree serve "${base[@]}" --num-requests $b \
           --clients $(( b > 64 ? 16 : 8 )) ;;
    esac
  done
  kill -TERM $server; wait $server
  FRONT=1; CORE=1
}
inproc_run() {  # name tree model-dir [list]
  local list=${4:-16,64,1}
  for n in ${list//,/ }; do
    case $n in
      1) bench "$1 inproc 1 (16 at 2/s)" $2 throughput --model $3 --max-seq-len 1024 \
           --num-requests 16 --rate 2 ;;
      *) bench "$1 inproc $n" $2 throughput --model $3 --max-seq-len 1024 --num-requests $n ;;
    esac
  done
}
startup_run() {  # name tree model-dir [which (engine,serve)] [starts (cold,warm)]
  # `bench startup`: each start a fresh process, cold on an empty cache, warm on what it left
  local name=$1 tree=$2 dir=$3 which=${4:-serve} starts=${5:-cold,warm}
  PYTHONPATH=$PWD/$tree:$HTTP timeout 590 python3 -m cg_jax bench startup --model $dir \
    --max-seq-len 1024 --which $which --starts $starts --system "cg_jax@$name" \
    --output $out/tmp.jsonl > $out/b.log 2>&1 || tail -3 $out/b.log
  python3 - "$name" $out/tmp.jsonl $rows <<'P'
import json, sys
name, tmp, rows = sys.argv[1:]
for line in open(tmp):
  r = json.loads(line); r["probe"] = {"label": name}
  open(rows, "a").write(json.dumps(r) + "\n")
  f, w = r["figures"], r["workload"]
  print(f"{name:20s} {w['which']:6s} {w['cache']:4s} " + " ".join(
      f"{k} {v:.2f}" for k, v in sorted(f.items()) if isinstance(v, float)))
P
  rm -f $out/tmp.jsonl
}
ck() {  # model -> its random-weight checkpoint (written once)
  [ -f $CKPT/$1/config.json ] || PYTHONPATH=$PWD python3 benchmarks/make_checkpoints.py \
    --out-dir $CKPT --models $1 >> $out/ck.log 2>&1
  echo $CKPT/$1
}
eval "$PLAN"
