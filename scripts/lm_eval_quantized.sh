#!/bin/bash
# lm-evaluation-harness's multiple-choice task (tests/lm_eval_tasks, 50 questions) through
# `minipaged serve`, once per quantization scheme, as docs/performance.md ("Quantized
# weights") reports it: bfloat16 as in `minipaged bench quant`, the INT4 checkpoints that
# bench wrote into WORKDIR.  Prints each scheme's acc and acc_norm.
#   scripts/lm_eval_quantized.sh [WORKDIR] [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
WORKDIR=${1:-$HOME/.cache/minipaged/quantized}
OUT=${2:-$(mktemp -d)/lm_eval}  # outside the checkout
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_DATASETS_CACHE=$OUT/datasets
MODEL=$(python -c "from minipaged.models.hub import resolve_model; print(resolve_model('smollm2'))")
NAME=$(basename "$MODEL")
PORT=18800
for spec in "none:$MODEL:" "int8:$MODEL:--quantization int8" "fp8:$MODEL:--quantization fp8" \
    "rtn:$WORKDIR/$NAME-rtn-g128:" "gptq:$WORKDIR/$NAME-gptq-g128-desc-act:" \
    "awq:$WORKDIR/$NAME-awq-g64:"; do
  scheme=${spec%%:*} rest=${spec#*:}
  path=${rest%%:*} extra=${rest#*:}
  PORT=$((PORT + 1))
  # shellcheck disable=SC2086  # extra is zero or two words
  python -m minipaged serve "$path" --port $PORT --served-model-name smollm2 --device cpu \
    --dtype bfloat16 --swap-space 0.01 $extra > "$OUT-serve-$scheme.log" 2>&1 &
  server=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 1; done
  python -m lm_eval --model local-completions --tasks minipaged_mc \
    --model_args "model=smollm2,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=remote,num_concurrent=1" \
    --include_path tests/lm_eval_tasks --batch_size 8 --output_path "$OUT/$scheme" > /dev/null 2>&1
  kill -INT $server && wait $server || true
  python -c "import glob, json; r = json.load(open(glob.glob('$OUT/$scheme/*/results_*.json')[0]))['results']['minipaged_mc']; print('$scheme', r['acc,none'], r['acc_norm,none'])"
done
