#!/usr/bin/env bash
# Install DeepSpeed into a virtual environment, on CPU machines with its CPU ops compiled ahead
# of time, once per machine.
#
#   tools/install_deepspeed.sh .venv/bin/python 0.19.8          # the ops every run needs
#   tools/install_deepspeed.sh .venv/bin/python 0.19.8 nvme     # and async_io (NVMe offload)
#
# Without this, DeepSpeed compiles each op the first time a run needs it, separately for every
# environment path, so a fresh clone would stall mid-run (or mid-test) compiling. Here the ops are
# compiled into a wheel kept in $GPTLITE_CACHE (default ~/.cache/gptlite), keyed by the DeepSpeed,
# torch and Python versions, and installed from there afterwards (seconds).
#
# What costs the time is compiling: every source file includes torch's extension headers (50 to
# 85 s each on the 2-core development machine; per op, one job at a time: shm_comm 101 s,
# fused_adam 143 s, cpu_adam 166 s; async_io has 12 files, 13 with pin_memory). So:
#   - ninja compiles each op's files in parallel, one job per core (DeepSpeed's setup.py turns
#     ninja off unless DS_ENABLE_NINJA is set; MAX_JOBS sets its jobs);
#   - `make setup` builds only what the demo and every run without NVMe need: CPU Adam
#     (ZeRO-Offload), fused Adam (DeepSpeed's default optimizer on CPU) and shm comm (its CPU
#     all-reduce). async_io (with pin_memory) is built by the "nvme" set, for NVMe offload, which
#     `make test` asks for where libaio is installed;
#   - the source tree and its build directory are kept in the cache, so the "nvme" set compiles
#     only async_io and pin_memory: setuptools skips extensions already built.
# One build at a time per cache (flock), so two setups on one machine never build into one tree.
#
# On GPU machines (nvidia-smi present) DeepSpeed is installed as usual and compiles its CUDA ops
# on first use, as it does for every DeepSpeed user.
set -euo pipefail
py=$1
[[ $py = /* ]] || py="$PWD/$py"  # the build runs in another directory
version=$2
set_name=${3:-base}
case "$set_name" in base|nvme) ;; *) echo "install_deepspeed.sh: op set must be base or nvme (got '$set_name')" >&2; exit 2;; esac

if command -v nvidia-smi >/dev/null 2>&1; then
    exec "$py" -m pip install --disable-pip-version-check -q "deepspeed==$version"
fi

cache=${GPTLITE_CACHE:-$HOME/.cache/gptlite}
torch=$("$py" -c "import torch; print(torch.__version__)")
abi=$("$py" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
aio=0
if [ -f /usr/include/libaio.h ]; then aio=1; fi
if [ "$set_name" = nvme ] && [ "$aio" = 0 ]; then
    echo "note: libaio is not installed, so DeepSpeed's async_io op (NVMe offload) cannot build; installing the base ops"
    set_name=base
fi
key="deepspeed-$version-torch$torch-$abi"
wheels="$cache/$key/wheel-$set_name"
mkdir -p "$cache/$key"
exec 9>"$cache/$key/.lock"
flock 9

if ! ls "$wheels"/deepspeed-*.whl >/dev/null 2>&1; then
    jobs=$(nproc)
    echo "Building DeepSpeed $version's CPU ops ($set_name set, $jobs compile jobs; once per machine)"
    started=$(date +%s)
    "$py" -m pip install --disable-pip-version-check -q setuptools wheel ninja
    src="$cache/$key/src"
    if [ ! -f "$src/setup.py" ]; then
        tmp=$(mktemp -d "$cache/$key/download.XXXXXX")
        "$py" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: "deepspeed==$version" -d "$tmp"
        rm -rf "$src" && mkdir -p "$src"
        tar xzf "$tmp"/deepspeed-*.tar.gz -C "$src" --strip-components 1
        rm -rf "$tmp"
    fi
    ops=(DS_BUILD_CPU_ADAM=1 DS_BUILD_FUSED_ADAM=1 DS_BUILD_SHM_COMM=1)
    # async_io links libaio: DeepSpeed's setup.py leaves -laio out for the CPU build, hence LDFLAGS.
    if [ "$set_name" = nvme ]; then ops+=(DS_BUILD_AIO=1 LDFLAGS="${LDFLAGS:-} -Wl,--no-as-needed -laio"); fi
    out=$(mktemp -d "$cache/$key/wheel.XXXXXX")
    # The venv's ninja first: the one torch's extension builder runs.
    (cd "$src" && env PATH="$(dirname "$py"):$PATH" DS_ACCELERATOR=cpu DS_BUILD_OPS=0 \
        DS_ENABLE_NINJA=1 MAX_JOBS="$jobs" "${ops[@]}" \
        "$py" setup.py -q bdist_wheel -d "$out" > "$cache/$key/build-$set_name.log" 2>&1) || {
        echo "DeepSpeed's build failed; its log: $cache/$key/build-$set_name.log" >&2; tail -20 "$cache/$key/build-$set_name.log" >&2
        rm -rf "$out"; exit 1; }
    rm -rf "$wheels"
    mv "$out" "$wheels"
    echo "Built in $(( $(date +%s) - started )) s: $wheels"
fi
"$py" -m pip install --disable-pip-version-check -q --no-deps --force-reinstall "$wheels"/deepspeed-*.whl
"$py" -m pip install --disable-pip-version-check -q "$wheels"/deepspeed-*.whl
