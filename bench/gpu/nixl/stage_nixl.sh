#!/usr/bin/env bash
# Stage NIXL for the H200 machine (no network there): nixl-cu13 1.5.1 (the CUDA 13 build, with
# its own UCX 1.23) and the `nixl` meta package vLLM imports (`nixl._api`), stripped of what
# NixlConnector never loads, as an xz tarball split into parts that travel in separate device
# calls next to the repository.
#
# Run HERE (a machine that reaches PyPI):   bash bench/gpu/nixl/stage_nixl.sh
# Output (git-ignored, under .gpu/nixl/ so the vLLM bundle of bench/gpu/stage_wheels.sh and its
# .gpu/SHA256SUMS are left alone):
#   .gpu/nixl/nixl-1.5.1-stripped.tar.xz.part-NN   <= PART_MIB each (default 38)
#   .gpu/nixl/SHA256SUMS, .gpu/nixl/MANIFEST.txt
# Installed on the device by bench/gpu/nixl/device_setup_nixl.sh.
#
# Why these wheels and what is stripped: docs/backends.md, "NIXL on one GPU". In short: vLLM
# 0.26.0 imports `nixl._api` (vllm/distributed/nixl_utils.py), which the `nixl` meta package maps
# onto `nixl_cu13` when torch reports CUDA 13 (the image's torch 2.11.0+cu130). NixlConnector
# uses only the UCX backend plugin; UCX needs only its cuda (cuda_copy, cuda_ipc) and cma
# modules on a machine without InfiniBand. Dropped: nixl_ep_cu13 (expert-parallel kernels, built
# for torch 2.12-2.14 only), headers and example programs, the storage/network plugins (GDS,
# GPUNETIO, LIBFABRIC, OBJ, AZURE_BLOB, GUSLI, INFINIA), UCX's InfiniBand and perftest modules,
# and the libraries only those need. With readelf present the script checks that nothing kept
# links against something dropped. Not bundled, taken from the system: glibc, libstdc++, OpenSSL 3
# (libssl.so.3, libcrypto.so.3: grpc and etcd-cpp-api, which libnixl.so links) and zlib;
# device_setup_nixl.sh checks them with ldd. STRIP=0 keeps the whole wheel.
#
# Env: PART_MIB (default 38), XZ_LEVEL (default 7), STRIP (default 1), PIP (default: the repo's
# .venv python -m pip, else python3 -m pip), NIXL_VERSION (default 1.5.1).
set -euo pipefail
cd "$(dirname "$0")/../../.."
REPO=$(pwd)
OUT=$REPO/.gpu/nixl
DL=$OUT/dl
STAGE=$OUT/stage
PART_MIB=${PART_MIB:-38}
XZ_LEVEL=${XZ_LEVEL:-7}
STRIP=${STRIP:-1}
VER=${NIXL_VERSION:-1.5.1}
NAME=nixl-$VER-stripped.tar.xz
[ "$STRIP" = 1 ] || NAME=nixl-$VER-full.tar.xz
if [ -z "${PIP:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PIP="$REPO/.venv/bin/python -m pip"; else PIP="python3 -m pip"; fi
fi
log() { printf '==> %s\n' "$*" >&2; }
mkdir -p "$DL"

log "pip download nixl-cu13==$VER nixl==$VER (cp312, manylinux_2_28; cache: $DL)"
for spec in "nixl-cu13==$VER" "nixl==$VER"; do
  $PIP download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi none \
    --platform manylinux_2_28_x86_64 --platform any -d "$DL" "$spec"
done
CU=$(ls "$DL"/nixl_cu13-"$VER"-cp312-cp312-manylinux_2_28_x86_64.whl)
META=$(ls "$DL"/nixl-"$VER"-py3-none-any.whl)

rm -rf "$STAGE"; mkdir -p "$STAGE/site"
python3 -m zipfile -e "$CU" "$STAGE/site"
python3 -m zipfile -e "$META" "$STAGE/site"
full=$(du -sb "$STAGE/site" | cut -f1)

STRIPPED=(
  nixl_ep_cu13 nixl_ep "nixl_cu13-$VER.data" nixl_cu13.scripts
  'nixl_cu13.libs/ucx/*.la'
  'nixl_cu13.libs/ucx/libuct_ib*' 'nixl_cu13.libs/ucx/libucx_perftest*'
  'nixl_cu13.libs/libaws-cpp-sdk-s3-*' 'nixl_cu13.libs/libazure-*' 'nixl_cu13.libs/libxml2-*'
  'nixl_cu13.libs/libgusli_clnt-*' 'nixl_cu13.libs/libibverbs-*' 'nixl_cu13.libs/libmlx5-*'
  'nixl_cu13.libs/libnl-3-*' 'nixl_cu13.libs/libnl-route-3-*'
)
for plugin in AZURE_BLOB GDS GDS_MT GPUNETIO GUSLI INFINIA LIBFABRIC OBJ; do
  STRIPPED+=("nixl_cu13.libs/nixl/libplugin_$plugin.so" ".nixl_cu13.mesonpy.libs/plugins/libplugin_$plugin.so")
done
STRIPPED+=('nixl_cu13.libs/nixl/libtelemetry_exporter_doca.so'
  '.nixl_cu13.mesonpy.libs/plugins/libtelemetry_exporter_doca.so')

# Library names the wheel itself brings: after the strip, none a kept file links against may be gone.
( cd "$STAGE/site" && find . -name '*.so*' -type f -printf '%f\n' | sort -u ) >"$OUT/bundled.txt"
if [ "$STRIP" = 1 ]; then
  ( cd "$STAGE/site" && for p in "${STRIPPED[@]}"; do
      # shellcheck disable=SC2086  # globs are intended
      for m in $p; do if [ -e "$m" ]; then rm -rf "$m"; echo "stripped $m"; else echo "absent $m"; fi; done
    done ) >"$OUT/stripped.txt"
  # nixl_ep's meta package (top-level nixl_ep/) needs nixl_ep_cu13: gone with it.
  if command -v readelf >/dev/null; then
    log "readelf: does anything kept link against a dropped library?"
    missing=$(cd "$STAGE/site" && find . -name '*.so*' -type f -print0 \
      | xargs -0 -n1 readelf -d 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort -u \
      | while read -r lib; do
          # system libraries (glibc, libstdc++, OpenSSL 3, zlib) and the driver's are not ours
          grep -qxF "$lib" "$OUT/bundled.txt" || continue
          [ -n "$(find . -name "$lib" -print -quit)" ] || echo "$lib"
        done)
    [ -z "$missing" ] || { log "kept files need dropped libraries: $missing"; exit 1; }
  else
    log "readelf not found: link check skipped"
  fi
else
  : >"$OUT/stripped.txt"
fi
left=$(du -sb "$STAGE/site" | cut -f1)
log "site tree: $full -> $left bytes"

log "tar | xz -$XZ_LEVEL -T0"
rm -f "$OUT"/nixl-*.tar.xz "$OUT"/nixl-*.tar.xz.part-*
tar -C "$STAGE/site" --sort=name --owner=0 --group=0 --numeric-owner --mtime=2026-01-01 \
  -cf - . | xz -"$XZ_LEVEL" -T0 >"$OUT/$NAME"
( cd "$OUT" && split -b "${PART_MIB}M" -d -a 2 "$NAME" "$NAME.part-" )
{
  echo "kvoe-gpu NIXL bundle, staged $(date -u +%FT%TZ) by bench/gpu/nixl/stage_nixl.sh"
  echo "nixl-cu13 wheel: $(basename "$CU") $(stat -c %s "$CU") bytes sha256 $(sha256sum "$CU" | cut -d' ' -f1)"
  echo "nixl meta wheel: $(basename "$META") $(stat -c %s "$META") bytes sha256 $(sha256sum "$META" | cut -d' ' -f1)"
  echo "site tree bytes: full $full, after strip $left"
  echo "tarball: $NAME $(stat -c %s "$OUT/$NAME") bytes"
  echo "stripped:"; cat "$OUT/stripped.txt"
} >"$OUT/MANIFEST.txt"
( cd "$OUT" && sha256sum "$NAME" "$NAME".part-* ) >"$OUT/SHA256SUMS"
rm -f "$OUT/$NAME" "$OUT/stripped.txt" "$OUT/bundled.txt"
rm -rf "$STAGE"
log "to carry: .gpu/nixl/SHA256SUMS and each part (bench/gpu/nixl/README.md)"
( cd "$OUT" && ls -l "$NAME".part-* SHA256SUMS ) >&2
cat "$OUT/SHA256SUMS"
