#!/usr/bin/env bash
# Continue a small-model pretraining run on a GPU for a fixed wall time, from the repository root:
#
#   OUT=out/gpu2 SECONDS_BUDGET=120 WARM_START=runs/small-gpu/step_0009109 EXTRA_STEPS=3000 \
#       bash benchmarks/gpu_continue.sh
#
# The run resumes WARM_START (a checkpoint folder) with a schedule EXTRA_STEPS longer and stops after
# SECONDS_BUDGET. Every 20 s the latest checkpoint is merged into $OUT/model.safetensors (with its metrics log), so
# a lease cut short still returns the last one. Late in a cosine schedule the learning rate barely moves, so a
# run stopped by the clock ends close to where the full schedule would. The package runs as in gpu_session.sh.
set -u
REPO=$(pwd)
OUT=${OUT:-$REPO/out/gpu2}
SECONDS_BUDGET=${SECONDS_BUDGET:-120}
EXTRA_STEPS=${EXTRA_STEPS:-3000}
WARM_START=${WARM_START:?set WARM_START to a checkpoint folder}
WORK=${WORK:-/tmp/tabfm-gpu2}
DEVICE=${DEVICE:-cuda}
DATA=${DATA:-"data.batch_size=16 data.num_workers=14 data.table.max_rows=1024 data.table.max_features=64"}
mkdir -p "$OUT" "$WORK"

. "$REPO/benchmarks/gpu_tree.sh"  # the package from this checkout, nothing installed; cd $WORK

RUN=$WORK/run
mkdir -p "$RUN/checkpoints"
cp -r "$REPO/$WARM_START" "$RUN/checkpoints/" && basename "$WARM_START" > "$RUN/checkpoints/latest"
step0=$(python3 -c "import json; print(json.load(open('$REPO/$WARM_START/manifest.json'))['step'])")

save() {  # merge the latest checkpoint into $OUT (atomically), with the metrics so far
    python3 -m tabfm.cli ckpt merge "$RUN" -o "$WORK/model.tmp.safetensors" > /dev/null 2>&1 \
        && mv "$WORK/model.tmp.safetensors" "$OUT/model.safetensors"
    [ -f "$RUN/metrics.jsonl" ] && cp "$RUN/metrics.jsonl" "$OUT/metrics.jsonl"
}

timeout -s INT "$SECONDS_BUDGET" python3 -m tabfm.pretrain --config "$REPO/configs/pretrain/small.yaml" \
    --set $DATA train.device=$DEVICE train.out_dir=$RUN train.steps=$((step0 + EXTRA_STEPS)) train.log_every=10 \
    train.checkpoint_every=100 train.eval_every=500 train.progress=false --resume auto > "$OUT/train.log" 2>&1 &
train=$!
while kill -0 $train 2>/dev/null; do sleep 20; save; done
wait $train
save
python3 - "$OUT/metrics.jsonl" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
train = [r for r in rows if "loss" in r]
print(f"steps {train[0]['step']}..{train[-1]['step']}, median {statistics.median(r['seconds'] for r in train):.3f} s/step")
for r in rows:
    if "eval" in r:
        print("eval", r["step"], {k: round(v, 4) for k, v in r["eval"].items() if k.startswith("mean")})
EOF
tail -3 "$OUT/train.log"
ls -la "$OUT"
