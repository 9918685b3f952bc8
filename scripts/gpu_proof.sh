#!/usr/bin/env bash
# GPU evidence for the decode-step work, in time-boxed steps (each step's output goes to $OUT/<step>.log and a
# JSON where the tool writes one). Runs from source; wheels the machine lacks are taken from .whl/ if present.
#
#   bash scripts/gpu_proof.sh tests|small|full [OLD_TREE]
#     tests  pytest -m gpu over every package (torch.cuda sync-debug tests included)
#     small  real-width slices with 32 routed experts (V4.1 layers-4, V4 layers-3): kernel launches / host syncs /
#            GPU busy per engine decode step for this tree and, if OLD_TREE (a checkout's packages/ root) is
#            given, for that tree too; `deepinfer bench latency` table against the bytes bound
#     full   the same slices with all experts: bench latency + plot (V4.1), ours vs HF eager (V4)
#     async  the same slices with all experts and asynchronous scheduling: bench latency (engine step beside its graph
#            replayed alone) for V4.1, ours vs HF eager with the engine column asynchronous for V4
#     graphs V4.1 layers-4 with all experts: decode step with CUDA graphs vs eager in one process (bench_graphs.py)
#     runtime the runtime features on CUDA (prefix cache + host tier, async scheduling, speculation, prefill
#            truncation, a data-parallel world of 1 on NCCL, all with CUDA graphs), then on V4.1 layers-4 with 32
#            experts: device idle between decode steps with async scheduling off / on, and the shared-prefix
#            workload with the prefix cache on / off
#     records V4.1 layers-4 with all experts, kv_cache_dtype bfloat16 vs auto (the deployed MXFP8 / NVFP4 records,
#            read in place): decode step against the bytes bound and 64 x 1,024-token prefill for each
#     records-kernels  the sparse-attention record tests (GPU) and the records sweep
#            records and records-kernels take TileLang from $TILELANG_SITE_TARBALL when it is set (an xz tarball of a
#            site-packages folder holding tilelang and its dependencies: scripts/tilelang_site.sh); without it the
#            Triton kernels run
#     records-quick  the records sweep with the staged producer, then kernel_breakdown.py with records and with bf16
#            storage: decode step at B = 1, 64 against the bytes bound, kernel families, a profiled prefill
#     records-final  GPU tests of the FP8 linears, then kernel_breakdown.py with records (B = 1, 64, prefill) and a
#            prefill with bf16 storage
#     records-attn  the sparse-attention record tests (GPU), the records sweep at 256 and 64 tokens (Triton, TileLang
#            64-row and staged producers) and the records decode step with its kernel families (B = 1, 64)
#     records-tests  the sparse-attention record tests (GPU) alone
#     closing  the FP8 linear GPU tests, the records decode step (kernel families), the bf16 decode step table with
#            its plot, V4 against HF eager: one call's evidence for a stop
#     peer   the bf16-storage decode step with its kernel families (B = 1, 64), then V4 against HF eager
#     serving the HTTP server's GPU test, then `bench serving` at 1, 16 and 64 concurrent clients on V4.1 layers-4
#     breakdown V4.1 layers-4 with all experts, bf16 storage: the decode step at B = 64 and 1 kernel by kernel (top 30) with
#            the board's power and SM clock sampled beside it
#     frag   the "frag" FP8 linear (codes decoded into the wgmma operand): its GPU tests and the linear GPU tests, then
#            the FP8 linear sweep at 8, 64 and 256 tokens ("weight" and "frag" tiles; FRAG_BASELINE=path of another
#            linear/triton.py timed as "before")
#     step64 the V4.1 layers-4 decode step (all experts, bf16 storage): `bench latency` at B = 64, 1, 64 (STEP64_BATCHES)
#            against the bytes bound with the power sampled, then the B = 64 step kernel by kernel; STEP64_TESTS=1 runs
#            the engine's CUDA tests (model, graphs, LLM) and the frag kernel's first, STEP64_TESTS=linear the linear
#            kernels' GPU tests
#     dspark the speculative graphs' GPU tests, the Confidence Head check (fused draft round vs eager sampling), then the DSpark policies on the trained
#            testbed (.cache/dspark-testbed, carried) at 32, 128 and 256 prompts, temperature 0 and 1: where the verify curve slopes, the cost policy should prune
#            (DSPARK_PROMPTS, DSPARK_TEMPS, DSPARK_NEW_TOKENS, DSPARK_REPEATS, DSPARK_ASYNC=off|on|both, DSPARK_LIMIT_S,
#            DSPARK_THRESHOLDS: the fixed thresholds compared, DSPARK_EXTRA_WARM: untimed runs while one still captures,
#            DSPARK_SPREAD: mixed output lengths, --length-spread; DSPARK_STEADY: --steady STEPS, a window of full-batch
#            steps; DSPARK_VARIANTS: --cost-variants; DSPARK_MAX_SEQS: --max-num-seqs; DSPARK_AHEAD_AB=1: --ahead-ab;
#            DSPARK_BENCH=0: tests only)
#     dspark-timeline  scripts/spec_timeline.py: device idle time of a steady-state speculative round by host phase
#     dspark-interleaved  scripts/bench_dspark_interleaved.py: the policies round by round inside one steady window
#            per (prompts, temperature) cell, paired by cycle (INTER_PROMPTS, INTER_TEMPS, INTER_CYCLES; INTER_ARGS,
#            e.g. --threshold 0.1 0.2; --device-decision pairs each policy with its decision on the device)
#     decode-ab OLD_TREE  the plain decode step (V4.1 layers-4, all experts, `bench latency` at AB_BATCHES, default
#            1,64) of this tree and of OLD_TREE alternately in one call (AB_ROUNDS, default 2), after an untimed
#            warm-up of each: a change to the decode graph measured against the tree before it on one machine
#     dspark-profile  scripts/spec_round_time.py --profile on the testbed: host phases and device kernels of a speculative
#            round (PROFILE_PROMPTS, default 256; PROFILE_TEMPS, default "1 0"; PROFILE_POLICY, default verify_all)
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
MODE=${1:-tests}
OLD=${2:-}
SITE=/tmp/site
# a warm machine keeps /tmp between calls: reinstall when the carried wheel set differs from the one installed
STAMP=$(ls .whl/*.whl 2>/dev/null | md5sum | cut -c1-32)
if ls .whl/*.whl >/dev/null 2>&1 && [ "$(cat "$SITE/.wheels" 2>/dev/null)" != "$STAMP" ]; then
    rm -rf "$SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    echo "$STAMP" >"$SITE/.wheels"
fi
src_path() { echo "$1/deepinfer-kernels/src:$1/deepinfer-parallel/src:$1/deepinfer-dspark/src:$1/deepinfer-engine/src:$1/deepseek-recipe/src"; }
NEW_PY="$SITE:$(src_path "$ROOT/packages"):$ROOT/packages/deepinfer-engine/tests/support"
export PYTHONPATH="$NEW_PY" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 DEEPINFER_CACHE_DIR=/tmp/deepinfer-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
CK=/tmp/ck
# compiles the engine's TileLang record variants into TileLang's disk cache, one process each (argv: "one" or "two"
# sources, "staged" or "plain" producer; the rows' bytes do not matter for a compile)
WARM_ENGINE_RECORDS='
import sys, torch
from deepinfer_kernels.quant.kv_formats import MXFP8_E4M3, NVFP4_E2M1
from deepinfer_kernels.sparse_attn import tilelang as t
two, staged = sys.argv[1] == "two", sys.argv[2] == "staged"
q = torch.zeros(1, 64, 512, dtype=torch.bfloat16, device="cuda")
kv = torch.zeros(8, MXFP8_E4M3.record_bytes(512), dtype=torch.uint8, device="cuda")
kv2 = torch.zeros(8, NVFP4_E2M1.record_bytes(512), dtype=torch.uint8, device="cuda") if two else None
idx = torch.full((1, 128), -1, dtype=torch.int64, device="cuda")
t.sparse_attn(q, kv, idx, torch.zeros(64, device="cuda"), 512 ** -0.5, kv2=kv2, indices2=idx if two else None,
              kv_format=MXFP8_E4M3, kv2_format=NVFP4_E2M1 if two else None, block_rows=32 if staged else 64,
              staged=staged)
torch.cuda.synchronize()
print("record variant", sys.argv[1:], "compiled")
'
step() {  # step NAME LIMIT_S CMD...
    local name=$1 limit=$2; shift 2
    echo "=== [$name] $(date +%T) limit ${limit}s :: $*"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== [$name] rc=$rc $(date +%T)"
    tail -n 25 "$OUT/$name.log"
}


use_tilelang_site() {  # TileLang is not installed on the lent machines: unpack a carried site folder if given
    if [ -n "${TILELANG_SITE_TARBALL:-}" ] && [ -f "$TILELANG_SITE_TARBALL" ]; then
        mkdir -p /tmp/tl && tar xJf "$TILELANG_SITE_TARBALL" -C /tmp/tl
        export PYTHONPATH="$PYTHONPATH:/tmp/tl" CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
    fi
    python3 -c "import tilelang" 2>/dev/null && echo "tilelang: importable" || echo "tilelang: absent (Triton only)"
}

warm_engine_records() {  # the engine's staged record variants (one and two sources), compiled in the background
    python3 -c "import tilelang" 2>/dev/null || return 0
    for v in "one staged" "two staged"; do
        (timeout 300 python3 -c "$WARM_ENGINE_RECORDS" $v >"$OUT/warm_${v// /_}.log" 2>&1 &)
    done
}

python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
case "$MODE" in
tests)
    step gpu_tests 420 python3 -m pytest -m gpu -q -rs -p no:cacheprovider packages tests
    ;;
small)
    step make_v41 150 python3 -m deepinfer_engine make-checkpoint --arch v41 --preset layers-4 --n-routed-experts 32 --device cuda --out $CK/v41-l4-e32
    step make_v4 120 python3 -m deepinfer_engine make-checkpoint --arch v4 --preset layers-3 --n-routed-experts 32 --device cuda --out $CK/v4-l3-e32
    step profile_new 150 python3 scripts/profile_step.py --model $CK/v41-l4-e32 --batch 1,32 --input-len 1024 --steps 8 \
        --label after --output-json "$OUT/profile_after.json"
    if [ -n "$OLD" ]; then
        step profile_old 150 env PYTHONPATH="$SITE:$(src_path "$OLD")" python3 scripts/profile_step.py --model $CK/v41-l4-e32 \
            --batch 1,32 --input-len 1024 --steps 8 --label before --output-json "$OUT/profile_before.json"
    fi
    step latency_v41_e32 200 python3 -m deepinfer_engine bench latency --model $CK/v41-l4-e32 --device cuda --batch-size 1,8,32,64 --input-len 1024 \
        --output-len 4 --num-iters 1 --num-iters-warmup 0 --decode-steps 8 --output-json "$OUT/latency_v41_e32.json"
    ;;
full)
    step make_v41_full 240 python3 -m deepinfer_engine make-checkpoint --arch v41 --preset layers-4 --device cuda --out $CK/v41-l4
    step latency_v41_full 240 python3 -m deepinfer_engine bench latency --model $CK/v41-l4 --device cuda --batch-size 1,8,32,64 --input-len 1024 \
        --output-len 4 --num-iters 1 --num-iters-warmup 0 --decode-steps 8 --decode-repeats 3 --plot "$OUT/roofline_v41.png" \
        --output-json "$OUT/latency_v41_full.json"
    rm -rf $CK/v41-l4
    rm -rf $CK/v4-l3
    step make_v4_full 150 python3 -m deepinfer_engine make-checkpoint --arch v4 --preset layers-3 --device cuda --out $CK/v4-l3
    step hf_peer 300 python3 scripts/bench_hf_peer.py --model $CK/v4-l3 --batch 1,32 --prefill-len 1024 --decode-steps 16 \
        --iters 2 --output-json "$OUT/hf_peer.json"
    ;;
async)
    step make_v41_full 240 python3 -m deepinfer_engine make-checkpoint --arch v41 --preset layers-4 --device cuda --out $CK/v41-l4
    step latency_v41_async 240 python3 -m deepinfer_engine bench latency --model $CK/v41-l4 --device cuda --batch-size 1,8,32,64 \
        --input-len 1024 --output-len 4 --num-iters 1 --num-iters-warmup 0 --decode-steps 8 --async-scheduling \
        --plot "$OUT/roofline_v41_async.png" --output-json "$OUT/latency_v41_async.json"
    rm -rf $CK/v41-l4
    step make_v4_full 150 python3 -m deepinfer_engine make-checkpoint --arch v4 --preset layers-3 --device cuda --out $CK/v4-l3
    step hf_peer_async 300 python3 scripts/bench_hf_peer.py --model $CK/v4-l3 --batch 1,32 --prefill-len 1024 --decode-steps 16 \
        --iters 2 --async-scheduling --output-json "$OUT/hf_peer_async.json"
    rm -rf $CK/v4-l3
    ;;
graphs)
    step make_v41_full 120 python3 -m deepinfer_engine make-checkpoint --arch v41 --preset layers-4 --device cuda --out $CK/v41-l4
    step graphs_v41 300 python3 scripts/bench_graphs.py --model $CK/v41-l4 --batch 1,8,32,64 --profile-batch 1,64 \
        --input-len 1024 --steps 8 --top-kernels 14 --output-json "$OUT/graphs_v41.json"
    ;;
runtime)
    step runtime_tests 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
        packages/deepinfer-engine/tests/test_runtime_cuda.py packages/deepinfer-engine/tests/dp/test_front_end_cuda.py \
        packages/deepinfer-engine/tests/worker/test_async_runner_cuda.py packages/deepinfer-engine/tests/test_async_step.py \
        packages/deepinfer-engine/tests/model/test_truncation.py packages/deepinfer-engine/tests/test_llm_cuda.py
    step async_idle 150 python3 scripts/bench_async_idle.py --make v41:layers-4:32 --make-dir $CK/v41-l4-e32 --device cuda \
        --dtype bfloat16 --batch 1,32 --input-len 1024 --steps 16 --output-json "$OUT/async_idle_v41.json"
    step shared_prefix 120 python3 -m deepinfer_engine bench throughput --workload shared-prefix --shared-fraction 0.9 \
        --num-prompts 64 --input-len 2048 --output-len 64 --model $CK/v41-l4-e32 --device cuda \
        --output-json "$OUT/shared_prefix_v41.json"
    ;;
records)
    use_tilelang_site
    step make_v41_full 240 python3 -m deepinfer_engine make-checkpoint --arch v41 --preset layers-4 --device cuda --out $CK/v41-l4
    for kv in bfloat16 auto; do
        step latency_v41_$kv 240 python3 -m deepinfer_engine bench latency --model $CK/v41-l4 --device cuda \
            --kv-cache-dtype $kv --batch-size 1,8,32,64 --input-len 1024 --output-len 4 --num-iters 1 \
            --num-iters-warmup 1 --decode-steps 16 --output-json "$OUT/latency_v41_$kv.json"
        step prefill_v41_$kv 180 python3 -m deepinfer_engine bench throughput --model $CK/v41-l4 --device cuda \
            --kv-cache-dtype $kv --num-prompts 64 --input-len 1024 --output-len 1 --output-json "$OUT/prefill_v41_$kv.json"
    done
    rm -rf $CK/v41-l4
    ;;
records-kernels)
    use_tilelang_site
    # TileLang compiles each variant in 10 s (bf16) to 100 s (records) on the host CPU: with pytest-xdist present,
    # four workers share the GPU and compile in parallel
    xdist=""
    python3 -c "import xdist" 2>/dev/null && xdist="-n 4"
    step records_tests 330 python3 -m pytest -m gpu -q -rs -p no:cacheprovider $xdist -k "record" \
        packages/deepinfer-kernels/tests/test_sparse_attn_tilelang.py packages/deepinfer-kernels/tests/test_sparse_attn_triton.py \
        packages/deepinfer-kernels/tests/test_kv_records_triton.py packages/deepinfer-engine/tests/worker/test_cuda_graph_cuda.py
    step records_sweep 240 bash -c "cd packages/deepinfer-kernels/benchmarks && python3 sweep_sparse_attn.py \
        --batches 256,64,32,8,1 --forms rec,two --only none --tilelang 64,32 --tilelang-staged --workers 0 --budget-s 200 --output-json $OUT/records_sweep.json"
    ;;
records-quick)
    # one short call: the records sweep (the staged producer beside the 64-row kernel), then per kv_cache_dtype the
    # decode step at B = 1, 64 against its bytes bound with its kernel families, and a 64 x 1,024-token prefill
    # profiled. The engine's record variants compile in the background meanwhile (TileLang record variants took
    # 16-118 s each on the device host).
    use_tilelang_site
    warm_engine_records
    step staged_sweep 200 bash -c "cd packages/deepinfer-kernels/benchmarks && python3 sweep_sparse_attn.py \
        --batches 256,64 --forms rec --only none --tilelang 64 --tilelang-staged --workers 0 --budget-s 190 --output-json $OUT/staged_sweep.json"
    step make_v41_full 60 python3 -m deepinfer_engine make-checkpoint --arch v41 --preset layers-4 --device cuda --out $CK/v41-l4
    step breakdown_auto 190 python3 scripts/kernel_breakdown.py --model $CK/v41-l4 --kv-cache-dtype auto --batch 1,64 \
        --prefill 64 --top 16 --output-json "$OUT/breakdown_auto.json"
    step breakdown_bf16 120 python3 scripts/kernel_breakdown.py --model $CK/v41-l4 --kv-cache-dtype bfloat16 --batch 1,64 \
        --prefill 64 --top 16 --output-json "$OUT/breakdown_bf16.json"
    ;;
records-final)
    # the decode step with records after the one-pass activation quantization, the staged producer as the records
    # default and the "dense" FP8 linears at prefill sizes: the FP8 linear GPU tests, then kernel_breakdown.py with
    # records (B = 1, 64, a 16 x 1,024-token prefill) and a 32 x 1,024-token prefill with bf16 storage
    use_tilelang_site
    warm_engine_records
    xdist=""
    python3 -c "import xdist" 2>/dev/null && xdist="-n 4"
    step final_tests 75 python3 -m pytest -m gpu -q -rs -p no:cacheprovider $xdist \
        packages/deepinfer-kernels/tests/test_linear_triton.py
    step records_in_place 60 python3 -m pytest -m gpu -q -rs -p no:cacheprovider -k "gpu_records_read_in_place" \
        packages/deepinfer-kernels/tests/test_sparse_attn_triton.py
    step make_v41_full 50 python3 -m deepinfer_engine make-checkpoint --arch v41 --preset layers-4 --device cuda --out $CK/v41-l4
    step breakdown_auto 120 python3 scripts/kernel_breakdown.py --model $CK/v41-l4 --kv-cache-dtype auto --batch 1,64 \
        --prefill 16 --top 12 --output-json "$OUT/breakdown_auto.json"
    step prefill_bf16 60 python3 scripts/kernel_breakdown.py --model $CK/v41-l4 --kv-cache-dtype bfloat16 --batch "" \
        --prefill 32 --top 12 --output-json "$OUT/prefill_bf16.json"
    ;;
records-attn)
    # after a change to the TileLang record producer: its GPU tests, its sweep, the decode step that runs it. The
    # record variants compile in the background first (sweep and engine; 20-110 s each on the device host)
    use_tilelang_site
    warm_engine_records
    python3 -c "import tilelang" 2>/dev/null && for v in "64, False" "32, True"; do
        (cd packages/deepinfer-kernels/benchmarks && timeout 300 python3 -c "import sweep_sparse_attn as s; print(s._warm_tilelang(($v)))" \
            >"$OUT/warm_sweep_${v//[ ,]/}.log" 2>&1 &)
    done
    rm -rf $CK/v41-l4
    step make_v41_full 50 python3 -m deepinfer_engine make-checkpoint --arch v41 --preset layers-4 --device cuda --out $CK/v41-l4
    xdist=""
    python3 -c "import xdist" 2>/dev/null && xdist="-n 4"
    step records_tests 240 python3 -m pytest -m gpu -q -rs -p no:cacheprovider $xdist -k "record" \
        packages/deepinfer-kernels/tests/test_sparse_attn_tilelang.py
    step records_sweep 100 bash -c "cd packages/deepinfer-kernels/benchmarks && python3 sweep_sparse_attn.py \
        --batches 256,64 --forms rec --only none --tilelang 64 --tilelang-staged --workers 0 --budget-s 90 --output-json $OUT/records_sweep.json"
    step breakdown_auto 180 python3 scripts/kernel_breakdown.py --model $CK/v41-l4 --kv-cache-dtype auto --batch 1,64 \
        --top 12 --output-json "$OUT/breakdown_auto.json"
    ;;
records-tests)
    # the TileLang record kernels' GPU tests alone (the record variants compile in the background first)
    use_tilelang_site
    warm_engine_records
    xdist=""
    python3 -c "import xdist" 2>/dev/null && xdist="-n 4"
    step records_tests ${RECORDS_LIMIT_S:-240} python3 -m pytest -m gpu -q -rs -p no:cacheprovider $xdist -k "record" \
        packages/deepinfer-kernels/tests/test_sparse_attn_tilelang.py
    ;;
closing)
    # the evidence for a stop, in one call: the FP8 linear GPU tests (the PDL chain with the activation pass among
    # them), the records decode step with its kernel families (B = 1, 64), the bf16-storage decode step table with its
    # plot (B = 1..64), then V4 against HF eager; each step capped so that the last one is what a short lease loses
    use_tilelang_site
    warm_engine_records
    xdist=""
    python3 -c "import xdist" 2>/dev/null && xdist="-n 4"
    step linear_tests 90 python3 -m pytest -m gpu -q -rs -p no:cacheprovider $xdist -k "pdl or dense or act" \
        packages/deepinfer-kernels/tests/test_linear_triton.py
    step make_v41_full 50 python3 -m deepinfer_engine make-checkpoint --arch v41 --preset layers-4 --device cuda --out $CK/v41-l4
    step breakdown_auto 110 python3 scripts/kernel_breakdown.py --model $CK/v41-l4 --kv-cache-dtype auto --batch 1,64 \
        --top 12 --output-json "$OUT/breakdown_auto.json"
    step latency_v41_bf16 200 python3 -m deepinfer_engine bench latency --model $CK/v41-l4 --device cuda \
        --batch-size 1,8,32,64 --input-len 1024 --output-len 4 --num-iters 1 --num-iters-warmup 1 --decode-steps 16 \
        --decode-repeats 3 --plot "$OUT/roofline_v41.png" --output-json "$OUT/latency_v41_bf16.json"
    rm -rf $CK/v41-l4 $CK/v4-l3
    step make_v4_full 120 python3 -m deepinfer_engine make-checkpoint --arch v4 --preset layers-3 --device cuda --out $CK/v4-l3
    step hf_peer 240 python3 scripts/bench_hf_peer.py --model $CK/v4-l3 --batch 1,32 --prefill-len 1024 --decode-steps 16 \
        --iters 2 --output-json "$OUT/hf_peer.json"
    ;;
frag)
    xdist=""
    python3 -c "import xdist" 2>/dev/null && xdist="-n 4"
    step frag_tests 150 python3 -m pytest -m gpu -q -rs -p no:cacheprovider $xdist \
        packages/deepinfer-kernels/tests/test_linear_fp8_frag.py packages/deepinfer-kernels/tests/test_linear_triton.py
    base=""
    [ -n "${FRAG_BASELINE:-}" ] && base="--baseline-module $FRAG_BASELINE"
    step frag_sweep 230 python3 packages/deepinfer-kernels/benchmarks/sweep_linear_fp8.py --tokens 64,8,256 \
        --modes weight,frag $base --budget-s 200 --workers 15 --output-json "$OUT/frag_sweep.json"
    ;;
step64)
    if [ -n "${STEP64_TESTS:-}" ]; then  # GPU tests first, on the same machine: 1 = the engine's CUDA tests and the
        # frag kernel's, "linear" = the linear kernels' (frag and the others)
        xdist=""
        python3 -c "import xdist" 2>/dev/null && xdist="-n 4"
        tests="packages/deepinfer-engine/tests/model/test_model_cuda.py packages/deepinfer-engine/tests/worker/test_cuda_graph_cuda.py
            packages/deepinfer-engine/tests/test_llm_cuda.py packages/deepinfer-kernels/tests/test_linear_fp8_frag.py"
        [ "$STEP64_TESTS" = linear ] && tests="packages/deepinfer-kernels/tests/test_linear_fp8_frag.py
            packages/deepinfer-kernels/tests/test_linear_triton.py"
        step gpu_tests 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider $xdist $tests
    fi
    rm -rf $CK/v41-l4
    step make_v41_full 80 python3 -m deepinfer_engine make-checkpoint --arch v41 --preset layers-4 --device cuda --out $CK/v41-l4
    nvidia-smi --query-gpu=timestamp,power.draw,power.limit,clocks.sm,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv -lms 250 >"$OUT/smi.csv" 2>&1 &
    smi=$!
    step latency 240 python3 -m deepinfer_engine bench latency --model $CK/v41-l4 --device cuda --batch-size ${STEP64_BATCHES:-64,1,64} \
        --input-len 1024 --output-len 4 --num-iters 1 --num-iters-warmup 1 --decode-steps 16 --decode-repeats 6 \
        --output-json "$OUT/latency.json"
    step breakdown_b64 150 python3 scripts/kernel_breakdown.py --model $CK/v41-l4 --kv-cache-dtype bfloat16 \
        --batch 64 --top 20 --output-json "$OUT/breakdown_b64.json"
    kill $smi 2>/dev/null
    ;;
breakdown)
    # where the B = 64 decode step spends its time, kernel by kernel (top 30), with the board's power, SM clock and
    # throttle reasons sampled every 250 ms beside it (the B = 64 step runs at the 700 W cap: docs/perf.md)
    rm -rf $CK/v41-l4
    step make_v41_full 80 python3 -m deepinfer_engine make-checkpoint --arch v41 --preset layers-4 --device cuda --out $CK/v41-l4
    nvidia-smi --query-gpu=timestamp,power.draw,power.limit,clocks.sm,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv -lms 250 >"$OUT/smi.csv" 2>&1 &
    smi=$!
    step breakdown_b64 200 python3 scripts/kernel_breakdown.py --model $CK/v41-l4 --kv-cache-dtype bfloat16 \
        --batch 64,1 --top 30 --output-json "$OUT/breakdown_b64.json"
    kill $smi 2>/dev/null
    ;;
peer)
    # the bf16-storage decode step by the same tool as the records one (kernel_breakdown.py), then V4 against HF eager
    rm -rf $CK/v41-l4 $CK/v4-l3
    step make_v41_full 50 python3 -m deepinfer_engine make-checkpoint --arch v41 --preset layers-4 --device cuda --out $CK/v41-l4
    step breakdown_bf16 100 python3 scripts/kernel_breakdown.py --model $CK/v41-l4 --kv-cache-dtype bfloat16 --batch 1,64 \
        --top 12 --output-json "$OUT/breakdown_bf16.json"
    rm -rf $CK/v41-l4
    step make_v4_full 120 python3 -m deepinfer_engine make-checkpoint --arch v4 --preset layers-3 --device cuda --out $CK/v4-l3
    step hf_peer 240 python3 scripts/bench_hf_peer.py --model $CK/v4-l3 --batch 1,32 --prefill-len 1024 --decode-steps 16 \
        --iters 2 --output-json "$OUT/hf_peer.json"
    ;;
serving)
    # the HTTP server on CUDA: its GPU test, then `bench serving` (the server in the same process) on V4.1 layers-4
    # with all experts at 1, 16 and 64 concurrent clients (1,024-token prompts, 128 output tokens)
    step server_tests 120 python3 -m pytest -m gpu -q -rs -p no:cacheprovider packages/deepinfer-engine/tests/test_server_cuda.py
    rm -rf $CK/v41-l4
    step make_v41_full 50 python3 -m deepinfer_engine make-checkpoint --arch v41 --preset layers-4 --device cuda --out $CK/v41-l4
    for c in 1 16 64; do
        step serving_c$c 150 python3 -m deepinfer_engine bench serving --model $CK/v41-l4 --device cuda \
            --num-prompts $((c * 4)) --concurrency $c --input-len 1024 --output-len 128 --output-json "$OUT/serving_c$c.json"
    done
    ;;
dspark)
    # the speculative graphs' GPU tests first (ragged verify graphs captured and replayed, greedy equality in fp32;
    # SPEC_TESTS=0 skips them)
    xdist=""
    python3 -c "import xdist" 2>/dev/null && xdist="-n 3"
    [ "${SPEC_TESTS:-1}" = 1 ] && step spec_graph_tests 150 python3 -m pytest -m gpu -q -rs -p no:cacheprovider $xdist \
        packages/deepinfer-engine/tests/worker/test_spec_graphs_cuda.py packages/deepinfer-kernels/tests/test_sampling_draw_triton.py \
        packages/deepinfer-dspark/tests/test_verify.py packages/deepinfer-dspark/tests/test_schedule_device.py
    # the Confidence Head through the fused draft round against the eager sampling (same acceptance, and the same
    # predictions with a survival calibration near 1 expected; CONF_CHECK=0 skips it)
    if [ "${CONF_CHECK:-1}" = 1 ]; then
        for fused in "" "--no-fused-round"; do
            step "confidence_check${fused:+_unfused}" 90 python3 scripts/dspark_confidence_check.py --device cuda $fused
        done
    fi
    [ "${DSPARK_BENCH:-1}" = 1 ] && step dspark_policies ${DSPARK_LIMIT_S:-420} python3 scripts/bench_dspark_policies.py --ckpt .cache/dspark-testbed \
        --device cuda --prompts ${DSPARK_PROMPTS:-32 128 256} --new-tokens ${DSPARK_NEW_TOKENS:-48} --seeds 1000 \
        --temperature ${DSPARK_TEMPS:-0 1} --repeats ${DSPARK_REPEATS:-5} --warm-runs 1 --async-scheduling ${DSPARK_ASYNC:-off} \
        --threshold ${DSPARK_THRESHOLDS:-0.2} --extra-warm-runs ${DSPARK_EXTRA_WARM:-3} --length-spread ${DSPARK_SPREAD:-0} \
        --steady ${DSPARK_STEADY:-0} --cost-variants ${DSPARK_VARIANTS:-} ${DSPARK_MAX_SEQS:+--max-num-seqs $DSPARK_MAX_SEQS} ${DSPARK_AHEAD_AB:+--ahead-ab} \
        --json "$OUT/dspark_policies.json"
    ;;
dspark-profile)
    # where a speculative round's time goes at each batch size: host phases and, with --profile, the device kernels
    # per round (PROFILE_PROMPTS, PROFILE_TEMPS, PROFILE_POLICY)
    for p in ${PROFILE_PROMPTS:-256}; do
        step "spec_round_time_$p" ${PROFILE_LIMIT_S:-240} python3 scripts/spec_round_time.py --ckpt .cache/dspark-testbed \
            --device cuda --prompts "$p" --temperature ${PROFILE_TEMPS:-1 0} --policy ${PROFILE_POLICY:-verify_all} \
            --repeats 2 --profile --top 40 --output-json "$OUT/spec_round_time_$p.json"
    done
    ;;
dspark-interleaved)
    # the policies round by round in one steady window per cell (scripts/bench_dspark_interleaved.py): cost's
    # tokens/s against each rival over the cycles they share (INTER_PROMPTS, INTER_TEMPS, INTER_CYCLES); SPEC_TESTS=1
    # runs the speculative GPU tests first (the graphs, the decision on the device against the host's)
    [ "${SPEC_TESTS:-0}" = 1 ] && step spec_graph_tests 150 python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
        packages/deepinfer-engine/tests/worker/test_spec_graphs_cuda.py packages/deepinfer-dspark/tests/test_schedule_device.py
    step dspark_interleaved ${INTER_LIMIT_S:-420} python3 scripts/bench_dspark_interleaved.py --ckpt .cache/dspark-testbed \
        --device cuda --prompts ${INTER_PROMPTS:-32 128 256} --temperature ${INTER_TEMPS:-1 0} --cycles ${INTER_CYCLES:-96} \
        --json "$OUT/dspark_interleaved.json" ${INTER_ARGS:-}
    ;;
dspark-timeline)
    # where the device waits in a steady-state speculative round: GPU idle per step by host phase (TIMELINE_PROMPTS,
    # TIMELINE_TEMPS, TIMELINE_POLICIES); the chrome traces come back gzipped
    step spec_timeline ${TIMELINE_LIMIT_S:-300} python3 scripts/spec_timeline.py --ckpt .cache/dspark-testbed \
        --prompts ${TIMELINE_PROMPTS:-256} --temperature ${TIMELINE_TEMPS:-1 0} --policy ${TIMELINE_POLICIES:-verify_all cost} \
        --out-dir "$OUT/timeline" ${TIMELINE_ARGS:-}
    ;;
decode-ab)
    # the plain decode step of this tree against OLD_TREE (a checkout's packages/ root, e.g. from `git archive REV
    # packages`, carried untracked) in one call: an untimed warm-up run compiles and captures into the shared
    # caches, then the trees alternate (AB_ROUNDS rounds), each run `bench latency` at AB_BATCHES on V4.1 layers-4
    [ -n "$OLD" ] || { echo "decode-ab needs OLD_TREE" >&2; exit 2; }
    rm -rf $CK/v41-l4
    step make_v41_full 100 python3 -m deepinfer_engine make-checkpoint --arch v41 --preset layers-4 --device cuda --out $CK/v41-l4
    ab_latency() {  # ab_latency NAME PYTHONPATH STEPS REPEATS
        step "$1" 240 env PYTHONPATH="$2" python3 -m deepinfer_engine bench latency --model $CK/v41-l4 --device cuda \
            --batch-size ${AB_BATCHES:-1,64} --input-len 1024 --output-len 4 --num-iters 1 --num-iters-warmup 1 \
            --decode-steps $3 --decode-repeats $4 --output-json "$OUT/$1.json"
    }
    OLD_PY="$SITE:$(src_path "$OLD")"
    ab_latency warm_new "$NEW_PY" 2 1
    ab_latency warm_old "$OLD_PY" 2 1
    for i in $(seq 1 ${AB_ROUNDS:-2}); do
        ab_latency new_$i "$NEW_PY" 16 4
        ab_latency old_$i "$OLD_PY" 16 4
    done
    ;;
*)
    echo "unknown mode $MODE (tests, small, full, async, graphs, runtime, records, records-kernels, records-quick, records-final, records-attn, records-tests, closing, breakdown, peer, serving, dspark, dspark-profile, dspark-timeline, dspark-interleaved, decode-ab)" >&2
    exit 2
    ;;
esac
