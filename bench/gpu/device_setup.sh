#!/usr/bin/env bash
# Run ON the GPU machine, from the repository root:   bash bench/gpu/device_setup.sh [--require-complete]
#
# Installs what bench/gpu/stage_wheels.sh staged, from parts that arrive in separate device calls:
#   1. every carried .gpu/vllm-0.26.0-stripped.tar.xz.part-NN is checked against .gpu/SHA256SUMS
#      and copied to /tmp/kvoe-gpu/parts/ (the next call may not carry it again);
#   2. carried .gpu/wheels*/*.whl (.gpu/wheels/, or split over .gpu/wheels-1/, .gpu/wheels-2/...
#      where the repository leaves a call too little room for all of them) are checked and kept
#      in /tmp/kvoe-gpu/wheels/, and installed once all of them are there with
#      pip install --no-index --no-deps --target /tmp/kvoe-gpu/site;
#   3. once every part is there: reassemble, check the whole file's sha256, extract the stripped
#      vLLM tree (vllm/ + vllm-0.26.0.dist-info/) into the same target dir.
# Idempotent and fast on a rerun (markers in /tmp/kvoe-gpu). Prints one line:
#   KVOE-GPU OK vllm=0.26.0 torch=... msgspec=... pyzmq=... python=... site=/tmp/kvoe-gpu/site (..s)
#   KVOE-GPU PARTIAL ...   (some part still missing: exit 0, or 4 with --require-complete)
#   KVOE-GPU FAIL ...      (exit 2/3: no SHA256SUMS, a checksum mismatch, a failed install)
# Then use: PYTHONPATH=/tmp/kvoe-gpu/site:$PWD python3 ...
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
REPO=$(pwd)
DEST=${KVOE_GPU_DIR:-/tmp/kvoe-gpu}
SRC=$REPO/.gpu
NAME=vllm-0.26.0-stripped.tar.xz
REQUIRE=0
[ "${1:-}" = "--require-complete" ] && REQUIRE=1
START=$(date +%s.%N)
mkdir -p "$DEST/parts" "$DEST/site"

fail() { echo "KVOE-GPU FAIL $*"; exit "${CODE:-3}"; }
elapsed() { python3 -c "import time; print(f'{time.time() - $START:.1f}')"; }

# The checksums of this bundle; a different bundle than last time starts over.
if [ -f "$SRC/SHA256SUMS" ]; then
  if [ -f "$DEST/SHA256SUMS" ] && ! cmp -s "$SRC/SHA256SUMS" "$DEST/SHA256SUMS"; then
    echo "kvoe-gpu: a new bundle: clearing $DEST"
    rm -rf "$DEST/parts" "$DEST/wheels" "$DEST/site" "$DEST/.deps-ok" "$DEST/.vllm-ok"
    mkdir -p "$DEST/parts" "$DEST/site"
  fi
  cp "$SRC/SHA256SUMS" "$DEST/SHA256SUMS"
fi
[ -f "$DEST/SHA256SUMS" ] || CODE=2 fail "no SHA256SUMS: carry .gpu/SHA256SUMS"
want() { awk -v f="$1" '$2 == f { print $1 }' "$DEST/SHA256SUMS"; }
sha() { sha256sum "$1" | cut -d' ' -f1; }

# 1. parts
for p in "$SRC/$NAME".part-*; do
  [ -f "$p" ] || continue
  n=$(basename "$p")
  w=$(want "$n")
  [ -n "$w" ] || fail "$n is not in SHA256SUMS (parts of another staging?)"
  if [ -f "$DEST/parts/$n" ] && [ "$(stat -c %s "$DEST/parts/$n")" = "$(stat -c %s "$p")" ]; then
    continue
  fi
  [ "$(sha "$p")" = "$w" ] || fail "$n: sha256 mismatch (a transfer broke; carry it again)"
  cp "$p" "$DEST/parts/$n.tmp" && mv "$DEST/parts/$n.tmp" "$DEST/parts/$n"
  echo "kvoe-gpu: kept $n ($(stat -c %s "$p") bytes)"
done

