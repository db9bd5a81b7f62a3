#!/usr/bin/env bash
# GPU check for tensor-parallel training and the allgather-swap switch (issue 3), on one CUDA machine with NCCL.
#   1. dockrl bench reshard on CUDA: allocator peak of the bucketed vs the naive switch (needs >= 2 GPUs
#      for tp/dp layouts; with 1 GPU it runs dp=1 tp=1 -> tp_infer=1).
#   2. two GRPO steps of a tiny model through the CLI with actor.tp=2 -> rollout.tp=1 (needs 2 GPUs) or
#      dp=1 tp=1 on one GPU; prints timings and the run's metrics.
# Usage: scripts/gpu_check.sh [OUT_DIR]     (run from the repository root, with .venv built)
set -euo pipefail
OUT=${1:-runs/gpu_check}
BIN=${BIN:-.venv/bin}
mkdir -p "$OUT"
NGPU=$("$BIN/python" -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -lt 1 ]; then echo "gpu_check: no CUDA device visible" >&2; exit 1; fi
if [ "$NGPU" -ge 2 ]; then DP=1; TP=2; else DP=1; TP=1; fi
echo "== $NGPU GPU(s): $("$BIN/python" -c "import torch; print(torch.cuda.get_device_name(0))")"

echo "== bench reshard (dp=$DP tp_train=$TP -> tp_infer=1), CUDA allocator peaks"
/usr/bin/time -f "bench reshard wall %e s" "$BIN/dockrl" bench reshard --device cuda --dp "$DP" --tp-train "$TP" \
  --tp-infer 1 --hidden-size 1024 --num-layers 12 --json | tee "$OUT/bench_reshard.json"

echo "== plan for the same layout (compare switch_extra_bytes with peak_bytes_bucketed)"
"$BIN/dockrl" make-tiny "$OUT/tiny" --hidden-size 128 --num-layers 4 >/dev/null
"$BIN/dockrl" plan --model "$OUT/tiny/config.json" --dp "$DP" --tp-train "$TP" --tp-infer 1 --json

echo "== two GRPO steps (actor dp=$DP tp=$TP -> rollout tp=1) on CUDA"
"$BIN/dockrl" data arithmetic "$OUT/data" --num-train 256 --num-test 32 >/dev/null
cat > "$OUT/grpo.yaml" <<YAML
model: {path: $OUT/tiny}
data: {train_path: $OUT/data/train.jsonl, eval_path: $OUT/data/test.jsonl, eval_limit: 16}
rollout: {samples_per_prompt: 4, max_new_tokens: 16, tp: 1}
actor: {dp: $DP, tp: $TP, lr: 1.0e-4, micro_batch_size: 8}
algo: {kl_coef: 0.01}
run: {steps: 2, prompts_per_step: 8, device: cuda, output_dir: $OUT, name: grpo, progress: false}
YAML
/usr/bin/time -f "grpo 2 steps wall %e s" "$BIN/dockrl" train "$OUT/grpo.yaml"
"$BIN/python" - "$OUT/grpo/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    keys = [k for k in m if k.startswith(("timing/", "actor/grad_norm", "reward/mean"))]
    print(m["step"], {k: round(m[k], 4) for k in keys})
PY
