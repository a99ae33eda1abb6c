#!/usr/bin/env bash
# What needs a CUDA GPU, in stages sized for a machine lent with a per-command time limit:
# each stage within 4 minutes on an H100 or H200 (a cold CUDA build included), `all` of
# them within 9 (the sizes below come from a run on an H200, 2026-11-28).  The machine
# has its own torch, triton, transformers and pytest and no venv, so the package runs
# from the checkout and needs nothing else (tests/test_stock_machine.py starts every
# stage with only those).
#
#   bash benchmarks/run_gpu.sh tests        every gpu-marked test (make gpu-test); the
#                                           kernel ops' files in parallel processes, so
#                                           their per-configuration builds overlap
#   bash benchmarks/run_gpu.sh attention    bench attention at the kernels' goal shapes
#   bash benchmarks/run_gpu.sh throughput   bench throughput, Qwen2.5-0.5B's shape, 500
#                                           requests, minipaged on each GPU backend (and
#                                           20 of its steps profiled); each HF baseline
#                                           20 s at most (HF_BUDGET_S)
#   bash benchmarks/run_gpu.sh block-size   bench block-size, gpu preset, ShareGPT, four
#                                           block sizes (Fig. 18b)
#   bash benchmarks/run_gpu.sh preemption   bench preemption, gpu preset, two block sizes,
#                                           a pool of 8K tokens so that 50 requests
#                                           preempt (the preset's 15.7K held them all)
#                                           (Fig. 19)
#   bash benchmarks/run_gpu.sh latency      bench latency, gpu preset, one rate (Fig. 12)
#   bash benchmarks/run_gpu.sh all          every stage in turn, each within its share of
#                                           9 minutes plus what the stages before it left
#                                           unused, the tests last; a stage that fails or
#                                           runs out of time does not stop the others
#
# Extra arguments go to the stage's bench (or pytest).  Results (JSON + PNG) go to
# $RESULTS_DIR, else $OUT (the folder a lent machine sends back), else
# benchmarks/results/<device>/ (--update-committed): copy them back and commit.  A stage
# is killed at its limit (STAGE_LIMIT_S, 240 s; in `all` its share; 900 s with SMOKE=1,
# on a CPU).  SMOKE=1 runs the
# same commands at tiny scale on a CPU, into a temporary directory unless one is given,
# to check the script before spending GPU time on it; CI does (tests/test_run_gpu.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STAGES=(attention throughput block-size preemption latency tests)
stage="${1:?usage: run_gpu.sh ${STAGES[*]} all}"
shift
smoke="${SMOKE:-0}"

out="${RESULTS_DIR:-${OUT:-}}"
if [[ "$smoke" == 1 && -z "$out" ]]; then
    out="$(mktemp -d)"
fi
if [[ -n "$out" ]]; then
    mkdir -p "$out"
    where=(--out "$out")
else
    where=(--update-committed)  # benchmarks/results/<device>/<name>.json
fi

# The test files holding gpu-marked tests: `pytest -m gpu tests` would import every test
# module, and many need packages (fastapi, nbmake, ...) that a stock machine lacks.
gpu_test_files() { grep -l "pytest.mark.gpu" tests/test_*.py; }
# The kernel ops' tests build one CUDA module per configuration they launch (several
# seconds each, mostly on a few cores): in 8 processes (pytest-xdist, where installed)
# the builds overlap.  The engine's tests profile the GPU's free memory, so they run
# after them, alone.
OPS_TESTS=(tests/test_ops_cuda.py tests/test_ops_triton.py tests/test_ops_flash.py)
gpu_tests() {
    local parallel=()
    ! python3 -c "import xdist" 2>/dev/null || parallel=(-n 8)
    local rest
    rest=$(gpu_test_files | grep -v -F -x "${OPS_TESTS[@]/#/-e}")
    local ops=0 others=0
    python3 -m pytest -q -rfE "${parallel[@]}" -m gpu "${OPS_TESTS[@]}" "$@" || ops=$?
    # shellcheck disable=SC2086  # one word per file
    python3 -m pytest -q -rfE --durations=15 -m gpu $rest "$@" || others=$?
    ((ops == 0 || ops == 5)) && ((others == 0))
}

