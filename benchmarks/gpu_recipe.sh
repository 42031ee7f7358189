#!/usr/bin/env bash
# The GPU recipe, one short lease at a time, run unattended from the repository root on the GPU machine:
#
#   OUT=$OUT BUDGET_S=540 bash benchmarks/gpu_recipe.sh        # device run: carry [".whl"], timeout_s 590
#
#   1. the throughput check: benchmarks/gpu_pretrain.py $THROUGHPUT_ARGS, cut at THROUGHPUT_S (0 skips it); by
#      default what is still open: the small model's fp32-eager step on a fixed batch (the 3x target's reference)
#      and a real run's bf16 step, eager and compiled (whether train.compile pays for its recompiles); the full
#      table of README, about 140 s: --presets small base --features 64 --loader-seconds 8;
#      then the inference table: benchmarks/inference.py --gpu-table --gpu-sizes $INFERENCE_SIZES (fit +
#      predict, fp32 and bf16 autocast; by default the open 50k x 1k x 100, or 1000x1000x20,10000x10000x100,...),
#      cut at INFERENCE_S (0, or a DEVICE other than cuda, skips it), rows written to $OUT/inference_gpu.txt;
#   2. one leg of the recipe (benchmarks/gpu_state.py leg): resume the state committed in benchmarks/gpu_state/
#      (before the first leg: the shipped weights with a fresh optimizer), train stage by stage
#      (configs/pretrain/gpu.yaml from step 0, gpu_stage2.yaml from step 1500) until EVAL_S + FINISH_S seconds
#      of BUDGET_S are left, packing the state into $OUT every SAVE_EVERY_S so that a lease cut short still
#      returns one;
#   3. the quick accuracy check (benchmarks/accuracy.py --models tabfm --folds 1: fold 0 of all 56 tables) of the
#      new model, then of the shipped default, in what is left of EVAL_S (0 skips it: adopt then scores on CPU);
#   4. $OUT: state.safetensors + state.json (the resumable state: weights, AdamW state, step and data position,
#      leg history), model.safetensors (the candidate default), accuracy.csv + accuracy_default.csv,
#      throughput.txt, inference_gpu.txt, logs.tar.gz (session, training and evaluation logs, metrics): 8 files of
#      at most ~8 MB.
#
# BUDGET_S counts from this script's start (the machine's start-up comes on top). Then, on the developer's
# machine: python benchmarks/gpu_state.py adopt FILES --apply (README, "Default checkpoint").
# polars is not installed on the GPU machine: wheels in .whl/ (git-ignored, carried) are installed for the run.
# The device tool sends at most 64 MiB (tracked files, 20.4 MB with the state and the large suite, plus what is
# carried): polars 2.x's runtime wheel alone is 54 MB and overflows it; 1.36.1's two wheels are 45.3 MB, which
# leaves about 1.3 MiB (tests/test_gpu_recipe.py fails once tracked files pass 64 MiB - WHEELS_BYTES). Fetch them with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl polars==1.36.1 polars-runtime-32==1.36.1
# A CPU dry run (tests/test_gpu_recipe.py): DEVICE=cpu THROUGHPUT_S=0 EVAL_S=0 SET="model=tiny ..." STATE_DIR=...
set -u
START=$(date +%s)
REPO=$(pwd)
OUT=${OUT:-$REPO/out/recipe}
BUDGET_S=${BUDGET_S:-540}
WORK=${WORK:-/tmp/tabfm-recipe}
DEVICE=${DEVICE:-cuda}
THROUGHPUT_S=${THROUGHPUT_S:-120}
THROUGHPUT_ARGS=${THROUGHPUT_ARGS:-"--presets small --features 64 --precisions fp32 --sections model e2e --e2e-rows eager compile --e2e-steps 15"}
INFERENCE_S=${INFERENCE_S:-60}      # the estimators' GPU table (benchmarks/inference.py --gpu-table); 0 skips it
INFERENCE_SIZES=${INFERENCE_SIZES:-50000x1000x100}   # its sizes (--gpu-sizes): the open target by default
EVAL_S=${EVAL_S:-120}
EVAL_TABLES=${EVAL_TABLES:-}        # accuracy.py --tables for both sides (default: all 56)
FINISH_S=${FINISH_S:-45}            # stopping the trainer, the last pack and merge, the log archive
STAGES=${STAGES:-"configs/pretrain/gpu.yaml:0 configs/pretrain/gpu_stage2.yaml:1500"}
SET=${SET:-}                        # --set items for every stage (a dry run makes everything tiny)
STATE_DIR=${STATE_DIR:-$REPO/benchmarks/gpu_state}
INIT_FROM=${INIT_FROM-tabfm/weights/tabfm-small.safetensors}   # the first leg's weights ('' = from scratch)
LEG_STEPS=${LEG_STEPS:-0}           # 0: the clock ends the leg
MIN_SEGMENT_S=${MIN_SEGMENT_S:-60}
SAVE_EVERY_S=${SAVE_EVERY_S:-60}
mkdir -p "$OUT" "$WORK"
rm -rf "$WORK/run" "$WORK/eval" "$WORK/logs"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/session.log"; }
left() { echo $((START + BUDGET_S - $(date +%s) - ${1:-0})); }

