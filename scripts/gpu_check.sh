#!/usr/bin/env bash
# The GPU checks in one run, for one GPU with a CUDA torch (README, "GPUs"):
#   facts    the GPU, the torch, triton, fla and transformers versions
#   verify   clef-serve verify on the embedded model with the fast kernels forced (--kernels fast): exit 0
#   fault    the same with CLEF_FAULT_ZERO_CONV_BAND=k: must exit 1, the self-check catching a zeroed band
#   bench    python -m benchmarks.gpu --dtype DTYPE: the 9B-shaped table against the reference
#   tests    the device-aware tests with --device cuda (fp32, the CPU suite's tolerances)
#   kernels  fla's kernels against the torch reference ops in DTYPE
#   profile  python -m benchmarks.profile on the GPU: where a mixed workload's time goes, part by part
# Each stage runs under its own time limit, all of them within --budget seconds (a stage with under 20 s left
# is skipped). Each stage's log and summary.txt go to --out. Exit 0 when every stage ran and passed.
#
#   bash scripts/gpu_check.sh [--out DIR] [--wheels DIR] [--dtype bf16|f16] [--budget SECONDS] [--dry-run]
#
# --wheels DIR: first install DIR's wheels (scripts/gpu_wheelhouse.sh) into a private folder, for a host that
# cannot reach a package index. --dry-run: the same stages on the CPU in f32 (benchmarks/gpu.py --dry-run, the
# tests only collected), which checks the script itself; the test suite runs it so.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$ROOT/gpu-check" DTYPE=bf16 BUDGET=480 WHEELS="" DRY=0
while (( $# )); do
    case "$1" in
        --out) OUT=$2; shift 2 ;;
        --wheels) WHEELS=$2; shift 2 ;;
        --dtype) DTYPE=$2; shift 2 ;;
        --budget) BUDGET=$2; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        *) echo "gpu_check.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
OUT="$(realpath -ms "$OUT")"  # paths as given, relative to where this was started
[[ -n "$WHEELS" ]] && WHEELS="$(realpath -ms "$WHEELS")"
PY="${PYTHON:-python3}"
[[ "$PY" == */* ]] && PY="$(realpath -ms "$PY")"  # -s: a virtualenv's python is a link to keep
cd "$ROOT"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
deadline=$(( $(date +%s) + BUDGET ))
failed=0
export PYTHONUNBUFFERED=1

echo "clef-serve $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)'), $(date -u +%FT%TZ)" \
    | tee -a "$SUMMARY"

if [[ -n "$WHEELS" ]]; then
    SITE="${TMPDIR:-/tmp}/clef-gpu-site"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "$WHEELS"/*.whl >"$OUT/install.log" 2>&1; then
        echo "install FAILED: see $OUT/install.log" | tee -a "$SUMMARY"
        exit 1
    fi
    rm "$OUT/install.log"  # what comes back from a lent machine is limited to 8 files
    echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE" | tee -a "$SUMMARY"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's clefserve, installed or not

stage() {  # stage NAME LIMIT_S EXPECTED_EXIT COMMAND...
    local name=$1 limit=$2 expected=$3
    shift 3
    local left=$(( deadline - $(date +%s) ))
    (( limit > left )) && limit=$left
    if (( limit < 20 )); then
        printf '%-8s skipped: %d s of the budget left\n' "$name" "$left" | tee -a "$SUMMARY"
        failed=1
        return
    fi
    local start rc=0 verdict=passed
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    if (( rc == 124 || rc == 137 )); then
        verdict="TIMED OUT after $limit s"
        failed=1
    elif (( rc != expected )); then
        verdict="FAILED: exit $rc, expected $expected"
        failed=1
    fi
    printf '%-8s %s in %d s\n' "$name" "$verdict" "$(( $(date +%s) - start ))" | tee -a "$SUMMARY"
}

if (( DRY )); then
    # on the CPU fla cannot run: its test file skips whole, and pytest exits 5 for collecting nothing
    DTYPE=f32 device=(--d cpu --dtype f32) kernels=() bench=(--dry-run) collect=(--co) fla_exit=5
    pytest_device=(--device cpu) profile=(--shape clef256 --requests 2 --concurrency 2 --long 1000)
else
    device=(--d 0 --dtype "$DTYPE") kernels=(--kernels fast) bench=(--dtype "$DTYPE") collect=() fla_exit=0
    pytest_device=(--device cuda)
    profile=(--shape qwen9b-2048 --requests 16 --concurrency 8 --prefill-chunk-size 8192)
fi

stage facts 60 0 bash -c '
    nvidia-smi -L 2>/dev/null || echo "nvidia-smi: none"
    "$0" - <<"PY"
import importlib.metadata as metadata
import platform

import torch

print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
for index in range(torch.cuda.device_count()):
    print(f"cuda:{index}", torch.cuda.get_device_name(index), "sm", torch.cuda.get_device_capability(index))
for dist in ("triton", "flash-linear-attention", "fla-core", "transformers", "clef-finetune", "fastapi"):
    try:
        print(dist, metadata.version(dist))
    except metadata.PackageNotFoundError:
        print(dist, "not installed")
PY' "$PY"
stage verify 150 0 "$PY" -m clefserve.cli verify "${device[@]}" "${kernels[@]}"
# exit 1 with verify's own FAILED verdict, not a crash before it (that exits 3 here)
stage fault 90 1 bash -c 'out=$("$@" 2>&1); rc=$?; printf "%s\n" "$out"
    [[ $rc == 1 ]] && grep -q "^verify .*: FAILED (" <<<"$out" && exit 1; exit 3' fault \
    env CLEF_FAULT_ZERO_CONV_BAND=k "$PY" -m clefserve.cli verify "${device[@]}" "${kernels[@]}"
stage bench 300 0 "$PY" -m benchmarks.gpu "${bench[@]}"
stage tests 240 0 "$PY" -m pytest -q -p no:cacheprovider "${collect[@]}" "${pytest_device[@]}" \
    tests/test_backbone_equivalence.py tests/test_backbone_chunked.py tests/test_engine_equality.py \
    tests/test_prefix_cache.py tests/test_clef_differential.py tests/test_fla_kernels.py
stage kernels 120 "$fla_exit" "$PY" -m pytest -q -p no:cacheprovider "${collect[@]}" "${pytest_device[@]}" \
    --dtype "$DTYPE" tests/test_fla_kernels.py
stage profile 120 0 "$PY" -m benchmarks.profile "${device[@]}" "${profile[@]}"
exit "$failed"