# 2. dependency wheels
mkdir -p "$DEST/wheels"
wheels_want=0; wheels_have=0
while read -r w f; do
  case "$f" in wheels/*) ;; *) continue ;; esac
  b=${f#wheels/}
  wheels_want=$((wheels_want + 1))
  if [ ! -f "$DEST/wheels/$b" ]; then
    for src in "$SRC"/wheels*/"$b"; do
      [ -f "$src" ] || continue
      [ "$(sha "$src")" = "$w" ] || fail "$f: sha256 mismatch (carry it again)"
      cp "$src" "$DEST/wheels/$b.tmp" && mv "$DEST/wheels/$b.tmp" "$DEST/wheels/$b"
      break
    done
  fi
  [ -f "$DEST/wheels/$b" ] && wheels_have=$((wheels_have + 1))
done <"$DEST/SHA256SUMS"

if [ ! -e "$DEST/.deps-ok" ] && [ "$wheels_want" -gt 0 ] && [ "$wheels_have" = "$wheels_want" ]; then
  # KVOE_PIP_EXTRA: extra pip words, for a dry run elsewhere (e.g. --python-version 3.12 ...)
  # shellcheck disable=SC2086
  if python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade ${KVOE_PIP_EXTRA:-} --target "$DEST/site" "$DEST"/wheels/*.whl \
      >"$DEST/pip.log" 2>&1; then
    touch "$DEST/.deps-ok"
    echo "kvoe-gpu: installed $wheels_have dependency wheels"
  else
    tail -20 "$DEST/pip.log"
    fail "pip install of the dependency wheels failed"
  fi
fi

# 3. vLLM, once every part is here
mapfile -t PARTS < <(awk -v n="$NAME.part-" 'index($2, n) == 1 { print $2 }' "$DEST/SHA256SUMS" | sort)
have=() ; lack=()
for n in "${PARTS[@]}"; do
  if [ -f "$DEST/parts/$n" ]; then have+=("$n"); else lack+=("$n"); fi
done
if [ ! -e "$DEST/.vllm-ok" ] && [ "${#lack[@]}" = 0 ] && [ "${#PARTS[@]}" -gt 0 ]; then
  ( cd "$DEST/parts" && cat "${PARTS[@]}" >"$DEST/$NAME" )
  [ "$(sha "$DEST/$NAME")" = "$(want "$NAME")" ] || { rm -f "$DEST/$NAME" "$DEST"/parts/*;
    fail "reassembled $NAME: sha256 mismatch (parts cleared: carry them again)"; }
  rm -rf "$DEST/site/vllm" "$DEST"/site/vllm-*.dist-info
  if ! tar -C "$DEST/site" -xJf "$DEST/$NAME" 2>"$DEST/tar.log"; then
    python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
      "$DEST/$NAME" "$DEST/site" || fail "cannot extract $NAME: $(tail -3 "$DEST/tar.log")"
  fi
  rm -f "$DEST/$NAME"
  touch "$DEST/.vllm-ok"
  echo "kvoe-gpu: extracted vLLM into $DEST/site"
fi

if [ -e "$DEST/.deps-ok" ] && [ -e "$DEST/.vllm-ok" ]; then
  versions=$(PYTHONPATH="$DEST/site" python3 - <<'EOF'
import importlib.metadata as m
import platform
out = []
for name in ("vllm", "torch", "msgspec", "pyzmq", "nvidia-ml-py"):
    try:
        out.append(f"{name}={m.version(name)}")
    except m.PackageNotFoundError:
        out.append(f"{name}=MISSING")
out.append(f"python={platform.python_version()}")
print(" ".join(out))
EOF
  )
  echo "KVOE-GPU OK $versions site=$DEST/site ($(elapsed)s)"
  exit 0
fi
deps="no (wheels $wheels_have of $wheels_want)"; [ -e "$DEST/.deps-ok" ] && deps=yes
echo "KVOE-GPU PARTIAL deps=$deps parts have=[${have[*]:-}] missing=[${lack[*]:-}] ($(elapsed)s)"
[ "$REQUIRE" = 1 ] && exit 4
exit 0