if ! python3 -c "import polars" 2>/dev/null; then
    if ! compgen -G "$REPO/.whl/*.whl" > /dev/null; then
        log "polars is missing and .whl/ holds no wheels: download them here first (README, Default checkpoint)"
        exit 1
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
        "$REPO"/.whl/*.whl || exit 1
    export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
fi
. "$REPO/benchmarks/gpu_tree.sh"  # the package from this checkout, nothing installed; cd $WORK

if [ "$THROUGHPUT_S" -gt 0 ]; then
    log "throughput table (at most $THROUGHPUT_S s): gpu_pretrain.py $THROUGHPUT_ARGS"
    # shellcheck disable=SC2086
    timeout -k 10 "$THROUGHPUT_S" python3 "$REPO/benchmarks/gpu_pretrain.py" --device "$DEVICE" $THROUGHPUT_ARGS \
        > "$OUT/throughput.txt" 2>&1
    log "throughput table: exit status $?"
fi

if [ "$INFERENCE_S" -gt 0 ] && [ "${DEVICE%%:*}" = cuda ]; then
    log "inference table (at most $INFERENCE_S s): inference.py --gpu-table"
    timeout -k 10 "$INFERENCE_S" python3 "$REPO/benchmarks/inference.py" --gpu-table --device "$DEVICE" \
        --gpu-sizes "$INFERENCE_SIZES" --budget-s $((INFERENCE_S > 15 ? INFERENCE_S - 10 : INFERENCE_S)) \
        --txt "$WORK/inference_gpu.txt" \
        > "$OUT/inference_gpu.txt" 2>&1
    log "inference table: exit status $?"
fi

deadline=$((START + BUDGET_S - EVAL_S - FINISH_S))
log "leg: training until $(date -d @$deadline +%T) ($(left $((EVAL_S + FINISH_S))) s)"
stage_args=()
for s in $STAGES; do stage_args+=(--stage "$s"); done
# shellcheck disable=SC2086
python3 "$REPO/benchmarks/gpu_state.py" leg --repo "$REPO" --state-dir "$STATE_DIR" --run "$WORK/run" \
    --out "$OUT" --deadline "$deadline" --started "$START" --device "$DEVICE" --init-from "$INIT_FROM" \
    --leg-steps "$LEG_STEPS" --min-segment-s "$MIN_SEGMENT_S" --save-every-s "$SAVE_EVERY_S" "${stage_args[@]}" \
    --set $SET 2>&1 | tee -a "$OUT/session.log"
status=${PIPESTATUS[0]}

if [ "$EVAL_S" -gt 0 ] && [ -f "$OUT/model.safetensors" ]; then
    for side in candidate default; do
        cap=$(left 10)
        [ "$cap" -gt 5 ] || { log "no time left to score the $side"; break; }
        ckpt=(); csv=accuracy_default.csv
        [ $side = candidate ] && ckpt=(--checkpoint "$OUT/model.safetensors") && csv=accuracy.csv
        log "accuracy of the $side (at most $cap s)"
        timeout -k 5 "$cap" python3 "$REPO/benchmarks/gpu_state.py" score "${ckpt[@]}" --device "$DEVICE" \
            --out "$WORK/eval/$side" --csv "$OUT/$csv" ${EVAL_TABLES:+--tables "$EVAL_TABLES"} 2>&1 \
            | tee -a "$OUT/session.log"
    done
    if [ -f "$OUT/accuracy.csv" ] && [ -f "$OUT/accuracy_default.csv" ]; then
        python3 "$REPO/benchmarks/gpu_state.py" decide --candidate "$OUT/accuracy.csv" \
            --default "$OUT/accuracy_default.csv" 2>&1 | tee -a "$OUT/session.log"
    fi
fi

log "end (exit status $status)"
mkdir -p "$WORK/logs"
for f in session.log train.log metrics.jsonl; do [ -f "$OUT/$f" ] && mv "$OUT/$f" "$WORK/logs/"; done
for side in candidate default; do
    [ -f "$WORK/eval/$side/accuracy.txt" ] && cp "$WORK/eval/$side/accuracy.txt" "$WORK/logs/accuracy_$side.txt"
done
tar -C "$WORK/logs" -czf "$OUT/logs.tar.gz" .
ls -la "$OUT"
exit "$status"
