#!/usr/bin/env bash
# One GPU session's checks, in steps that each fit a 10-minute command on
# a lent machine without a package registry. Run from the repository root.
#
#   bash benchmarks/gpu_session.sh wheels            # where a registry is reachable: the
#                                                    # peers' wheels into .wheels/ (ignored
#                                                    # by git; carry it to the GPU machine)
#   bash benchmarks/gpu_session.sh tests OUT [ARGS]  # the suite on CUDA, pytest ARGS (e.g. a
#                                                    # few files, to split it into parts,
#                                                    # or -n 15 --timeout 90)
#   bash benchmarks/gpu_session.sh bench OUT PROBLEM...
#                                                    # eager and compiled curvlib and the peers
#                                                    # on CUDA; one or two problems a call (the
#                                                    # compiled first calls take minutes): e.g.
#                                                    # 3c3d-256, allcnnc-96, mlp-1024, resnet-128,
#                                                    # 3c3d, allcnnc, mlp, resnet
#
# OUT receives tests-*.txt / junit-*.xml, or results-cuda.{md,json,png} and bench.log;
# the bench step also copies its results to benchmarks/results/cuda/<problems>/ to
# commit. MEMORY=1 adds the per-method peak-memory processes (slow).
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:?usage: gpu_session.sh wheels | tests OUT [pytest args] | bench OUT [problems]}
shift

install_carried() {
    # the GPU machine's Python is python3 alone
    command -v python >/dev/null || { mkdir -p /tmp/bin; ln -sf "$(command -v python3)" /tmp/bin/python; export PATH="/tmp/bin:$PATH"; }
    # curvlib from the working tree (no build step offline), the peers from .wheels/
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    if compgen -G ".wheels/*.whl" >/dev/null; then
        python -m pip install -q --no-deps --no-index .wheels/*.whl 2>&1 | grep -v "as the 'root' user" || true
    fi
    python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
}

case "$step" in
wheels)
    mkdir -p .wheels
    grep -v '^#' requirements-peers.txt | grep . | xargs pip download -q --no-deps -d .wheels
    pip download -q --no-deps -d .wheels tqdm
    # the GPU machine's image has its own torchvision (built for its torch) and scipy
    rm -f .wheels/torchvision-*.whl .wheels/scipy-*.whl
    ls .wheels
    ;;
tests)
    out=${1:?tests needs OUT}; shift
    mkdir -p "$out"
    install_carried
    tag=$(date +%H%M%S)
    # the docs site's tests need the docs extra (Sphinx), which the GPU machine lacks; they do
    # not depend on the device
    docs=()
    python -c "import sphinx, myst_parser, furo" 2>/dev/null || docs=(--ignore-glob="tests/project/test_docs_*.py")
    # failure_log.py writes each failure's traceback as it happens, so a run stopped
    # by the machine's time limit still brings its tracebacks back
    PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" CURVLIB_FAILURE_LOG="$out/failures-$tag.txt" \
    CURVLIB_TEST_DEVICE=cuda CI=true python -m pytest -q -p no:cacheprovider -p failure_log \
        --junitxml="$out/junit-$tag.xml" "${docs[@]}" "$@" 2>&1 | tee "$out/tests-$tag.txt" | tail -25
    ;;
bench)
    out=${1:?bench needs OUT}; shift
    mkdir -p "$out"
    install_carried
    problems=("${@:?bench needs at least one problem}")
    memory=(--no-memory)
    [ "${MEMORY:-0}" = 1 ] && memory=()
    methods=(BatchGrad opacus "backpack:BatchGrad" SumGradSquared "backpack:SumGradSquared" Variance
             DiagGGNExact "backpack:DiagGGNExact" BatchDiagGGNExact "backpack:BatchDiagGGNExact"
             DiagHessian "backpack:DiagHessian" BatchDiagHessian "backpack:BatchDiagHessian"
             DiagGGNMC "backpack:DiagGGNMC" KFAC "backpack:KFAC" "curvlinops:KFAC(mc)" KFLR "backpack:KFLR"
             compiled:backward compiled:BatchGrad compiled:SumGradSquared compiled:Variance
             compiled:DiagGGNExact compiled:BatchDiagGGNExact compiled:DiagHessian compiled:DiagGGNMC
             compiled:KFAC compiled:KFLR)
    if [ "${EAGER:-0}" = 1 ]; then  # leave out the compiled methods (their first calls take minutes)
        eager=()
        for m in "${methods[@]}"; do [[ $m == compiled:* ]] || eager+=("$m"); done
        methods=("${eager[@]}")
    fi
    python benchmarks/run.py --device cuda --problems "${problems[@]}" --methods "${methods[@]}" \
        --budget 20 --first-call-timeout 120 --sweep-classes "${memory[@]}" --out "$out" 2>&1 \
        | tee "$out/bench.log" | tail -60
    keep="benchmarks/results/cuda/$(IFS=_; echo "${problems[*]}")"
    mkdir -p "$keep" && cp "$out"/results-cuda.* "$keep"/
    ;;
*)
    echo "unknown step $step" >&2
    exit 2
    ;;
esac
