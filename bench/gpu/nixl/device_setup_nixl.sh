#!/usr/bin/env bash
# Run ON the GPU machine, from the repository root:
#   bash bench/gpu/nixl/device_setup_nixl.sh [--require-complete]
#
# Installs what bench/gpu/nixl/stage_nixl.sh staged (.gpu/nixl/), beside the vLLM bundle of
# bench/gpu/device_setup.sh, never touching it:
#   1. every carried .gpu/nixl/nixl-*.tar.xz.part-NN is checked against .gpu/nixl/SHA256SUMS and
#      kept in /tmp/kvoe-gpu/nixl-parts/ (a later call need not carry it again);
#   2. once every part is there: reassemble, check the whole file's sha256, extract into
#      /tmp/kvoe-gpu/nixl-site (nixl/, nixl_cu13/, nixl_cu13.libs/, .nixl_cu13.mesonpy.libs/);
#   3. check: the system libraries the bundle links (OpenSSL 3, zlib) resolve (ldd), and with
#      torch imported first (as vLLM does) `nixl._api` maps onto nixl_cu13 and an agent with the
#      UCX backend starts; prints the plugin list and UCX's CUDA memory support.
# Idempotent (markers in /tmp/kvoe-gpu). Prints one line:
#   KVOE-NIXL OK nixl=... plugins=[...] ucx_mem=[...] site=/tmp/kvoe-gpu/nixl-site (..s)
#   KVOE-NIXL PARTIAL have=[...] missing=[...]   (exit 0, or 4 with --require-complete)
#   KVOE-NIXL FAIL ...                            (exit 2/3)
# Then: PYTHONPATH=/tmp/kvoe-gpu/site:/tmp/kvoe-gpu/nixl-site:$PWD python3 ...
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
SRC=$(pwd)/.gpu/nixl
BASE=${KVOE_GPU_DIR:-/tmp/kvoe-gpu}
PARTS=$BASE/nixl-parts
SITE=$BASE/nixl-site
REQUIRE=0
[ "${1:-}" = "--require-complete" ] && REQUIRE=1
START=$(date +%s.%N)
mkdir -p "$PARTS" "$SITE"
fail() { echo "KVOE-NIXL FAIL $*"; exit "${CODE:-3}"; }
elapsed() { python3 -c "import time; print(f'{time.time() - $START:.1f}')"; }

if [ -f "$SRC/SHA256SUMS" ]; then
  if [ -f "$PARTS/SHA256SUMS" ] && ! cmp -s "$SRC/SHA256SUMS" "$PARTS/SHA256SUMS"; then
    echo "kvoe-nixl: a new bundle: clearing $PARTS and $SITE"
    rm -rf "$PARTS" "$SITE" "$BASE/.nixl-ok"; mkdir -p "$PARTS" "$SITE"
  fi
  cp "$SRC/SHA256SUMS" "$PARTS/SHA256SUMS"
fi
[ -f "$PARTS/SHA256SUMS" ] || CODE=2 fail "no SHA256SUMS: carry .gpu/nixl/SHA256SUMS"
NAME=$(awk '$2 !~ /\.part-/ { print $2; exit }' "$PARTS/SHA256SUMS")
[ -n "$NAME" ] || CODE=2 fail "SHA256SUMS names no tarball"
want() { awk -v f="$1" '$2 == f { print $1 }' "$PARTS/SHA256SUMS"; }
sha() { sha256sum "$1" | cut -d' ' -f1; }

for p in "$SRC/$NAME".part-*; do
  [ -f "$p" ] || continue
  n=$(basename "$p")
  w=$(want "$n")
  [ -n "$w" ] || fail "$n is not in SHA256SUMS"
  if [ -f "$PARTS/$n" ] && [ "$(stat -c %s "$PARTS/$n")" = "$(stat -c %s "$p")" ]; then continue; fi
  [ "$(sha "$p")" = "$w" ] || fail "$n: sha256 mismatch (a transfer broke; carry it again)"
  cp "$p" "$PARTS/$n.tmp" && mv "$PARTS/$n.tmp" "$PARTS/$n"
  echo "kvoe-nixl: kept $n ($(stat -c %s "$p") bytes)"
done

mapfile -t ALL < <(awk -v n="$NAME.part-" 'index($2, n) == 1 { print $2 }' "$PARTS/SHA256SUMS" | sort)
have=(); lack=()
for n in "${ALL[@]}"; do if [ -f "$PARTS/$n" ]; then have+=("$n"); else lack+=("$n"); fi; done
if [ ! -e "$BASE/.nixl-ok" ] && [ "${#lack[@]}" = 0 ] && [ "${#ALL[@]}" -gt 0 ]; then
  ( cd "$PARTS" && cat "${ALL[@]}" >"$BASE/$NAME" )
  [ "$(sha "$BASE/$NAME")" = "$(want "$NAME")" ] || { rm -f "$BASE/$NAME" "$PARTS"/*.part-*;
    fail "reassembled $NAME: sha256 mismatch (parts cleared: carry them again)"; }
  rm -rf "$SITE"; mkdir -p "$SITE"
  tar -C "$SITE" -xJf "$BASE/$NAME" || fail "cannot extract $NAME"
  rm -f "$BASE/$NAME"
  touch "$BASE/.nixl-ok"
  echo "kvoe-nixl: extracted into $SITE"
fi

if [ -e "$BASE/.nixl-ok" ]; then
  # System libraries the wheel expects (not bundled: OpenSSL 3, zlib); bundled ones resolve at
  # run time through libraries already loaded, so only these are checked.
  unresolved=$(find "$SITE" -name 'libnixl.so' -o -name 'libgrpc-*.so*' -o -name 'libetcd-*.so*' \
    | xargs -r ldd 2>/dev/null | awk '/not found/ && /libssl|libcrypto|libz\./ { print $1 }' \
    | sort -u | tr '\n' ' ')
  [ -z "$unresolved" ] || echo "kvoe-nixl: WARNING unresolved libraries: $unresolved"
  cudart=$(python3 - <<'EOF'
import glob, os, site
for r in site.getsitepackages():
    for p in sorted(glob.glob(os.path.join(r, "nvidia", "**", "libcudart.so.13*"), recursive=True)):
        print(os.path.dirname(p)); raise SystemExit
EOF
  )
  check=$(LD_LIBRARY_PATH="${cudart}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" timeout 120 python3 - 2>"$BASE/nixl-check.log" <<'EOF'
import importlib.metadata as m
import torch  # first, as vLLM does: nixl's meta package reads torch.version.cuda
import nixl._api as api
torch.cuda.init()
agent = api.nixl_agent("kvoe-check", api.nixl_agent_config(num_threads=4, capture_telemetry=True))
print(f"nixl={m.version('nixl')} nixl_cu13={m.version('nixl-cu13')} module={api.__name__} "
      f"torch={torch.__version__} cuda={torch.version.cuda} "
      f"plugins={agent.get_plugin_list()} ucx_mem={agent.get_plugin_mem_types('UCX')}")
EOF
  )
  rc=$?
  if [ $rc -ne 0 ] || [ -z "$check" ]; then
    tail -20 "$BASE/nixl-check.log"
    fail "import or agent start failed (rc=$rc; log $BASE/nixl-check.log)"
  fi
  echo "KVOE-NIXL OK $check cudart=${cudart:-none} site=$SITE ($(elapsed)s)" | tr -d "'"
  exit 0
fi
echo "KVOE-NIXL PARTIAL have=[${have[*]:-}] missing=[${lack[*]:-}] ($(elapsed)s)"
[ "$REQUIRE" = 1 ] && exit 4
exit 0
