#!/usr/bin/env bash
# Train (or resume) the SmolLM2 DSpark drafter, models/smollm2-135m-instruct-dspark, in the background:
#   1. the target's greedy answers to the training split of the prompt sets (resumable, appended per chunk; the
#      committed data/smollm2-answers/*.jsonl.gz are unpacked first, so only what they lack is generated), and with
#      STAGES including `sampled` its sampled answers to the same prompts (DeepSpec's regeneration: temperature 0.7,
#      top-p 0.8, top-k 20), which the drafter then trains on beside the greedy ones,
#      (SAMPLE_SETS: which sets, default all six), with STAGES including `variants`, its greedy answers to
#      VARIANTS (default 2) number variants of each training prompt with a digit of VARIANT_SETS (default gsm8k
#      math500; chat_data.py --variants: the integers redrawn), more word problems to train on, and with STAGES
#      including `synthetic` its greedy and sampled answers to SYNTHETIC (default all 826) general chat prompts
#      (chat_data.py --synthetic: writing, role play, explanations, advice, small programs; ANSWER_DTYPE: the
#      target's dtype for them, default bfloat16; float32 answers 48 requests faster on a host without AVX-512),
#   2. its answers to 8 evaluation prompts per set (the learning curve's offline acceptance; never trained on),
#   3. the drafter: resumed from .cache/train_smollm2_dspark/ckpt.pt when there is one, else continued from the
#      committed drafter's weights (a fresh optimizer); one cosine lr cycle from LR (default 1e-3) over
#      TRAIN_MINUTES (default 120), the drafter exported to the model folder at every learning-curve point;
#      TARGET_DTYPE (default bfloat16) is the target's dtype for the taps, AUTOCAST (default --autocast, "" for
#      float32) the drafter's matmuls' (a host without AVX-512 bf16 may train faster in float32).
# Progress lines go to .cache/train_smollm2_dspark/*.log. PROMPTS: the folder of the prompt sets (*.jsonl).
# `STAGES=pack bash scripts/train_smollm2_drafter.sh` writes the answers back to data/smollm2-answers/ (to commit).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
WORK=.cache/train_smollm2_dspark
PROMPTS=${PROMPTS:-../shared/data/prompts}
STAGES=${STAGES:-answers,eval,train}
DATA=data/smollm2-answers
mkdir -p "$WORK/answers"
for name in greedy sample greedy_variants greedy_synthetic sample_synthetic eval_greedy; do
    if [[ -f $DATA/$name.jsonl.gz && ! -f $WORK/answers/$name.jsonl ]]; then
        gzip -dc "$DATA/$name.jsonl.gz" > "$WORK/answers/$name.jsonl"
    fi
done
if [[ $STAGES == *answers* ]]; then
    python -m sparkrelay.tools.train.chat_data --prompts "$PROMPTS" --out "$WORK/answers" --max-new 256 \
        --batch 48 --chunk 256 >> "$WORK/answers_greedy.log" 2>&1
fi
if [[ $STAGES == *sampled* ]]; then
    python -m sparkrelay.tools.train.chat_data --prompts "$PROMPTS" --out "$WORK/answers" --mode sample \
        --sets ${SAMPLE_SETS:-gsm8k math500 humaneval mbpp mt-bench livecodebench} --max-new 256 --batch 48 --chunk 256 >> "$WORK/answers_sample.log" 2>&1
fi
if [[ $STAGES == *variants* ]]; then
    python -m sparkrelay.tools.train.chat_data --prompts "$PROMPTS" --out "$WORK/answers" --sets ${VARIANT_SETS:-gsm8k math500} \
        --variants "${VARIANTS:-2}" --max-new 256 --batch 48 --chunk 192 >> "$WORK/answers_variants.log" 2>&1
fi
if [[ $STAGES == *synthetic* ]]; then
    for mode in greedy sample; do
        python -m sparkrelay.tools.train.chat_data --out "$WORK/answers" --mode $mode --synthetic "${SYNTHETIC:-826}" \
            --max-new 256 --batch 48 --chunk 96 --dtype "${ANSWER_DTYPE:-bfloat16}" >> "$WORK/answers_synthetic.log" 2>&1
    done
fi
ANSWERS=("$WORK/answers/greedy.jsonl")
for name in sample greedy_variants; do
    if [[ -f $WORK/answers/$name.jsonl ]]; then ANSWERS+=("$WORK/answers/$name.jsonl"); fi
done
# the general chat answers are listed SYNTHETIC_WEIGHT times (default 2): a file named twice is drawn
# from twice as often, so the few chat answers are not drowned by the thousands of word problems
for name in greedy_synthetic sample_synthetic; do
    for _ in $(seq "${SYNTHETIC_WEIGHT:-2}"); do
        if [[ -f $WORK/answers/$name.jsonl ]]; then ANSWERS+=("$WORK/answers/$name.jsonl"); fi
    done
done
if [[ $STAGES == *eval* ]]; then
    python -m sparkrelay.tools.train.chat_data --prompts "$PROMPTS" --out "$WORK/answers" --split eval \
        --per-set 8 --max-new 256 --batch 48 --chunk 48 >> "$WORK/answers_eval.log" 2>&1
fi
if [[ $STAGES == *train* ]]; then
    python -m sparkrelay.tools.train.drafter --data chat --target models/smollm2-135m-instruct \
        --work-dir "$WORK" --out models/smollm2-135m-instruct-dspark --layers 5 --taps 1 8 14 20 27 \
        --markov-rank 64 --anchors 64 --batch 4 --lr "${LR:-1e-3}" --train-minutes "${TRAIN_MINUTES:-120}" \
        --answers "${ANSWERS[@]}" \
        --init-from models/smollm2-135m-instruct-dspark \
        --eval-every 200 --ckpt-minutes 5 --log-every 10 --max-len 1024 --mask-token "<empty_output>" \
        --target-dtype "${TARGET_DTYPE:-bfloat16}" ${AUTOCAST---autocast} --no-frozen-copies --threads 2 \
        --feature-cache "$WORK/feats" >> "$WORK/train.log" 2>&1
fi
if [[ $STAGES == *pack* ]]; then
    mkdir -p "$DATA"
    for name in greedy sample greedy_variants greedy_synthetic sample_synthetic eval_greedy; do
        if [[ -f $WORK/answers/$name.jsonl ]]; then
            gzip -9nc "$WORK/answers/$name.jsonl" > "$DATA/$name.jsonl.gz"
        fi
    done
fi
