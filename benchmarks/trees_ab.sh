#!/usr/bin/env bash
# Source trees (or one tree under different options) side by side in one device call, each job a
# process of `step_kernels_probe.py` time-boxed so a slow job cannot eat the others; the probe's
# summary lines as they come, every job's log in OUT/logs.txt at the end. Usage (on the device
# machine, from the repo root):
#   JOBS='gpt2 main . 90
#   gpt2 branch .probe/branch 90
#   gpt2 pages16 . 90 ENGINE_OPTIONS={"prefix_block":16}' \
#   bash benchmarks/trees_ab.sh "$OUT" [LIMIT_S]
# A job line: MODEL LABEL TREE CAP_S [VAR=VALUE ...] (no spaces inside a value). MODEL is a
# make_checkpoints.py name (random bf16 weights of the real shapes, made once under CK_DIR,
# default /tmp/ck) or a checkpoint directory; TREE the directory put first on PYTHONPATH (`.`:
# this checkout; another revision: `git archive REV cg_jax models | tar -x -C .probe/REV` here,
# in an untracked folder, before the call). The probe's settings (BATCHES, GENERATE_BATCHES,
# PROFILE_ROWS, THROUGHPUT, ...) come from the environment, per job from its VAR=VALUE pairs.
# The probe script itself is always this checkout's. Rows: OUT/step_kernels_LABEL_MODEL.json.
set -uf
out=${1:?usage: JOBS=... trees_ab.sh OUT_DIR [LIMIT_S]}
limit=${2:-585}
ck=${CK_DIR:-/tmp/ck}
start=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 TF_CPP_MIN_LOG_LEVEL=2
export STEP_HLO=${STEP_HLO:-0}
logs=$(mktemp -d)
mapfile -t jobs <<< "${JOBS:?JOBS: one job a line}"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo no GPU)
echo "$(nproc) cores; $gpu; jax $(python3 -c 'import jax; print(jax.__version__)')"
models=$(for job in "${jobs[@]}"; do set -- $job; [ $# -eq 0 ] || [ -d "$1" ] || echo "$1"; done \
  | sort -u | paste -sd,)
if [ -n "$models" ]; then
  missing=$(for m in ${models//,/ }; do [ -d "$ck/$m" ] || echo "$m"; done | paste -sd,)
  [ -z "$missing" ] || python3 benchmarks/make_checkpoints.py --out-dir "$ck" --models "$missing" \
    > "$logs/checkpoints.log" 2>&1 || tail -n 3 "$logs/checkpoints.log"
  echo "checkpoints at $(( $(date +%s) - start )) s"
fi
for job in "${jobs[@]}"; do
  [ -n "${job// }" ] || continue
  set -- $job
  model=$1 label=${2}_$(basename "$1") tree=$3 cap=$4
  shift 4
  dir=$model; [ -d "$dir" ] || dir=$ck/$model
  left=$(( limit - $(date +%s) + start - 5 ))
  cap=$(( cap < left ? cap : left ))
  if [ "$cap" -lt 30 ]; then echo "$label: no time left"; continue; fi
  env "$@" PYTHONPATH="$tree" timeout "$cap" python3 benchmarks/step_kernels_probe.py "$label" \
    "$dir" "$out" > "$logs/$label.log" 2>&1
  if grep -q "^\[" "$logs/$label.log"; then
    grep "^\[\|^   " "$logs/$label.log" | cut -c1-900
  else
    tail -n 3 "$logs/$label.log" | cut -c1-300
  fi
  echo "$label ($*) done at $(( $(date +%s) - start )) s"
done
set +f
for f in "$logs"/*.log; do
  echo "== $f"; grep -v -i warning "$f" | tail -n 15
done > "$out/logs.txt"
