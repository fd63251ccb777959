#!/usr/bin/env bash
# Offline install of what `python -m cg_jax serve` and `python -m cg_jax bench serve`
# need (fastapi, uvicorn, prometheus-client, jinja2, httpx, openai and their dependencies) from
# the wheels in .whl/, on a machine without a package index (the GPU machine: Python 3.12).
#
# Nothing is written into the interpreter's environment: the packages go to a directory of their
# own ($DEST), to add to PYTHONPATH. Only what the interpreter lacks, or has at a version that
# does not fit, goes there (pip resolves against the interpreter's installed packages first, with
# --dry-run), so its numpy / jax / torch / typing_extensions stay the ones it uses; the script
# stops if the plan would install numpy, jax, jaxlib or torch.
#
# Usage, from the repo root (stdout is one line to eval; the rest goes to stderr):
#   eval "$(bash benchmarks/http_install.sh)"       # export PYTHONPATH=/tmp/cg_jax_http:...
#   PYTHON=python3.12 DEST=/tmp/x WHEELS=.whl bash benchmarks/http_install.sh   # (the defaults:
#                                                   # python3, /tmp/cg_jax_http, .whl)
# On the device machine (.whl is gitignored: carry it):
#   run(carry=[".whl"], command='eval "$(bash benchmarks/http_install.sh)" && python3 ...')
#
# The wheels (about 9 MB), from the repo root on a machine with an index:
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 --implementation cp -d .whl \
#     fastapi uvicorn openai httpx prometheus-client jinja2 pip
set -euo pipefail
PY=${PYTHON:-python3}
DEST=${DEST:-/tmp/cg_jax_http}
WHEELS=$(cd "${WHEELS:-.whl}" && pwd)
# The serve extra's and the tests' lower bounds (pyproject.toml), and the benchmark's client.
PACKAGES=("fastapi>=0.115" "uvicorn>=0.30" "prometheus-client>=0.20" "jinja2>=3.1.6" httpx
          "openai>=1.40")
log() { echo "http_install: $*" >&2; }

version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$version" = 3.12 ] || log "warning: $PY is Python $version; the wheels are for 3.12"
# pip itself from its wheel (a wheel on sys.path runs as a zip), whatever pip the machine has.
pip_wheel=$(ls "$WHEELS"/pip-*.whl 2>/dev/null | tail -1)
[ -n "$pip_wheel" ] || { log "no pip wheel in $WHEELS"; exit 1; }
pip=("$PY" "$pip_wheel/pip" --isolated --disable-pip-version-check --no-input)
offline=(--no-index --find-links "$WHEELS" --only-binary=:all: --root-user-action=ignore)

if [ -e "$DEST" ]; then
  [ -e "$DEST/.cg_jax_http" ] || { log "$DEST exists and is not this script's: set DEST"; exit 1; }
  rm -rf "$DEST"
fi
mkdir -p "$DEST"
touch "$DEST/.cg_jax_http"
report="$DEST/.plan.json"

# 1. What pip would install into this interpreter (nothing already there at a fitting version).
"${pip[@]}" install --dry-run --quiet --report "$report" "${offline[@]}" "${PACKAGES[@]}" >&2
mapfile -t plan < <("$PY" - "$report" <<'EOF'
import json, sys, urllib.parse, urllib.request
for item in json.load(open(sys.argv[1]))["install"]:
  meta = item["metadata"]
  print(meta["name"], meta["version"],
        urllib.request.url2pathname(urllib.parse.urlparse(item["download_info"]["url"]).path))
EOF
)
files=()
for line in "${plan[@]}"; do
  read -r name ver file <<<"$line"
  case "${name,,}" in
    numpy|jax|jaxlib|torch) log "the plan would install $name $ver: stopping"; exit 1 ;;
  esac
  log "installing $name $ver"
  files+=("$file")
done

# 2. Exactly those wheels into $DEST.
if [ ${#files[@]} -gt 0 ]; then
  "${pip[@]}" install --quiet --no-deps --target "$DEST" --no-warn-script-location "${offline[@]}" \
    "${files[@]}" >&2
fi

# 3. The imports, with $DEST first on the path; numpy / jax / torch from where they were.
PYTHONPATH="$DEST${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$DEST" >&2 <<'EOF'
import importlib, importlib.metadata as md, importlib.util, os, sys
dest = os.path.realpath(sys.argv[1])
for module, dist in (("fastapi", "fastapi"), ("uvicorn", "uvicorn"), ("starlette", "starlette"),
                     ("pydantic", "pydantic"), ("prometheus_client", "prometheus-client"),
                     ("jinja2", "jinja2"), ("httpx", "httpx"), ("openai", "openai")):
  where = importlib.import_module(module).__file__
  place = "installed" if os.path.realpath(where).startswith(dest) else "the machine's"
  print(f"http_install: {module} {md.version(dist)} ({place}: {where})")
for module in ("numpy", "jax", "torch", "typing_extensions"):
  spec = importlib.util.find_spec(module)
  if spec is None:
    print(f"http_install: {module}: not on this machine")
  elif os.path.realpath(spec.origin).startswith(dest):
    assert module == "typing_extensions", f"{module} from {spec.origin}"
    print(f"http_install: {module} installed (the machine has none that fits)")
  else:
    print(f"http_install: {module} stays the machine's ({spec.origin})")
EOF
log "done; use it with: export PYTHONPATH=$DEST\${PYTHONPATH:+:\$PYTHONPATH}"
echo "export PYTHONPATH=$DEST\${PYTHONPATH:+:\$PYTHONPATH}"
