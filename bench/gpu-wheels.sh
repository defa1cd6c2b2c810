#!/usr/bin/env bash
# Wheels of what a CUDA machine without network needs to run bench/gpu.sh, fetched here for Python 3.12 on x86-64
# Linux. Such a machine is expected to hold torch (with CUDA), transformers, peft, numpy, scipy, protobuf, msgpack,
# uvloop, prometheus-client and pytest already: its torch must stay, so the project goes on it without dependencies,
# and these wheels bring the rest (hivemind and its own needs, pydantic, gudhi, pytest-asyncio: about 23 MB), and
# with WITH_BITSANDBYTES=1 bitsandbytes too (41 MB more: the int8 and nf4 nodes). py-spy (3 MB: the profiles of
# `bench/inference.py --spy`) comes along where it is installed here (`.venv/bin/pip install py-spy`).
#
#   bench/gpu-wheels.sh [DIR]          # DIR: .whl (keep it out of git: echo /.whl/ >> .git/info/exclude)
#
# Versions are those of this checkout's .venv (`make install`, through constraints.txt). A package published as a
# source archive only is built here into a pure-Python wheel (refused if the build is not py3-none-any). On the CUDA
# machine, from the repository root:
#
#   python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site
#   python3 -m pip install --no-deps --no-build-isolation --no-index -e .
#   bash bench/gpu.sh quick
set -euo pipefail
DEST=${1:-.whl}
PY=${PYTHON:-.venv/bin/python}
PACKAGES=(
    hivemind base58 ConfigArgParse cryptography cffi pycparser netaddr prefetch_generator py-cid py-multibase
    py-multicodec py-multihash morphys python-baseconv varint blake3 mmh3
    pydantic pydantic_core annotated-types typing-inspection
    gudhi pytest-asyncio
)
[ "${WITH_BITSANDBYTES:-0}" = 1 ] && PACKAGES+=(bitsandbytes)
"$PY" -c "import importlib.metadata as m; m.version('py-spy')" 2>/dev/null && PACKAGES+=(py-spy)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
    manylinux2014_x86_64 manylinux1_x86_64)
[ -x "$PY" ] || { echo "no $PY: run make install first (or set PYTHON)" >&2; exit 1; }
mkdir -p "$DEST"
platform_args=()
for platform in "${PLATFORMS[@]}"; do platform_args+=(--platform "$platform"); done
for name in "${PACKAGES[@]}"; do
    version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name") || {
        echo "$name is not installed in $PY's environment" >&2
        exit 1
    }
    if "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platform_args[@]}" -d "$DEST" "$name==$version" 2>/dev/null; then
        echo "$name $version: wheel"
        continue
    fi
    # a source archive only: built here, kept only if pure Python (it then installs on 3.12 as well)
    build=$(mktemp -d)
    "$PY" -m pip wheel -q --no-deps -w "$build" "$name==$version"
    wheel=$(ls "$build"/*.whl)
    case "$(basename "$wheel")" in
        *-py3-none-any.whl | *-py2.py3-none-any.whl) mv "$wheel" "$DEST"/ && echo "$name $version: built here" ;;
        *) echo "$name $version: no wheel for Python 3.12, and its build here is not pure Python" >&2; exit 1 ;;
    esac
    rm -rf "$build"
done
echo "$(ls "$DEST"/*.whl | wc -l) wheels in $DEST, $(du -sh "$DEST" | cut -f1)"
