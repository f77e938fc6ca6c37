#!/usr/bin/env bash
# Set-up and tests in one command (README "Tests"; CI runs this through .ci/run):
# starts two reference PDS instances on loopback (one with the production rate limiter),
# installs Debian's chromium if missing, type-checks the Metal and CUDA features, then runs every test with REQUIRE_PDS=1 so that a missing
# server fails instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."
pds=.ci/pds/start-pds.sh
state=${ATPROTO_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/local-pds}
bash "$pds" install >&2
eval "$(bash "$pds")"
RATE_LIMITS=1 PDS_PORT=2593 PLC_PORT=2592 STATE_DIR="$state/state-ratelimited" bash "$pds" >/dev/null
export BSKY_SERVICE_RATELIMITED=http://127.0.0.1:2593
stop() {
  bash "$pds" stop >&2 || true
  STATE_DIR="$state/state-ratelimited" PDS_PORT=2593 PLC_PORT=2592 bash "$pds" stop >&2 || true
}
trap stop EXIT
# Headless Chromium renders the sandbox page in a test (Debian's package; CI has apt).
if ! command -v chromium >/dev/null 2>&1; then
  echo "installing chromium (Debian package) for the sandbox page screenshot test" >&2
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  ($SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium) >&2
fi
export REQUIRE_CHROMIUM=1
# The Metal backend's Rust side against the real candle/objc2-metal APIs (nothing runs).
bash .ci/metal-typecheck.sh . metal >&2
# ... and the CUDA backend's, with CUDA 13.0's nvcc from PyPI (nothing runs: the GPU machine
# does). A `--features cuda` build that no longer compiled once went unseen for a day.
( eval "$(bash .ci/cuda-toolchain.sh)"
  cargo check --locked --release --features cuda --all-targets --target-dir target-cuda-check ) >&2
export REQUIRE_PDS=1
# the CPU backend's weights in 2 MiB pages (engine/resident.rs) are checked, not skipped
[ "$(uname -s)" != Linux ] || export REQUIRE_HUGEPAGES=1
# ... and a file read back from disk mapped in 2 MiB entries, where the temporary directory's
# filesystem makes large page-cache folios (XFS; ext4 from Linux 6.16)
fs=$(stat -f -c %T "${TMPDIR:-/tmp}" 2>/dev/null || true)
kv=$(uname -r | awk -F. '{print $1 * 100 + $2}')
if [ "$fs" = xfs ] || { [ "$fs" = ext2/ext3 ] && [ "$kv" -ge 616 ]; }; then export REQUIRE_HUGE_FILE_MAPS=1; fi
# The CPU instruction sets this machine runs: each one /proc/cpuinfo lists, checked with
# `bot doctor` to be the set bot then runs (AMX listed but not granted by the kernel would
# otherwise leave every test of it on the set below, passing). A test part for a set named in
# REQUIRE_CPU_ISAS fails instead of skipping (`isa::tested_here`); the rest are named here.
isas=()
for isa in scalar: avx2:avx2 avx-vnni:avx_vnni avx512-vnni:avx512_vnni amx:amx_int8 \
  neon:asimd neon-dotprod:asimddp neon-i8mm:i8mm; do
  if [ -z "${isa#*:}" ] || grep -qw "${isa#*:}" /proc/cpuinfo; then
    kernels=$(BOT_CPU_ISA=${isa%%:*} cargo run --locked --quiet -- doctor 2>/dev/null | grep '^cpu kernels' || true)
    if ! echo "$kernels" | grep -Eq "^cpu kernels +${isa%%:*}( |$)"; then
      echo "BOT_CPU_ISA=${isa%%:*}: /proc/cpuinfo lists ${isa#*:} but bot doctor says: ${kernels:-nothing}" >&2
      exit 1
    fi
    isas+=("${isa%%:*}")
  else
    echo "BOT_CPU_ISA=${isa%%:*}: not on this CPU, its tests not run" >&2
  fi
done
echo "CPU instruction sets tested: ${isas[*]}" >&2
# every x86-64 machine CI has runs AVX2 (the 256-bit prompt GEMM, the AVX2 attention)
if [ "$(uname -m)" = x86_64 ] && [[ " ${isas[*]} " != *" avx2 "* ]]; then
  echo "this x86-64 machine does not run AVX2; CI expects it" >&2
  exit 1
fi
REQUIRE_CPU_ISAS=$(IFS=,; echo "${isas[*]}")
export REQUIRE_CPU_ISAS
cargo test --locked "$@"
# The default (fast) kernel's greedy ids against mlx_lm on every one of those sets
# (BOT_CPU_ISA is per process).
for isa in "${isas[@]}"; do
  echo "greedy ids on the fixtures with BOT_CPU_ISA=$isa" >&2
  BOT_CPU_ISA=$isa cargo test --locked "$@" --test integration fast_kernel_matches_mlx -- --quiet >&2
  # ... and the prompt GEMMs as `qmatmul` routes them with that set active (the exact
  # kernels' too: the f32 GEMM's AVX2 half, or the scalar tiles, on every width and group),
  # and LoRA's f16 loops as the set dispatches them (F16C, or the portable loops under scalar),
  # and a decode row's LoRA in the integer kernel's region (under scalar: the host pass)
  BOT_CPU_ISA=$isa cargo test --locked "$@" --lib -- --quiet vnni:: amx:: i8mm:: shared_input_prompts int8_prompts exact_matches_reference_on_all_bits_and_groups lora_half:: lora_in_the_region >&2
  # ... and, where AVX-512 runs, with the decode copy 16 rows interleaved and without it
  # (tile16.rs; which one is the default depends on the CPU's maker; with the copy, prompts
  # of 2-7 tokens take the shared GEMM too, and the host pass adds their LoRA on the host;
  # without it `int8` prompts take `vpdpbusd` on AVX-512 VNNI)
  case $isa in avx512-vnni|amx)
    for layout in tile16 rows; do
      BOT_CPU_LAYOUT=$layout BOT_CPU_ISA=$isa cargo test --locked "$@" --test integration -- --quiet fast_kernel_matches_mlx host_passes_equal_tensor_passes int8_kernel >&2
    done ;;
  esac
done

