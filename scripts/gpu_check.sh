#!/usr/bin/env bash
# GPU check for tensor-parallel training and the allgather-swap switch (issue 3), on one CUDA machine with NCCL.
#   0. scripts/gpu_check.py (one process, torch + transformers only, no Ray): bf16 logit parity with
#      transformers, DCP save/load round trip, rollout tokens/s vs transformers' generate, and the
#      allgather-swap switch with offload, and with vLLM 0.32.0 installed (pip install 'dockrl[vllm]') the vLLM
#      backend's verified weight updates (vllm_update: two weight sets into an engine built without weights,
#      each checked on the probe sequence, greedy tokens against dockrl's engine, tokens/s, seconds per
#      update; skipped, ok, without vLLM); one JSON line per part, kept in $OUT/gpu_check.jsonl.
#   1. dockrl bench reshard on CUDA: allocator peak of the bucketed vs the naive switch (needs >= 2 GPUs
#      for tp/dp layouts; with 1 GPU it runs dp=1 tp=1 -> tp_infer=1).
#   2. two GRPO steps of a tiny model through the CLI with actor.tp=2 -> rollout.tp=1 (needs 2 GPUs) or
#      dp=1 tp=1 on one GPU; prints timings and the run's metrics. Needs Ray: skipped when it is not installed.
# Usage: scripts/gpu_check.sh [OUT_DIR]     (run from the repository root)
# BIN (default .venv/bin) holds python and the dockrl entry point; without $BIN/dockrl the CLI runs as
# `python -m dockrl.cli` with PYTHONPATH=src, and PYTHON (default $BIN/python, else python3) is the interpreter.
set -euo pipefail
OUT=${1:-runs/gpu_check}
BIN=${BIN:-.venv/bin}
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$BIN/python" ]; then PYTHON="$BIN/python"; else PYTHON=python3; fi
fi
if [ -x "$BIN/dockrl" ]; then
  DOCKRL=("$BIN/dockrl")
else
  DOCKRL=(env "PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m dockrl.cli)
fi
mkdir -p "$OUT"
NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -lt 1 ]; then echo "gpu_check: no CUDA device visible" >&2; exit 1; fi
if [ "$NGPU" -ge 2 ]; then DP=1; TP=2; else DP=1; TP=1; fi
echo "== $NGPU GPU(s): $("$PYTHON" -c "import torch; print(torch.cuda.get_device_name(0))")"

echo "== single-process checks (scripts/gpu_check.py, no Ray) -> $OUT/gpu_check.jsonl"
set +e
PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} "$PYTHON" scripts/gpu_check.py --device cuda --out "$OUT" \
  | tee "$OUT/gpu_check.jsonl"
CHECK_STATUS=${PIPESTATUS[0]}
set -e
if [ "$CHECK_STATUS" -ne 0 ]; then echo "gpu_check.py: exit status $CHECK_STATUS (see the lines above)" >&2; fi

echo "== bench reshard (dp=$DP tp_train=$TP -> tp_infer=1), CUDA allocator peaks"
/usr/bin/time -f "bench reshard wall %e s" "${DOCKRL[@]}" bench reshard --device cuda --dp "$DP" --tp-train "$TP" \
  --tp-infer 1 --hidden-size 1024 --num-layers 12 --json | tee "$OUT/bench_reshard.json"

echo "== plan for the same layout (compare switch_extra_bytes with peak_bytes_bucketed)"
"${DOCKRL[@]}" make-tiny "$OUT/tiny" --hidden-size 128 --num-layers 4 >/dev/null
"${DOCKRL[@]}" plan --model "$OUT/tiny/config.json" --dp "$DP" --tp-train "$TP" --tp-infer 1 --json

if "$PYTHON" -c "import ray" 2>/dev/null; then
  echo "== two GRPO steps (actor dp=$DP tp=$TP -> rollout tp=1) on CUDA"
  "${DOCKRL[@]}" data arithmetic "$OUT/data" --num-train 256 --num-test 32 >/dev/null
  cat > "$OUT/grpo.yaml" <<YAML
model: {path: $OUT/tiny}
data: {train_path: $OUT/data/train.jsonl, eval_path: $OUT/data/test.jsonl, eval_limit: 16}
rollout: {samples_per_prompt: 4, max_new_tokens: 16, tp: 1}
actor: {dp: $DP, tp: $TP, lr: 1.0e-4, micro_batch_size: 8}
algo: {kl_coef: 0.01}
run: {steps: 2, prompts_per_step: 8, device: cuda, output_dir: $OUT, name: grpo, progress: false}
YAML
  /usr/bin/time -f "grpo 2 steps wall %e s" "${DOCKRL[@]}" train "$OUT/grpo.yaml"
  "$PYTHON" - "$OUT/grpo/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    keys = [k for k in m if k.startswith(("timing/", "actor/grad_norm", "reward/mean"))]
    print(m["step"], {k: round(m[k], 4) for k in keys})
PY
else
  echo "== Ray is not importable with $PYTHON: skipping the two GRPO steps (dockrl train needs Ray)"
fi
exit "$CHECK_STATUS"
