#!/usr/bin/env bash
# A copy of ../shared/cuda/toolchain.sh (the project's recipe), kept here so that a clean clone
# can type-check the CUDA backend in CI (scripts/test.sh). Keep the two in step.
# Assemble a CUDA 13.0 toolchain from PyPI wheels (no GPU, no CUDA install needed) so that
# candle's `cuda` feature can be built on this Linux x86-64 machine, then print the
# environment to build with.
#
#   eval "$(bash ../shared/cuda/toolchain.sh)"      # once per shell; ~700 MB, ~1 min first time
#   cargo build --release --features cuda           # candle-kernels' nvcc step takes ~7 min cold
#
# Why 13.0 exactly: the GPU machines run driver 580 (CUDA 13.0). PTX made by a newer nvcc
# (13.1+) is rejected by that driver at load time, and the shared-library names
# (libcublas.so.13, libnvrtc.so.13, libcudart.so.13, libcurand.so.10) must match the
# libraries the GPU machine has (its PyTorch cu130 wheels, under site-packages/nvidia/cu13/lib).
#
# A stub libcuda.so is compiled for the linker only (one dummy per cu* symbol of cudarc).
# Never ship it: at run time the real libcuda.so.1 comes from the driver.
#
# CUDA_COMPUTE_CAP=90 targets H100/H200 (candle's kernel builder turns it into sm_90a).
# Env: CUDA_TOOLCHAIN_DIR (default ${XDG_CACHE_HOME:-$HOME/.cache}/cuda-13.0-pypi)
set -euo pipefail
ROOT=${CUDA_TOOLCHAIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/cuda-13.0-pypi}
CUDA=$ROOT/cuda
log() { echo "cuda-toolchain: $*" >&2; }

PKGS="nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
      nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88 \
      nvidia-curand==10.4.0.35 nvidia-cublas==13.0.2.14"

if [ ! -x "$CUDA/bin/nvcc" ]; then
  command -v unzip >/dev/null || { apt-get update -qq >&2 && apt-get install -y -qq unzip >&2; }
  mkdir -p "$ROOT/wheels"
  log "downloading CUDA 13.0 wheels from PyPI"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$ROOT/wheels" $PKGS >&2
  rm -rf "$ROOT/_x" && mkdir "$ROOT/_x"
  for w in "$ROOT"/wheels/*.whl; do unzip -q -o "$w" -d "$ROOT/_x"; done
  rm -rf "$CUDA" && mv "$ROOT/_x/nvidia/cu13" "$CUDA" && rm -rf "$ROOT/_x"
  ( cd "$CUDA/lib"
    for l in cublas cublasLt nvrtc cudart; do ln -sf "lib$l.so.13" "lib$l.so"; done
    ln -sf libcurand.so.10 libcurand.so )
  ln -sfn lib "$CUDA/lib64"
fi

if [ ! -e "$CUDA/lib/stubs/libcuda.so" ]; then
  # cudarc declares every driver symbol in src/driver/sys/mod.rs; find any cudarc in the cargo registry.
  SYS=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-*/src/driver/sys/mod.rs 2>/dev/null | tail -1 || true)
  if [ -z "$SYS" ]; then
    log "no cudarc source in the cargo registry yet: fetching it"
    tmp=$(mktemp -d); ( cd "$tmp" && cargo init -q --name probe && cargo add -q cudarc@0.19 && cargo fetch -q ) >&2
    rm -rf "$tmp"
    SYS=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-*/src/driver/sys/mod.rs | tail -1)
  fi
  mkdir -p "$CUDA/lib/stubs"
  grep -hoE '^\s+(pub )?fn cu[A-Za-z0-9_]+\(' "$SYS" \
    | sed -E 's/.*fn (cu[A-Za-z0-9_]+)\(/\1/' | sort -u \
    | awk '{print "int " $1 "(void){return 34; /* CUDA_ERROR_STUB_LIBRARY */}"}' > "$CUDA/lib/stubs/libcuda_stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$CUDA/lib/stubs/libcuda.so" "$CUDA/lib/stubs/libcuda_stub.c"
fi

"$CUDA/bin/nvcc" --version | tail -1 >&2
cat <<EOF
export CUDA_HOME=$CUDA CUDA_ROOT=$CUDA CUDA_PATH=$CUDA CUDA_TOOLKIT_ROOT_DIR=$CUDA
export NVCC=$CUDA/bin/nvcc PATH=$CUDA/bin:\$PATH CUDA_COMPUTE_CAP=90
export LIBRARY_PATH=$CUDA/lib:$CUDA/lib/stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH}
export LD_LIBRARY_PATH=$CUDA/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
EOF
