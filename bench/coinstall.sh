#!/usr/bin/env bash
# Installs overlap-spec beside sglang 0.5.23 and its own torch, and shows torch unchanged.
#
#   bench/coinstall.sh [--find-links DIR] [--venv DIR] 2>&1 | tee bench/results/DATE-coinstall.log
#
# In a fresh venv (default /tmp/overlap-spec-coinstall, deleted first and afterwards unless
# --keep): torch==2.14.1, sglang's own pin (from the registry; --find-links adds a folder of
# wheels, e.g. /work/wheels/t214); sglang 0.5.23 with --no-deps from
# upstream/requirements-sglang-0.5.23.lock, as ./dev upstream builds it, except the lock's
# lines for packages torch's install already holds (triton: the lock was made beside torch
# 2.13.0, and torch pins the triton it was built with); then this project, its dependencies
# resolved by pip as usual (not --no-deps). It fails if that last install changed any torch
# package. Then, from that venv: the import of both, `overlap-spec upstream check` on one
# cell (this interpreter imports sglang, so the tier drives this venv's sglang), and the
# upstream tier's offline tests.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=/tmp/overlap-spec-coinstall
LINKS=()
KEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --find-links) LINKS+=(--find-links "$2"); shift 2 ;;
    --venv) VENV=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    *) echo "usage: $0 [--find-links DIR] [--venv DIR] [--keep]" >&2; exit 2 ;;
  esac
done
LOCK="$ROOT/upstream/requirements-sglang-0.5.23.lock"
PY="$VENV/bin/python"
STARTED=$SECONDS
# The '+ command' lines and each step's seconds make the log readable on its own.
run() { echo "+ $*"; local t=$SECONDS; "$@"; echo "[coinstall] $((SECONDS - t)) s"; }
# pip's notes about index folders absent on this machine are noise in a log.
venv_pip() { "$PY" -m pip "$@" 2> >(grep -v "^WARNING: Location" >&2); }
torch_packages() { "$PY" -m pip freeze | grep -iE '^(torch|triton|nvidia|cuda)' || true; }

echo "[coinstall] $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(python3 --version)," \
     "overlap-spec from $ROOT at $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
rm -rf "$VENV"
run python3 -m venv "$VENV"
run venv_pip install -q "torch==2.14.1" "${LINKS[@]}"

echo "[coinstall] sglang 0.5.23 from $LOCK (--no-deps), less what torch's install holds:"
FILTERED="$VENV/sglang-lock.txt"
INSTALLED=$("$PY" -m pip freeze | sed 's/==.*//' | tr 'A-Z_' 'a-z-')
: > "$FILTERED"
while IFS= read -r line; do
  name=$(echo "${line%%#*}" | sed 's/[=<>!~ ].*//' | tr 'A-Z_' 'a-z-')
  [ -z "$name" ] && continue
  if grep -qx "$name" <<< "$INSTALLED"; then
    echo "  dropped: $line (torch installed $("$PY" -m pip freeze | grep -i "^$name=="))"
  else
    echo "$line" >> "$FILTERED"
  fi
done < "$LOCK"
run venv_pip install -q --no-deps -r "$FILTERED"

echo "[coinstall] torch packages before installing overlap-spec:"
BEFORE=$(torch_packages); echo "$BEFORE"
run venv_pip install -q "$ROOT"
echo "[coinstall] torch packages after:"
AFTER=$(torch_packages); echo "$AFTER"
if [ "$BEFORE" != "$AFTER" ]; then
  echo "[coinstall] FAILED: installing overlap-spec changed torch packages" >&2
  diff <(echo "$BEFORE") <(echo "$AFTER") >&2 || true
  exit 1
fi
echo "[coinstall] torch unchanged; what overlap-spec's install resolved:"
"$PY" -m pip freeze | grep -iE '^(overlap-spec|overlap_spec|hypothesis|z3-solver|sortedcontainers)' \
  || true
echo "[coinstall] pip check: the lock is the --no-deps subset that runs sglang's scheduler on"\
     "CPU, so sglang's other requirements show as missing; none may concern overlap-spec's:"
CHECKED=$("$PY" -m pip check 2>&1 || true); echo "$CHECKED"
if grep -iE 'overlap|hypothesis|z3-solver|sortedcontainers' <<< "$CHECKED"; then
  echo "[coinstall] FAILED: pip check names overlap-spec or one of its dependencies" >&2
  exit 1
fi

# pytest, for the offline tests at the end (at requirements.lock's version).
run venv_pip install -q "$(grep -i '^pytest==' "$ROOT/requirements.lock")"
run "$PY" -c "import overlap_spec.spec.invariants, sglang, torch, hypothesis
print('sglang', sglang.__version__, 'torch', torch.__version__, 'hypothesis', hypothesis.__version__)"

# Outside the checkout, so nothing here can fall back to its .venv-upstream.
cd "$VENV"
set +e
OVERLAP_SPEC_OUT="$VENV/out" run "$VENV/bin/overlap-spec" upstream check --cells ov-p1-none \
  --profile quick --json "$VENV/upstream-check.json"
CHECK=$?
echo "[coinstall] overlap-spec upstream check exited $CHECK"
# The tier must say it drove this venv's sglang, not another environment's.
if [ "$CHECK" = 0 ] && ! "$PY" -c "import json, sys
sglang = json.load(open('$VENV/upstream-check.json'))['sglang']
print('[coinstall] driven:', sglang['version'], 'in', sglang['environment'])
sys.exit(sglang['python'] != '$PY')"; then
  echo "[coinstall] FAILED: the tier did not drive this venv's sglang" >&2
  CHECK=1
fi
cd "$ROOT"
OVERLAP_SPEC_OUT="$VENV/out" run "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_upstream_offline.py
TESTS=$?
set -e
echo "[coinstall] upstream offline tests exited $TESTS"
if [ "$KEEP" = 0 ]; then rm -rf "$VENV"; fi
echo "[coinstall] $((SECONDS - STARTED)) s in all; torch unchanged," \
     "upstream check exit $CHECK, offline tests exit $TESTS"
[ "$CHECK" = 0 ] && [ "$TESTS" = 0 ]
