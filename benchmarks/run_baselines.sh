#!/usr/bin/env bash
# PyTorch / Hugging Face baselines for every model x system, one process each, rows in one file.
#
#   benchmarks/run_baselines.sh OUT_DIR            # on the GPU machine (H200), from the repo root
#   benchmarks/run_baselines.sh OUT_DIR --smoke    # tiny checkpoints on the CPU, in seconds
#
# Makes the random-weight checkpoints under $CKPT_DIR (default /tmp/cg_jax_ckpt; kept when already
# there), runs benchmarks/torch_baselines.py once per (model, system) at --position 512
# --max-len 1024, and once more per system for llama-3.2-1b at --position 512 --max-len 4096.
# Each run writes OUT_DIR/rows/<model>.<max_len>.<system>.json and OUT_DIR/logs/<same>.log; a run
# that dies (crash, timeout) before writing a batch's row gets a `failed` row for that batch, and
# the script goes on. All rows are then collected in OUT_DIR/baselines.json and a table printed.
#
# Environment (all optional): MODELS (comma list, default all), SYSTEMS (comma list, default
# all six), BATCHES (default 1,8,32), PYTHON (default python3), CKPT_DIR, RUN_TIMEOUT_S (per
# process, default 1800), LONG_RUNS (0 skips the long-cache runs, `only` runs
# just them), EXTRA_ARGS (appended to every torch_baselines.py call). Runs add up:
# splitting the work over several calls with different MODELS/SYSTEMS and the same OUT_DIR
# gives one baselines.json with every row (a repeated run replaces that run's rows).

set -u -o pipefail

OUT_DIR=${1:?usage: benchmarks/run_baselines.sh OUT_DIR [--smoke]}
SMOKE=0
if [[ "${2:-}" == "--smoke" ]]; then SMOKE=1; fi

cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python3}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-1800}
SYSTEMS=${SYSTEMS:-torch_eager,torch_cuda_graph,torch_compile,torch_gptfast,hf_dynamic,hf_static}
EXTRA_ARGS=${EXTRA_ARGS:-}

if (( SMOKE )); then
  CKPT_DIR=${CKPT_DIR:-/tmp/cg_jax_ckpt_smoke}
  MODELS=${MODELS:-smoke-gpt2,smoke-llama}
  BATCHES=${BATCHES:-1,3}
  POSITION=24; MAX_LEN=64; LONG_MODEL=smoke-llama; LONG_MAX_LEN=256
  SMOKE_FLAG=--smoke
  export JAX_PLATFORMS=cpu
else
  CKPT_DIR=${CKPT_DIR:-/tmp/cg_jax_ckpt}
  MODELS=${MODELS:-gpt2,gpt2-large,llama-3.2-1b}
  BATCHES=${BATCHES:-1,8,32}
  POSITION=512; MAX_LEN=1024; LONG_MODEL=llama-3.2-1b; LONG_MAX_LEN=4096
  SMOKE_FLAG=
fi

mkdir -p "$OUT_DIR/rows" "$OUT_DIR/logs"
echo "== baselines: models $MODELS, systems $SYSTEMS, batches $BATCHES -> $OUT_DIR"

