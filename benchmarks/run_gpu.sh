#!/usr/bin/env bash
# What needs a CUDA GPU, in stages, each well under ten minutes so that a machine
# with a per-command time limit can run them one call at a time.  The machine has its own torch,
# triton and transformers and no venv, so the package runs from the checkout.
#
#   bash benchmarks/run_gpu.sh tests        every gpu-marked test (make gpu-test)
#   bash benchmarks/run_gpu.sh attention    bench attention at the kernels' goal shapes
#   bash benchmarks/run_gpu.sh throughput   bench throughput, Qwen2.5-0.5B's shape, every system
#   bash benchmarks/run_gpu.sh block-size   bench block-size, gpu preset (Fig. 18b)
#   bash benchmarks/run_gpu.sh preemption   bench preemption, gpu preset (Fig. 19)
#   bash benchmarks/run_gpu.sh latency      bench latency, gpu preset (Fig. 12; may need
#                                           splitting with --modes to fit 10 minutes)
#
# Results land in benchmarks/results/<device>/ (JSON + PNG, --update-committed): copy them
# back and commit.  SMOKE=1 runs the same commands at tiny scale on a CPU, into a temporary
# directory, to check the script before spending GPU time on it.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
stage="${1:?usage: run_gpu.sh tests|attention|throughput|block-size|preemption|latency}"
shift

if [[ "${SMOKE:-0}" == 1 ]]; then
    out="$(mktemp -d)"
    gpu=(--preset cpu)
    qwen=(--preset cpu --num-requests 4 --length-scale 0.1 --overhead-steps 2)
    where=(--out "$out")
else
    gpu=(--preset gpu)
    qwen=(--preset qwen2.5-0.5b)
    where=(--update-committed)  # benchmarks/results/<device>/<name>.json
fi
bench() { python3 -m minipaged bench "$@"; }

case "$stage" in
    tests)
        if [[ "${SMOKE:-0}" == 1 ]]; then
            python3 -m pytest -m gpu tests --co -q | tail -1  # collection only, on a CPU
        else
            python3 -m pytest -q -m gpu tests
        fi ;;
    throughput)
        bench throughput "${qwen[@]}" "${where[@]}" "$@" ;;
    attention | block-size | preemption | latency)  # extra arguments go to the bench
        bench "$stage" "${gpu[@]}" "${where[@]}" "$@" ;;
    *)
        echo "unknown stage $stage: tests, attention, throughput, block-size, preemption" \
             "or latency" >&2
        exit 2 ;;
esac
