#!/usr/bin/env bash
# The planner's accuracy table on a lent GPU (issue 40: "the same table for three zoo models on it"),
# in a few minutes of one device session: the single-world1 question of benchmarks/zoo_accuracy.py
# (world 1, one process: micro-batches 2 to 16 at global batch 16, checkpointing none and every block;
# 8 candidates a model with blocks), each model's grid round 1, its plan and race, its grid round 2,
# as on the CPU; then the page of that folder.
#
#   bash benchmarks/gpu_zoo.sh RUNS_DIR [MODEL...]
#
# MODEL: zoo names (benchmarks/zoo); default llama vit cnn_bn where transformers imports, else
# cnn_bn frozen_tied gru_lm (the model files alone). Env: STEPS (16), PYTHON (python).
# One world on one GPU: a world of 2 would put two NCCL ranks on one device, which NCCL refuses, so
# this is not the CPU's world-2 question; single has no costs of its own to probe (its step is what
# the compute is calibrated on), so no probe runs. Each model prints its seconds; the last line is
# the page (RUNS_DIR/zoo_accuracy.md). On the 2-core CPU (2026-12-04, 6 steps a run) frozen_tied's
# round of 8 runs took 21 s and its plan and race 11 s; the GRU's whole script (4 steps) 38 s.
# On a lent device, one model a call (`bash benchmarks/gpu_zoo.sh $OUT/zoo llama`, then vit, then
# cnn_bn), back to back: a model is about 20 launches (two rounds of 8, the calibration, the race),
# the H200's launches of the paper preset took 19 s each (runs/reference/nvidia-h200/plan_regret), a
# call may last 600 s and the session's device time, the machine's start included, is 15 minutes; a
# model cut short then costs only itself. The page is built afterwards from the records, here:
# python benchmarks/zoo_accuracy.py page --runs_dir DIR --out DIR/zoo_accuracy.md. What is committed of
# DIR is its compact form and a README: python -m analysis.compact DIR --out runs/reference/DEVICE-zoo-single-world1.
set -u
if [ $# -lt 1 ]; then
  echo "usage: bash benchmarks/gpu_zoo.sh RUNS_DIR [MODEL...]" >&2
  exit 2
fi
D=$1; shift
PY=${PYTHON:-python}
STEPS=${STEPS:-16}
if [ $# -gt 0 ]; then
  MODELS=("$@")
elif $PY -c "import transformers" 2>/dev/null; then
  MODELS=(llama vit cnn_bn)
else
  MODELS=(cnn_bn frozen_tied gru_lm)
fi
mkdir -p "$D"
for M in "${MODELS[@]}"; do
  start=$(date +%s)
  $PY benchmarks/zoo_accuracy.py grid --question single-world1 --runs_dir "$D" --models "$M" --rounds 1 --steps "$STEPS" &&
  $PY benchmarks/zoo_accuracy.py plan --runs_dir "$D" --models "$M" --steps "$STEPS" &&
  $PY benchmarks/zoo_accuracy.py grid --question single-world1 --runs_dir "$D" --models "$M" --rounds 2 --steps "$STEPS"
  echo "== $M: exit $?, $(( $(date +%s) - start )) s"
done
$PY benchmarks/zoo_accuracy.py page --runs_dir "$D" --out "$D/zoo_accuracy.md" && echo "page: $D/zoo_accuracy.md"