# Each stage's command line, at GPU scale or (SMOKE=1) a CPU's tiny one.
stage_command() {
    local bench=(python3 -m minipaged bench)
    if [[ "$smoke" == 1 ]]; then
        case "$1" in
            tests) echo python3 -m pytest -q --collect-only -m gpu $(gpu_test_files) ;;
            attention) echo "${bench[@]}" attention --preset cpu --backends torch ;;
            throughput)
                echo "${bench[@]}" throughput --preset cpu --num-requests 3 --length-scale 0.05 \
                    --overhead-steps 1 --profile-steps 2 --hf-time-budget-s 0.001 \
                    --hf-batch-size 2 --systems minipaged-torch hf-generate hf-generate-batch ;;
            block-size)
                echo "${bench[@]}" block-size --preset cpu --workloads alpaca --num-requests 4 \
                    --block-sizes 8 16 ;;
            preemption)
                echo "${bench[@]}" preemption --preset cpu --block-sizes 16 --num-tokens 32 \
                    --repeats 1 --warmup 0 --num-requests 4 --length-scale 0.05 ;;
            latency)
                echo "${bench[@]}" latency --preset cpu --modes paged --rates 50 \
                    --num-requests 4 ;;
        esac
        return
    fi
    case "$1" in
        tests) echo bash benchmarks/run_gpu.sh _gpu_tests ;;
        attention) echo "${bench[@]}" attention --preset gpu ;;
        throughput)
            echo "${bench[@]}" throughput --preset qwen2.5-0.5b --num-requests 500 \
                --profile-steps 20 --hf-time-budget-s "${HF_BUDGET_S:-20}" \
                --systems minipaged-triton minipaged-cuda minipaged-flash_attn \
                minipaged-flashinfer hf-generate hf-generate-batch hf-continuous-batching ;;
        block-size)
            echo "${bench[@]}" block-size --preset gpu --workloads sharegpt --num-requests 100 \
                --block-sizes 8 16 64 256 ;;
        preemption)
            echo "${bench[@]}" preemption --preset gpu --num-requests 50 --kv-slots 8192 \
                --block-sizes 16 128 ;;
        latency)
            echo "${bench[@]}" latency --preset gpu --num-requests 48 --rates 8 ;;
    esac
}

run_stage() {  # run_stage NAME LIMIT_S [extra arguments]
    local name="$1" limit="$2"
    shift 2
    local cmd
    read -ra cmd <<<"$(stage_command "$name")"
    [[ "$name" == tests ]] || cmd+=("${where[@]}")
    echo "=== $name (limit ${limit} s): ${cmd[*]} $*"
    local start=$SECONDS rc=0
    timeout --kill-after=10 "$limit" "${cmd[@]}" "$@" || rc=$?
    if [[ $rc == 124 || $rc == 137 ]]; then
        echo "=== $name ran out of its ${limit} s"
    fi
    echo "=== $name rc=$rc in $((SECONDS - start)) s"
    return "$rc"
}

case "$stage" in
    all)
        # Shares of 9 minutes (540 s), from the stages' times on an H200 (each bench's
        # cold CUDA builds included; attention's latent-attention rows not yet timed
        # there); what a stage leaves unused goes to the next, so the tests, last, get
        # whatever the benches did not need.
        declare -A share=([attention]=75 [throughput]=140 [block-size]=60 [preemption]=55
                          [latency]=65 [tests]=145)
        export HF_BUDGET_S=10
        failed=()
        spare=0
        for s in "${STAGES[@]}"; do
            # On a CPU (SMOKE=1) the shares of a GPU's time mean nothing: one limit for all.
            limit=$((share[$s] + spare))
            [[ "$smoke" != 1 ]] || limit="${STAGE_LIMIT_S:-900}"
            start=$SECONDS
            run_stage "$s" "$limit" || failed+=("$s")
            spare=$((limit - (SECONDS - start)))
            ((spare > 0)) || spare=0
        done
        [[ -z "$out" ]] || echo "results in $out"
        if ((${#failed[@]})); then
            echo "failed: ${failed[*]}" >&2
            exit 1
        fi ;;
    tests | attention | throughput | block-size | preemption | latency)
        limit="${STAGE_LIMIT_S:-240}"
        [[ "$smoke" != 1 ]] || limit="${STAGE_LIMIT_S:-900}"
        run_stage "$stage" "$limit" "$@"
        [[ -z "$out" || "$stage" == tests ]] || echo "results in $out" ;;
    _gpu_tests)  # the tests stage's command (a function cannot run under `timeout`)
        gpu_tests "$@" ;;
    *)
        echo "unknown stage $stage: ${STAGES[*]} or all" >&2
        exit 2 ;;
esac
