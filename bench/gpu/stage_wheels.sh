#!/usr/bin/env bash
# Stage vLLM 0.26.0 (CUDA wheel, stripped) and the few pure-Python/abi3 wheels the H200 image
# lacks, as xz parts small enough to travel with the repo in separate device calls.
#
# Run HERE (a machine that reaches PyPI), from anywhere:   bash bench/gpu/stage_wheels.sh
# Output (ignored by git), what the device calls carry:
#   .gpu/wheels/*.whl                               the 25 dependency wheels (~17.5 MB)
#   .gpu/vllm-0.26.0-stripped.tar.xz.part-00        first part: with the wheels <= PART_MIB
#   .gpu/vllm-0.26.0-stripped.tar.xz.part-01...     the rest, <= PART_MIB each
#   .gpu/SHA256SUMS, .gpu/MANIFEST.txt
#
# The recipe is ../shared/notes/h200-vllm-recipe.md: vllm==0.26.0 pins torch==2.11.0, which the
# GPU image has; torch, transformers, numpy and everything else the image already holds are NOT
# brought. The wheel is unzipped and what a dense bf16 model on Hopper never loads is left out.
# Re-running is safe: downloads are cached in .gpu/dl/ and the parts are rebuilt.
#
# Env: PART_MIB (default 56) = MiB of parts per call; XZ_LEVEL (default 7); PIP (default: the repo's
# .venv python -m pip, else python3 -m pip).
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
OUT=$REPO/.gpu
DL=$OUT/dl
STAGE=$OUT/stage
PART_MIB=${PART_MIB:-56}
MIB=1048576
XZ_LEVEL=${XZ_LEVEL:-7}
if [ -z "${PIP:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PIP="$REPO/.venv/bin/python -m pip"; else PIP="python3 -m pip"; fi
fi

VLLM=vllm==0.26.0
# The recipe's list (17.5 MB): what vLLM 0.26.0 imports on the serving path and the image lacks.
# msgspec and pyzmq are also what the exporter's KV-event consumer and the driver's recorder need.
DEPS=(
  annotated-types==0.8.0
  apache-tvm-ffi==0.1.15.post2
  cachetools==8.0.2
  cbor2==6.3.0
  fastapi==0.136.3
  httpx2==2.16.2
  jmespath==1.1.0
  llguidance==1.7.6
  model-hosting-container-standards==0.1.16
  msgspec==0.22.0
  openai==3.57.0
  openai-harmony==0.0.8
  partial-json-parser==0.2.1.1.post7
  prometheus-fastapi-instrumentator==8.1.0
  pybase64==1.5.1
  pydantic==2.14.4
  pydantic_core==2.50.5
  pyzmq==27.3.0
  setproctitle==1.3.8
  sniffio==1.3.1
  starlette==1.10.0
  typing-inspection==0.4.5
  uvicorn==0.54.0
  watchfiles==1.3.0
  xgrammar==0.2.9
)
# What a dense bf16 model on SM90 never loads (recipe step 2).
STRIP=(
  vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so
  vllm/_moe_C_stable_libtorch.abi3.so
  vllm/vllm-rs
  'vllm/third_party/deep_gemm/_C.cpython-310-*.so'
  'vllm/third_party/deep_gemm/_C.cpython-311-*.so'
  'vllm/third_party/deep_gemm/_C.cpython-313-*.so'
  'vllm/third_party/deep_gemm/_C.cpython-314-*.so'
  vllm/third_party/deep_gemm/include
  vllm/third_party/fmha_sm100/cutlass
)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64
  --platform manylinux_2_24_x86_64 --platform any)

log() { printf '==> %s\n' "$*" >&2; }
mkdir -p "$DL"

