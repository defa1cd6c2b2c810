#!/usr/bin/env bash
# The GPU checks and benchmarks of nesa-node, in one run: `pytest -m gpu`, the codecs on CUDA, and the 1.1B swarm
# (bfloat16) against single-process transformers on the same GPU. Run it from the repository root on a CUDA machine
# where the project is installed without its dependencies (`pip install --no-deps -e .`: the machine's torch stays;
# bench/gpu-wheels.sh fetches the other dependencies for a machine without network).
#
#   bench/gpu.sh [quick|full|targets|passes]
#
# passes (at most 580 s of step limits, under a 10-minute command): 2 and 4 eager nodes (decode against the single process), then 16 sessions through 2 nodes
# replaying graphs: as by default, with no gathering wait
# (`--batch-window-ms 0`: a pass takes the steps queued when it starts), and with no wait and the client's sessions in
# 3 waves that follow each other down the chain (`--client-arg head_waves=3`); then the GPU tests.
# targets (within a 9-minute lease): the GPU tests, then the figures issue targets need, most uncertain first, each
# step under its own limit: 2 nodes replaying CUDA graphs with 16 concurrent sessions (batching, and one session's
# decode; the 16 sessions from one client process, then from 16), the same with a 1 ms thread switch interval in every process (NESA_SWITCH_INTERVAL_MS: nesa_node/
# event_loop.py), the codec table, 2 and 4 nodes with graphs (decode against the single process; the first
# generation through fresh nodes), then 2 eager nodes if time is left (about 8 minutes in all on one H100). With
# SPY=1, py-spy profiles the first 16-session run and two generations of its chain (bench/spy.py; it slows the
# processes it samples).
# quick (about 5 minutes on one H100): the GPU tests, the codec table, a span's batched passes in one process
# (bench/batch_pass.py, with and without cuDNN's attention), and 2 nodes replaying CUDA graphs with 16 concurrent
# sessions (batching). full (about 15 minutes) adds 2 and 4 nodes without graphs, libp2p measured first
# (the first mode runs through fresh nodes), with and without 16 concurrent sessions, and 16 sessions through nodes
# that batch prompts too (`--batch-prompts`: compare the first-token figures with the run before).
# Every step writes its JSON line to $OUT/NAME.json and its output to $OUT/NAME.log ($OUT: gpu-results); the nodes'
# logs go to $OUT/NAME-nodes/. A step stops after $STEP_TIMEOUT_S seconds (600) and the next one runs; with
# $DEADLINE_S set, the whole run ends by then (a step gets what is left, and none starts with under 30 s left), so
# that a lease of device time returns what was measured.
set -u
OUT=${OUT:-gpu-results}
PY=${PYTHON:-python3}
STEP_TIMEOUT_S=${STEP_TIMEOUT_S:-600}
DEADLINE_S=${DEADLINE_S:-}
export PYTHONUNBUFFERED=1 PYTHONNODEBUGRANGES=1
mkdir -p "$OUT"

step() {
    local name=$1 limit=$STEP_TIMEOUT_S
    shift
    if [ -n "$DEADLINE_S" ]; then
        local left=$((DEADLINE_S - SECONDS))
        if [ "$left" -lt 30 ]; then
            echo "== $name: skipped, ${left}s left of DEADLINE_S"
            return
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    echo "== $name (at most ${limit}s): $*"
    timeout -k 10 "$limit" "$@" >"$OUT/$name.json" 2>"$OUT/$name.log"
    echo "   exit $? after ${SECONDS}s of the run; $(tail -c 400 "$OUT/$name.json")"
}

# (no paired single-process generations: each step's limit was set without them, and a GPU's speed holds steady)
SWARM=(bench/inference.py --shape 1.1b --device cuda --dtype bfloat16 --no-paired)
GPU_TESTS=(tests/unit/test_decode_graph.py tests/unit/test_batch_graph.py tests/unit/test_span_cache.py
    tests/swarm/test_client_dtype.py tests/unit/test_codec.py tests/unit/test_canary_file.py
    tests/unit/test_decode_gathering.py tests/unit/test_embed_lookup.py)
