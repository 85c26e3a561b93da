#!/usr/bin/env bash
# Training speed, back to back on one machine: sentence-transformers' unsupervised SimCSE
# (ST_SIMCSE: a SimCSE training script written with sentence-transformers' MultipleNegativesRankingLoss that
# prints "sentences/s X"; needs sentence-transformers on PYTHONPATH, e.g. pip install --target DIR)
# against sscl.py --layer 0 (SimCSE) and --layer 5 (SSCL), fp32 and --bf16, and --layer 0 with one padded forward
# a step (--no-length-grouping). Optimisation steps only:
# st_simcse times 10 steps after 2 warm-up steps; sscl.py's log line covers all 12 steps (its first included).
# Usage: ST_PATH=DIR ST_SIMCSE=FILE bash bench/train_speed.sh [MODEL] [TRAIN]
set -u
M=${1:-sentence-transformers/all-MiniLM-L6-v2}
T=${2:-wiki1m_head.txt}
export TRANSFORMERS_VERBOSITY=error
st() { PYTHONPATH=${ST_PATH:-} python "$ST_SIMCSE" --model "$M" --train "$T" --batch-size 64 \
         --max-len 32 --steps 10 --warmup 2 --pooling cls 2>&1 | grep sentences/s; }
ss() { out=$(mktemp -d); echo -n "sscl.py $* : "; python sscl.py --model "$M" --train "$T" --pooler cls --batch-size 64 \
         --max-len 32 --max-steps 12 --eval-steps 1000 --log-steps 12 --no-final-eval --output-dir "$out/r" "$@" 2>&1 \
         | grep -o "sent/s .*"; rm -rf "$out"; }
st; ss --layer 0; ss --layer 0 --no-length-grouping; ss --layer 0 --bf16; ss --layer 5; ss --layer 5 --bf16
st; ss --layer 0; ss --layer 0 --no-length-grouping; ss --layer 0 --bf16