fetch() {  # fetch SPEC...: one pip download per spec, so a missing one is named precisely
  local spec failed=()
  for spec in "$@"; do
    if ! $PIP download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
        "${PLATFORMS[@]}" -d "$DL" "$spec" 2>"$OUT/pip-$spec.err"; then
      failed+=("$spec")
      log "pip found no wheel for $spec:"; tail -3 "$OUT/pip-$spec.err" >&2
    else
      rm -f "$OUT/pip-$spec.err"
    fi
  done
  if ((${#failed[@]})); then log "MISSING: ${failed[*]}"; return 1; fi
}

log "pip download (cache: $DL)"
fetch "$VLLM" "${DEPS[@]}"

# One version of each distribution: two would stop the --no-deps install on the device.
dupes=$(find "$DL" -name '*.whl' -printf '%f\n' | sed -E 's/-[0-9][^-]*-.*//' | tr 'A-Z-' 'a-z_' \
  | sort | uniq -d)
[ -z "$dupes" ] || { log "two versions of: $dupes (clean $DL)"; exit 1; }

log "strip the vLLM wheel"
rm -rf "$STAGE" "$OUT/wheels"; mkdir -p "$STAGE/vllm-tree" "$OUT/wheels"
VWHL=$(ls "$DL"/vllm-0.26.0-*.whl)
python3 -m zipfile -e "$VWHL" "$STAGE/vllm-tree"
full=$(du -sb "$STAGE/vllm-tree" | cut -f1)
( cd "$STAGE/vllm-tree" && for p in "${STRIP[@]}"; do
    # shellcheck disable=SC2086  # globs are intended
    for m in $p; do if [ -e "$m" ]; then rm -rf "$m"; echo "stripped $m"; else echo "absent $m"; fi; done
  done ) >"$STAGE/stripped.txt"
cat "$STAGE/stripped.txt" >&2
left=$(du -sb "$STAGE/vllm-tree" | cut -f1)
log "vllm tree: $full -> $left bytes"
find "$DL" -name '*.whl' ! -name 'vllm-0.26.0-*' -exec cp {} "$OUT/wheels/" \;
wheels_bytes=$(du -cb "$OUT"/wheels/*.whl | tail -1 | cut -f1)
# The first part travels with the dependency wheels: together at most PART_MIB.
first_mib=$(( PART_MIB - (wheels_bytes + MIB - 1) / MIB - 1 ))
if [ "$first_mib" -lt 1 ]; then
  log "PART_MIB=$PART_MIB leaves no room for part-00 beside $((wheels_bytes / MIB)) MiB of wheels:" \
    "use at least $(( (wheels_bytes + MIB - 1) / MIB + 2 ))"
  exit 2
fi

log "tar | xz -$XZ_LEVEL -T0 (a minute or two)"
rm -f "$OUT"/kvoe-gpu.tar.xz* "$OUT"/vllm-0.26.0-stripped.tar.xz*
# Deterministic order, owners and times: a rerun from the same wheel gives the same bytes.
tar -C "$STAGE/vllm-tree" --sort=name --owner=0 --group=0 --numeric-owner --mtime=2026-01-01 \
  -cf - . | xz -"$XZ_LEVEL" -T0 >"$OUT/vllm-0.26.0-stripped.tar.xz"
( cd "$OUT" && head -c $((first_mib * MIB)) vllm-0.26.0-stripped.tar.xz >vllm-0.26.0-stripped.tar.xz.part-00 \
  && tail -c +$((first_mib * MIB + 1)) vllm-0.26.0-stripped.tar.xz \
     | split -b "${PART_MIB}M" -d -a 2 --numeric-suffixes=1 - vllm-0.26.0-stripped.tar.xz.part- )

{
  echo "kvoe-gpu bundle, staged $(date -u +%FT%TZ) by bench/gpu/stage_wheels.sh"
  echo "vllm wheel: $(basename "$VWHL") sha256 $(sha256sum "$VWHL" | cut -d' ' -f1)"
  echo "vllm tree bytes: full $full, after strip $left"
  echo "dependency wheels: $wheels_bytes bytes"
  echo "stripped:"; cat "$STAGE/stripped.txt"
} >"$OUT/MANIFEST.txt"
( cd "$OUT" && sha256sum vllm-0.26.0-stripped.tar.xz vllm-0.26.0-stripped.tar.xz.part-* wheels/*.whl ) \
  >"$OUT/SHA256SUMS"
rm -f "$OUT/vllm-0.26.0-stripped.tar.xz"   # the parts are what travels
rm -rf "$STAGE"
log "to carry (per device call, see bench/gpu/README.md):"
( cd "$OUT" && du -b wheels | tail -1 && ls -l vllm-0.26.0-stripped.tar.xz.part-* SHA256SUMS ) >&2
cat "$OUT/SHA256SUMS"