if [ "${1:-quick}" = passes ]; then
    # First the nodes as by default (eager, no graphs): decode through 2 and 4 of them against the single process, the
    # issue's figure for default nodes, not measured since the host-side work of a step was cut. Then 16 sessions
    # through 2 nodes replaying CUDA graphs (one client process, then 16): nodes as by default, nodes that never wait
    # to gather a pass (the last GPU profile: 2.5-3 ms of each pass waiting), and those with the client's sessions in
    # 3 waves (ClientConfig.head_waves: the client scores one wave while the nodes compute the others, a pipeline; one
    # process's sessions only); then the GPU tests (about 8 minutes on one H200). Capping passes at 8 steps with no
    # wait gave less than either (558 and 697 tokens/s against 582 and 759).
    STEP_TIMEOUT_S=170 step eager-nodes "$PY" "${SWARM[@]}" --nodes 2 4 --modes direct --forward-repeats 0 \
        --keep-logs "$OUT/eager-nodes"
    # (name:node setting:client setting:more arguments; the waves are one process's, so no 16-process twin there)
    for variant in default:--batch-window-ms=25:head_waves=1:--client-processes \
        window0:--batch-window-ms=0:head_waves=1:--client-processes window0-waves3:--batch-window-ms=0:head_waves=3:; do
        IFS=: read -r name node_arg client_arg more <<<"$variant"
        STEP_TIMEOUT_S=110 step "clients16-$name" "$PY" "${SWARM[@]}" --cuda-graphs --nodes 2 --clients 16 $more \
            --clients-only --modes direct --forward-repeats 0 --node-arg="$node_arg" --client-arg "$client_arg" \
            --keep-logs "$OUT/clients16-$name-nodes"
    done
    STEP_TIMEOUT_S=80 step gpu-tests "$PY" -m pytest -q -m gpu "${GPU_TESTS[@]}"
    tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")" && echo "== $OUT.tgz: $(du -h "$OUT.tgz" | cut -f1)"
    exit 0
fi
if [ "${1:-quick}" = targets ]; then
    STEP_TIMEOUT_S=120 step gpu-tests "$PY" -m pytest -q -s -m gpu "${GPU_TESTS[@]}"
    # with SPY=1, py-spy's profiles of the nodes and the client during the 16 sessions (where their round goes),
    # where py-spy is installed (bench/gpu-wheels.sh brings it)
    spy=()
    for site in ${PYTHONPATH:+${PYTHONPATH//:/ }}; do [ -d "$site/bin" ] && PATH=$PATH:$site/bin; done  # pip install --target
    [ "${SPY:-0}" = 1 ] && command -v py-spy >/dev/null && spy=(--spy "$OUT/graphs-clients16-spy")
    STEP_TIMEOUT_S=260 step graphs-clients16 "$PY" "${SWARM[@]}" --cuda-graphs --nodes 2 --clients 16 --modes direct \
        --client-processes --forward-repeats 0 --keep-logs "$OUT/graphs-clients16-nodes" ${spy[@]+"${spy[@]}"}
    NESA_SWITCH_INTERVAL_MS=1 STEP_TIMEOUT_S=200 step graphs-clients16-switch1 "$PY" "${SWARM[@]}" --cuda-graphs \
        --nodes 2 --clients 16 --modes direct --forward-repeats 0 --keep-logs "$OUT/graphs-clients16-switch1-nodes"
    STEP_TIMEOUT_S=60 step codecs "$PY" bench/compression.py --device cuda --no-swarm
    STEP_TIMEOUT_S=200 step graphs-nodes "$PY" "${SWARM[@]}" --cuda-graphs --nodes 2 4 --modes direct \
        --forward-repeats 0 --keep-logs "$OUT/graphs-nodes"
    # what is left of the lease: 2 eager nodes (their bfloat16 tokens against the single process's)
    step eager-nodes "$PY" "${SWARM[@]}" --nodes 2 --modes direct --forward-repeats 0 --keep-logs "$OUT/eager-nodes"
    tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")" && echo "== $OUT.tgz: $(du -h "$OUT.tgz" | cut -f1)"
    exit 0
fi
step gpu-tests "$PY" -m pytest -q -m gpu "${GPU_TESTS[@]}"
step codecs "$PY" bench/compression.py --device cuda --no-swarm
# a pass of 1 to 16 sessions in one process, without and with cuDNN's attention (growing: new lengths every pass)
step batch-pass "$PY" bench/batch_pass.py --shape 1.1b --device cuda --dtype bfloat16 --sessions 1 4 16
step batch-pass-cudnn "$PY" bench/batch_pass.py --shape 1.1b --device cuda --dtype bfloat16 --sessions 1 4 16 \
    --cudnn-attention
# the same with fixed-shape steps and passes replayed as CUDA graphs (pass_16_vs_single: the batching gain there)
step batch-pass-graphs "$PY" bench/batch_pass.py --shape 1.1b --device cuda --dtype bfloat16 --sessions 1 4 16 \
    --cuda-graphs
step graphs-clients16 "$PY" "${SWARM[@]}" --cuda-graphs --nodes 2 --clients 16 --modes direct \
    --keep-logs "$OUT/graphs-clients16-nodes"
if [ "${1:-quick}" = full ]; then
    step eager-clients16 "$PY" "${SWARM[@]}" --nodes 2 --clients 16 --modes direct --forward-repeats 0 \
        --keep-logs "$OUT/eager-clients16-nodes"
    step eager-clients16-prompts "$PY" "${SWARM[@]}" --nodes 2 --clients 16 --modes direct --forward-repeats 0 \
        --node-arg=--batch-prompts --keep-logs "$OUT/eager-clients16-prompts-nodes"
    step eager "$PY" "${SWARM[@]}" --nodes 2 4 --modes direct-libp2p direct relay --keep-logs "$OUT/eager-nodes"
fi
# everything in one archive beside the folder (a lease may return only a few files)
tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")" && echo "== $OUT.tgz: $(du -h "$OUT.tgz" | cut -f1)"
