#!/usr/bin/env bash
# The GPU check of issue 34, in one device call of at most ~9 minutes.
#
#   benchmarks/gpu_check.sh prepare   # here, before the call: wheels into .gpu/ (ignored)
#   benchmarks/gpu_check.sh           # on the lent machine (carry: [".gpu"])
#
# The device call:  run(command="bash benchmarks/gpu_check.sh", carry=[".gpu"], timeout_s=540)
#
# On the lent machine (torch with CUDA, no index; ../shared/gpu/README.md) it installs
# the wheels of .gpu/ and the project under /tmp/site (the image's torch untouched),
# then, each step under its own time limit so the whole stays within the call:
#   1. the environment: torch, CUDA device, versions            -> $OUT/env.txt
#   2. the cuda-marked tests (the files that hold them)          -> $OUT/cuda_tests.log,
#                                                                   $OUT/cuda_tests.xml
#   3. benchmarks/train_step.py --device cuda: none, save_on_cpu, torchtune, tsh-memory,
#      tsh-host, tsh-auto, with the byte figures (device bytes at the end of forward,
#      bytes each way, PCIe-bound seconds)                       -> $OUT/train_step_cuda.{log,json}
#   4. benchmarks/python_calls.py (Python calls per pack/unpack)  -> $OUT/python_calls.log
# and a summary of what ran and how each step ended              -> $OUT/summary.json
#
# Without a CUDA device it says so, runs what a CPU allows (the tests, which then skip
# their cuda cases; the call counts) and skips the benchmark: the CPU smoke test.
# PYTHON (default python3) picks the interpreter; with the project importable already
# (a development virtualenv), nothing is installed.
set -u -o pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
PY="${PYTHON:-python3}"

if [ "${1:-}" = "prepare" ]; then
    # Here, not on the lent machine: it reaches no index. The project's wheels, and
    # pytest's (pure Python) for the tests.
    mkdir -p .gpu
    cp ../shared/gpu/wheels/*.whl .gpu/ 2>/dev/null || cp /work/shared/gpu/wheels/*.whl .gpu/
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        -d .gpu pytest pluggy iniconfig packaging pygments
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> "$(git rev-parse --git-common-dir)/info/exclude"
    ls .gpu | wc -l | xargs echo "wheels in .gpu/:"
    exit 0
fi

OUT="${OUT:-$here/bench-out/gpu-check}"
mkdir -p "$OUT"
declare -A status

say() { echo "[gpu_check] $*" | tee -a "$OUT/summary.log"; }

if "$PY" -c "import tensorstore_hooks, zarr, numcodecs, crc32c, pydantic, pytest" 2>/dev/null; then
    say "the project is importable already: nothing installed"
elif [ -d .gpu ]; then
    say "installing .gpu/*.whl and the project under /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/*.whl \
        && "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . \
        > "$OUT/install.log" 2>&1 || { say "install failed: see install.log"; status[install]=failed; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
    say "the project is not importable and there is no .gpu/ (run: benchmarks/gpu_check.sh prepare)"
    exit 2
fi

# 1. the environment
"$PY" - > "$OUT/env.txt" 2>&1 <<'EOF'
import torch, tensorstore_hooks
print("torch", torch.__version__, "cuda build", torch.version.cuda)
print("tensorstore_hooks", getattr(tensorstore_hooks, "__version__", "?"))
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"cuda:{i}", p.name, f"{p.total_memory / 2**30:.1f} GiB")
else:
    print("NO CUDA DEVICE")
EOF
cat "$OUT/env.txt"
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    cuda=1
else
    cuda=0
    say "no CUDA device exists here: the cuda tests skip, the GPU benchmark is not run"
fi

# 2. the cuda-marked tests (only the files that hold them: the others need test extras)
files=$(grep -l "mark.cuda" -r tests --include='test_*.py' | sort | tr '\n' ' ')
say "cuda tests in: $files"
timeout 170 "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs --junitxml="$OUT/cuda_tests.xml" \
    $files > "$OUT/cuda_tests.log" 2>&1
rc=$?
status[cuda_tests]=$rc
tail -n 15 "$OUT/cuda_tests.log"
say "cuda tests: exit $rc ($([ $cuda = 1 ] && echo ran || echo 'skipped: no CUDA device'))"

# 3. the GPU benchmark
if [ $cuda = 1 ]; then
    modes="none,save_on_cpu,torchtune,tsh-memory,tsh-host,tsh-auto"
    timeout 280 "$PY" benchmarks/train_step.py --device cuda --modes "$modes" --rounds 2 \
        --steps 3 --json "$OUT/train_step_cuda.json" > "$OUT/train_step_cuda.log" 2>&1
    rc=$?
    status[train_step_cuda]=$rc
    tail -n 25 "$OUT/train_step_cuda.log"
    say "train_step --device cuda: exit $rc"
else
    status[train_step_cuda]=skipped
fi

# 4. Python calls per pack and unpack (host time that must hide under the kernels)
timeout 50 "$PY" benchmarks/python_calls.py > "$OUT/python_calls.log" 2>&1
status[python_calls]=$?
tail -n 12 "$OUT/python_calls.log"

{
    echo "{"
    echo "  \"cuda\": $cuda,"
    for k in "${!status[@]}"; do echo "  \"$k\": \"${status[$k]}\","; done
    echo "  \"out\": \"$OUT\""
    echo "}"
} > "$OUT/summary.json"
cat "$OUT/summary.json"
