#!/usr/bin/env bash
# One short GPU lease, run unattended from the repository root:
#   1. benchmarks/kernels_gpu.py: each Triton chunk kernel against its torch reference, with the speed ratio;
#   2. two pretraining runs side by side on the one GPU, their step counts fitted to a wall-clock budget:
#        small-gpu  the small model continued from a checkpoint (WARM_START) on longer, wider tables;
#        base-gpu   the base preset from scratch on the same tables;
#   3. each run's last checkpoint merged into one .safetensors file (in parts), logs and metrics in logs.tar.gz.
#
#   OUT=out/gpu BUDGET_S=330 WARM_START=runs/small3/checkpoints/step_0008000 bash benchmarks/gpu_session.sh
#
# The step counts come from a short calibration (both runs together, as in the real ones), so each learning-rate
# schedule ends inside the budget. The package runs from a symlinked tree (gpu_tree.sh), so nothing needs
# installing but the dependencies (PYTHONPATH may point at carried wheels).
set -u
REPO=$(pwd)
OUT=${OUT:-$REPO/out/gpu}
BUDGET_S=${BUDGET_S:-330}
WARM_START=${WARM_START:-}
WORK=${WORK:-/tmp/tabfm-gpu}
DEVICE=${DEVICE:-cuda}
CALIB_STEPS=${CALIB_STEPS:-40}
MIN_STEPS=${MIN_STEPS:-100}
DATA_EXTRA=${DATA_EXTRA:-}  # more --set items for both runs (a CPU dry run makes the tables small)
mkdir -p "$OUT" "$WORK"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/session.log"; }

. "$REPO/benchmarks/gpu_tree.sh"  # the package from this checkout, nothing installed; cd $WORK
python3 -c "import tabfm.pretrain, torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
    2>&1 | tee -a "$OUT/session.log" || exit 1
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/session.log"

log "kernels"
if [ "$DEVICE" = cuda ]; then
    timeout 150 python3 "$REPO/benchmarks/kernels_gpu.py" 2>&1 | tee "$OUT/kernels_gpu.txt"
fi

# Longer, wider tables than the CPU recipe (up to 1024 rows x 32 features), 16 per step, 6 loader workers each.
DATA="data.batch_size=16 data.num_workers=6 data.table.max_rows=1024 data.table.max_features=32 train.device=$DEVICE $DATA_EXTRA"
SMALL="--config $REPO/configs/pretrain/small.yaml --set $DATA"
BASE="--config $REPO/configs/pretrain/small.yaml --set model=base $DATA optim.lr=5.0e-4 optim.warmup_steps=300"

start_small() {  # $1 out dir, $2 total steps, rest: extra --set items
    local dir=$1 steps=$2; shift 2
    mkdir -p "$dir/checkpoints"
    if [ -n "$WARM_START" ] && [ ! -e "$dir/checkpoints/latest" ]; then
        cp -r "$REPO/$WARM_START" "$dir/checkpoints/" && echo "$(basename "$WARM_START")" > "$dir/checkpoints/latest"
    fi
    python3 -m tabfm.pretrain $SMALL train.out_dir=$dir train.steps=$steps "$@" --resume auto
}
start_base() {
    local dir=$1 steps=$2; shift 2
    python3 -m tabfm.pretrain $BASE train.out_dir=$dir train.steps=$steps "$@"
}
step0=0
[ -n "$WARM_START" ] && step0=$(python3 -c "import json,sys; print(json.load(open('$REPO/$WARM_START/manifest.json'))['step'])")

seconds_per_step() {  # median of the later calibration steps in a metrics log
    python3 - "$1" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
print(statistics.median(r["seconds"] for r in rows[len(rows) // 2:]))
EOF
}

log "calibration: $CALIB_STEPS steps of both runs together"
rm -rf "$WORK/calib-small" "$WORK/calib-base"
start_small "$WORK/calib-small" $((step0 + CALIB_STEPS)) train.log_every=1 train.checkpoint_every=0 \
    train.progress=false > "$OUT/calib-small.log" 2>&1 &
start_base "$WORK/calib-base" $CALIB_STEPS train.log_every=1 train.checkpoint_every=0 train.progress=false \
    > "$OUT/calib-base.log" 2>&1 &
wait
s_small=$(seconds_per_step "$WORK/calib-small/metrics.jsonl") || { tail -20 "$OUT/calib-small.log"; exit 1; }
s_base=$(seconds_per_step "$WORK/calib-base/metrics.jsonl") || { tail -20 "$OUT/calib-base.log"; exit 1; }
# 30 s of each budget go to start-up, evaluations and checkpoints.
n_small=$(python3 -c "print(max($MIN_STEPS, int(($BUDGET_S - 30) / $s_small)))")
n_base=$(python3 -c "print(max($MIN_STEPS, int(($BUDGET_S - 30) / $s_base)))")
log "seconds/step small $s_small base $s_base -> steps small $n_small base $n_base"

log "pretraining ($BUDGET_S s each, side by side)"
start_small "$WORK/small-gpu" $((step0 + n_small)) train.eval_every=1000 train.checkpoint_every=500 \
    train.log_every=10 > "$OUT/small-gpu.log" 2>&1 &
start_base "$WORK/base-gpu" $n_base train.eval_every=1000 train.checkpoint_every=500 train.log_every=10 \
    > "$OUT/base-gpu.log" 2>&1 &
wait
log "pretraining done"

# What comes back: at most a few files under 16 MiB each, so the logs go in one archive and a large merged
# model in 15 MiB parts (cat them back together).
for run in small-gpu base-gpu; do
    python3 -m tabfm.cli ckpt merge "$WORK/$run" -o "$WORK/$run.safetensors" 2>&1 | tail -1
    cp "$WORK/$run/metrics.jsonl" "$OUT/$run-metrics.jsonl"
    tr '\r' '\n' < "$OUT/$run.log" | grep -v "^pretrain:" | tail -3
    tr '\r' '\n' < "$OUT/$run.log" | grep "^pretrain:" | tail -1
    split -b 15M -d "$WORK/$run.safetensors" "$OUT/$run.safetensors.part"
done
latest=$(cat "$WORK/small-gpu/checkpoints/latest")
tar -C "$WORK/small-gpu/checkpoints" -czf "$OUT/small-gpu-checkpoint.tar.gz" "$latest"
log "end"
(cd "$OUT" && files=$(ls ./*.log ./*.jsonl ./*.txt 2>/dev/null); tar -czf logs.tar.gz $files && rm -f $files)
ls -la "$OUT"
