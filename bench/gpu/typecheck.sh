#!/usr/bin/env bash
# mypy --strict over bench/gpu, called by `./run lint` after the main mypy.
#
# The kit's modules are top-level scripts copied to the GPU machine and run with its own python,
# importing each other by bare name (`import gpukit`, `import acceptance`; nixl/run_pd.py puts
# bench/gpu on sys.path), not a package, so the repo-wide mypy (which sees bench.gpu.*) excludes
# them and they are checked here, from bench/gpu, with bench/gpu and bench/gpu/nixl as bases.
#
# Only the modules listed in the config below may be missing: they exist only in the device's
# python (torch, nixl and its CUDA 13 build) or are installed here without types (pynvml, as in
# pyproject.toml's override). Any other unresolved import is an error.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
mypy="${MYPY:-$repo/.venv/bin/mypy}"
cd "$here"
config="$(mktemp)"
trap 'rm -f "$config"' EXIT
cat >"$config" <<'INI'
[mypy]
python_version = 3.11
strict = True
warn_unused_ignores = True
explicit_package_bases = True
follow_imports = silent
mypy_path = .:nixl

[mypy-torch,torch.*,nixl,nixl.*,nixl_cu13,nixl_cu13.*,pynvml]
ignore_missing_imports = True
INI
exec "$mypy" --config-file "$config" --cache-dir "$repo/.mypy_cache/bench-gpu" \
  ./*.py nixl/*.py "$@"
