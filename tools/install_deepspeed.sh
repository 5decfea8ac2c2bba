#!/usr/bin/env bash
# Install DeepSpeed into a virtual environment, on CPU machines with its CPU ops compiled ahead
# of time.
#
#   tools/install_deepspeed.sh .venv/bin/python 0.19.8
#
# DeepSpeed otherwise compiles each op the first time a run needs it (shm comm, fused Adam, CPU
# Adam, async I/O: 1 to 6 minutes each on 2 cores), separately for every environment path, so a
# fresh clone would stall mid-run, or mid-test, compiling. Here the compiled wheel is built once per
# machine into $GPTLITE_CACHE (default ~/.cache/gptlite), keyed by the DeepSpeed, torch and Python
# versions and whether libaio is present, and installed from there afterwards (seconds).
# On GPU machines (nvidia-smi present) DeepSpeed is installed as usual and compiles its CUDA ops
# on first use, as it does for every DeepSpeed user.
set -euo pipefail
py=$1
version=$2

if command -v nvidia-smi >/dev/null 2>&1; then
    exec "$py" -m pip install --disable-pip-version-check -q "deepspeed==$version"
fi

cache=${GPTLITE_CACHE:-$HOME/.cache/gptlite}
torch=$("$py" -c "import torch; print(torch.__version__)")
abi=$("$py" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
aio=0
if [ -f /usr/include/libaio.h ]; then aio=1; fi
dir="$cache/deepspeed-$version-torch$torch-$abi-aio$aio"

if ! ls "$dir"/deepspeed-*.whl >/dev/null 2>&1; then
    echo "Building DeepSpeed $version with its CPU ops compiled (once per machine; 15 min 46 s for a first make setup on 2 cores)"
    "$py" -m pip install --disable-pip-version-check -q setuptools wheel
    mkdir -p "$cache"
    tmp=$(mktemp -d "$cache/build.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    # async_io links libaio: DeepSpeed's setup.py leaves -laio out for the CPU build, hence LDFLAGS.
    DS_ACCELERATOR=cpu DS_BUILD_OPS=0 DS_BUILD_CPU_ADAM=1 DS_BUILD_FUSED_ADAM=1 DS_BUILD_SHM_COMM=1 \
    DS_BUILD_AIO=$aio LDFLAGS="${LDFLAGS:-} $([ "$aio" = 1 ] && echo -Wl,--no-as-needed -laio)" \
        "$py" -m pip wheel --disable-pip-version-check -q --no-build-isolation --no-deps --no-cache-dir \
        "deepspeed==$version" -w "$tmp"
    mkdir -p "$dir"
    mv "$tmp"/deepspeed-*.whl "$dir"/
fi
"$py" -m pip install --disable-pip-version-check -q "$dir"/deepspeed-*.whl
