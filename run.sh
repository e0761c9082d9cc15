#!/usr/bin/env bash
# One entry point for a fresh machine:
#   bash run.sh example   build, then run notebooks/examples.ipynb (or the demo) on a local 2-rank CPU pool
#   bash run.sh test      build, then run the whole test suite (then a sanitizer pass over the transport)
#   bash run.sh sanitize  the transport tests against an ASan+UBSan build of the extension
# Everything it needs is bootstrapped: Debian packages (when root), a pinned virtual environment cached
# outside the checkout (keyed by requirements.txt), and an incremental ccache'd build of superkernel._C.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cmd="${1:-}"; shift || true

cache="${SUPERKERNEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/superkernel}"
mkdir -p "$cache"
log() { printf '[run.sh] %s\n' "$*" >&2; }

debian_packages=(build-essential cmake ninja-build ccache python3-venv python3-dev
                 libopenmpi-dev openmpi-bin iproute2 redis-server procps
                 slurmd slurmctld slurm-client munge)  # a private one-node Slurm cluster for the srun tests
ensure_debian() {
  command -v dpkg-query >/dev/null || return 0
  local missing=()
  for p in "${debian_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ]; then
    log "missing Debian packages (not root, so not installing): ${missing[*]}"; return 0
  fi
  log "installing Debian packages: ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

python_bin="${SUPERKERNEL_PYTHON:-$(command -v python3)}"
key="$("$python_bin" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-$(sha256sum "$here/requirements.txt" | cut -c1-12)"
venv="$cache/venv-$key"
ensure_venv() {
  if [ ! -f "$venv/.complete" ]; then
    log "creating virtual environment $venv (pinned by requirements.txt)"
    rm -rf "$venv"
    "$python_bin" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q -r "$here/requirements.txt"
    touch "$venv/.complete"
  fi
  export PATH="$venv/bin:$PATH"
  export VIRTUAL_ENV="$venv"
}

# ccache keyed by paths relative to the checkout and, for builds with debug info (the sanitizer build), not by
# the build directory either, so a fresh clone anywhere hits what an earlier checkout compiled.
ccache_env() {
  export CCACHE_DIR="${CCACHE_DIR:-$cache/ccache}"
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$here}"
  export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
}

build() {
  ccache_env
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
  if [ -n "${SUPERKERNEL_SITE:-}" ]; then
    # Development checkouts (git worktrees) install into their own directory so they never overwrite the
    # venv's copy; PYTHONPATH puts it first for this process and every rank it starts.
    log "building superkernel into $SUPERKERNEL_SITE (build/site in the checkout, ccache in $CCACHE_DIR)"
    (cd "$here" && pip install -q --no-build-isolation --no-deps --upgrade --target "$SUPERKERNEL_SITE" \
        -C build-dir=build/site .)
    export PYTHONPATH="$SUPERKERNEL_SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    log "building superkernel (incremental; build/ in the checkout, ccache in $CCACHE_DIR)"
    (cd "$here" && pip install -q --no-build-isolation --no-deps .)
  fi
  python -c "import superkernel" || { log "superkernel failed to import after the build"; exit 1; }
}

# ASan+UBSan build of the extension, installed into its own directory (the normal build stays untouched);
# python itself is not instrumented, so the sanitizer runtimes are preloaded for every process it starts.
sanitize_env() {
  ccache_env
  local site="$cache/asan-site-$key"
  log "building superkernel with AddressSanitizer + UBSan into $site"
  (cd "$here" && pip install -q --no-build-isolation --no-deps --upgrade --target "$site" \
      -C build-dir=build/sanitize -C cmake.define.SUPERKERNEL_SANITIZE=ON -C cmake.build-type=RelWithDebInfo .)
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
  # CPython's allocations are never freed at exit by design: leak checking would only report those.
  export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
}

ensure_debian
ensure_venv
case "$cmd" in
  example)
    build
    exec python -m superkernel.example "$@"
    ;;
  test)
    build
    cd "$here"
    set +e
    python -m pytest "$@"
    rc=$?
    set -e
    if [ $rc -eq 5 ]; then log "pytest collected no tests: failing"; exit 1; fi
    [ $rc -eq 0 ] || exit $rc
    if [ $# -eq 0 ]; then
      # The whole suite also re-runs the transport's failure paths, the 2-rank collectives, windows, the tensor
      # store (its allocator, its Store worker), fused ops, their agreement board, the packed GEMM, the window
      # copies, the default group made again, the ops and the window waits interrupted (or aborted) mid-transfer on
      # mk between two hosts against an ASan+UBSan build (the full sanitizer run is `bash run.sh sanitize`).
      log "sanitizer pass: transport tests against an ASan+UBSan build"
      set +e
      (sanitize_env && python -m pytest -q tests/transport/test_failures.py tests/transport/test_collectives.py \
          tests/memory/test_window.py tests/memory/test_tensor_store.py tests/memory/test_store_worker.py \
          tests/ops/test_gemm_ops.py tests/ops/test_moe.py tests/ops/test_ring_attention.py tests/transport/test_copy.py \
          tests/ops/test_agreement_board.py tests/ops/test_packed_gemm.py tests/transport/test_reinit.py \
          tests/ops/test_interrupt_in_flight.py tests/memory/test_window_interrupt.py \
          -k "failures or 2ranks or copies_exactly or lock_holder or store_worker or small_staging or board or packed or (mid_transfer and mk) or ends_the_wait or abort_ends")
      rc=$?
      set -e
      if [ $rc -eq 5 ]; then log "sanitizer pass collected no tests: failing"; exit 1; fi
    fi
    exit $rc
    ;;
  sanitize)
    sanitize_env
    cd "$here"
    exec python -m pytest "${@:-tests/transport}"
    ;;
  build)
    build
    ;;
  env)
    [ -n "${SUPERKERNEL_SITE:-}" ] && export PYTHONPATH="$SUPERKERNEL_SITE${PYTHONPATH:+:$PYTHONPATH}"
    exec "$@"
    ;;
  *)
    echo "usage: bash run.sh example | test [pytest args] | sanitize [pytest args] | build | env CMD..." >&2; exit 2 ;;
esac
