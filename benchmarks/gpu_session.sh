#!/usr/bin/env bash
# One device call's worth of GPU measurements for the open kernel / I/O / graph issues, each part
# time-boxed so a slow part cannot eat the others. Usage (on the device machine):
#   CG_JAX_COMMIT=<hash> bash benchmarks/gpu_session.sh "$OUT" [parts]
# parts: comma list of attention, io, graphs-pallas (default: all three).
set -u
out=${1:?usage: gpu_session.sh OUT_DIR [parts]}
parts=${2:-attention,io,graphs-pallas}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$out"
run() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) ==="
  mkdir -p "$out/$name"
  timeout "$limit" "$@" --out "$out/$name" 2>&1 | grep -v -i warning | tail -30
}
case ",$parts," in *,attention,*) run attention 200 python3 benchmarks/attention_bench.py ;; esac
case ",$parts," in *,io,*) run io 200 python3 benchmarks/io_bench.py ;; esac
case ",$parts," in *,graphs-pallas,*)
  run graphs-pallas 170 python3 benchmarks/graphs_bench.py --attention pallas \
    --models gpt2,llama-3.2-1b --modes full --layer-loops unroll --batches 1,8 --traces none ;;
esac