# -- checkpoints (the same files every system, cg_jax included, loads) --------------------------
missing=()
for model in ${MODELS//,/ }; do
  [[ -f "$CKPT_DIR/$model/checkpoint_info.json" ]] || missing+=("$model")
done
if (( ${#missing[@]} )); then
  list=$(IFS=,; echo "${missing[*]}")
  echo "== writing checkpoints $list under $CKPT_DIR"
  if ! "$PYTHON" benchmarks/make_checkpoints.py --out-dir "$CKPT_DIR" --models "$list" \
      $SMOKE_FLAG; then
    echo "!! make_checkpoints.py failed; the runs of those models will fail" >&2
  fi
else
  echo "== checkpoints already under $CKPT_DIR"
fi

# -- one process per (model, max_len, system) ---------------------------------------------------
runs=()
if [[ "${LONG_RUNS:-1}" != only ]]; then
  for model in ${MODELS//,/ }; do
    for system in ${SYSTEMS//,/ }; do runs+=("$model $MAX_LEN $system"); done
  done
fi
if [[ "${LONG_RUNS:-1}" != 0 && ",$MODELS," == *",$LONG_MODEL,"* ]]; then
  for system in ${SYSTEMS//,/ }; do runs+=("$LONG_MODEL $LONG_MAX_LEN $system"); done
fi

# Adds a `failed` row for every batch the run left without a row (it crashed or timed out).
record_missing_batches() {
  "$PYTHON" - "$@" <<'EOF'
import datetime, json, os, sys
path, system, model, batches, position, max_len, rc, log = sys.argv[1:]
rows = []
if os.path.exists(path) and os.path.getsize(path) > 0:
  with open(path) as f:
    rows = json.load(f)
done = {row.get("batch") for row in rows}
tail = ""
if os.path.exists(log):
  with open(log, errors="replace") as f:
    tail = " | ".join(f.read().strip().splitlines()[-5:])[-800:]
reason = "timed out" if rc in ("124", "137") else f"exited with status {rc}"
for batch in (int(b) for b in batches.split(",")):
  if batch not in done:
    rows.append(dict(system=system, model=model, batch=batch, step_us=None, ttft_ms=None,
                     tokens_per_s=None, compile_s=None, kernels_per_step=None,
                     graph_launches_per_step=None, host_dispatch_us=None,
                     commit=os.environ.get("CG_JAX_COMMIT"),
                     date=datetime.date.today().isoformat(), position=int(position),
                     max_len=int(max_len), status="failed",
                     error=f"process {reason} before writing this row; log {log}: {tail}"))
with open(path, "w") as f:
  json.dump(rows, f, indent=1)
EOF
}

failed=0
index=0
for run in "${runs[@]}"; do
  read -r model max_len system <<< "$run"
  index=$((index + 1))
  tag="$model.$max_len.$system"
  rows_file="$OUT_DIR/rows/$tag.json"
  log="$OUT_DIR/logs/$tag.log"
  rm -f "$rows_file"
  echo "== [$index/${#runs[@]}] $system  $model  position $POSITION  max_len $max_len" \
      "($(date +%T))"
  start=$SECONDS
  # shellcheck disable=SC2086  # SMOKE_FLAG and EXTRA_ARGS are word lists
  timeout --kill-after=30 "$RUN_TIMEOUT_S" "$PYTHON" benchmarks/torch_baselines.py \
      --system "$system" --model-dir "$CKPT_DIR/$model" --batches "$BATCHES" \
      --position "$POSITION" --max-len "$max_len" --out "$rows_file" $SMOKE_FLAG $EXTRA_ARGS \
      > "$log" 2>&1
  rc=$?
  grep -E '^  batch |vs eager' "$log" | sed 's/^/ /'
  if (( rc != 0 )); then
    failed=$((failed + 1))
    echo "!! $tag: exit status $rc after $((SECONDS - start)) s; last lines of $log:"
    tail -n 5 "$log" | sed 's/^/   | /'
    record_missing_batches "$rows_file" "$system" "$model" "$BATCHES" "$POSITION" "$max_len" \
        "$rc" "$log"
  else
    echo "   done in $((SECONDS - start)) s"
  fi
done

# -- collect every run's rows (this call's and earlier calls' with the same OUT_DIR) ------------
"$PYTHON" - "$OUT_DIR" <<'EOF'
import glob, json, os, sys
out_dir = sys.argv[1]
rows = []
for path in sorted(glob.glob(os.path.join(out_dir, "rows", "*.json"))):
  with open(path) as f:
    rows.extend(json.load(f))
with open(os.path.join(out_dir, "baselines.json"), "w") as f:
  json.dump(rows, f, indent=1)
print(f"== {len(rows)} rows in {os.path.join(out_dir, 'baselines.json')}")
EOF
echo
"$PYTHON" benchmarks/torch_baselines.py --table "$OUT_DIR/baselines.json"
echo
echo "== $failed of ${#runs[@]} runs exited with an error (their rows say why)"
exit $(( failed > 0 ))
