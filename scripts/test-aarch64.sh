#!/usr/bin/env bash
# The unit and kernel tests built for aarch64 (NEON) and run under qemu-aarch64 -cpu max
# (neon, dotprod, i8mm): the recipe of ../shared/aarch64 (Debian's rustc with its arm64 std,
# the aarch64 gcc as linker; rustup cannot fetch targets here), then the engine against mlx_lm's
# fixtures (`engine_vs_mlx`: logits, greedy ids, LoRA, every variant) the same way. Slow: ~8 min
# cold on 2 cores for the unit tests, the integration build and its 90 s under qemu on top.
#
#   bash scripts/test-aarch64.sh [TEST FILTER...]      # e.g. cpu:: to run the CPU kernels only
#   FIXTURES=0 bash scripts/test-aarch64.sh cpu::      # the unit tests alone
# Env: AARCH64=/path/to/shared/aarch64 (default ../shared/aarch64), CARGO_TARGET_DIR (target-a64).
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(bash "${AARCH64:-../shared/aarch64}/aarch64-toolchain.sh")"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-a64}
# qemu's `max` CPU has every NEON set: a kernel test's part for one of them must run, not skip
# (`isa::tested_here`, as scripts/test.sh does for the sets of an x86-64 CPU)
export REQUIRE_CPU_ISAS=scalar,neon,neon-dotprod,neon-i8mm
# qemu-user does not pass madvise(MADV_HUGEPAGE) on to the host kernel: with the host's huge
# pages on `madvise` a buffer under qemu never gets them (the test runs natively in CI)
$AARCH64_CARGO test --locked --target aarch64-unknown-linux-gnu --lib -- "$@" \
  --skip resident::tests::a_read_buffer_is_in_huge_pages_where_they_are_on
if [ "${FIXTURES:-1}" = 1 ]; then
  $AARCH64_CARGO test --locked --target aarch64-unknown-linux-gnu --test integration -- engine_vs_mlx
  # ... and the default mode's greedy ids with each NEON set below the one detected
  for isa in neon neon-dotprod; do
    BOT_CPU_ISA=$isa $AARCH64_CARGO test --locked --target aarch64-unknown-linux-gnu --test integration -- fast_kernel_matches_mlx
  done
fi
