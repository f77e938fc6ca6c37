#!/usr/bin/env bash
# `bot bench` beside llama.cpp's llama-bench on this CPU, same run, alternating, and the ratios.
#
#   bash scripts/bench-peers.sh [SHAPE ...]        # default: qwen3-0.6b; also qwen3-4b, qwen3-8b
#
# Builds llama-bench from the pinned llama-cpp-python sdist (../shared/peers/build-llama-cpp.sh,
# ~10 min the first time; PEERS=/path/to/peers overrides where that script is), writes a
# random Qwen3-shaped Q4_0 GGUF (`--pure`: every matrix Q4_0, the closest byte count to MLX
# 4-bit group 64) and the same shape as an mlx_lm directory (`bot bench --synthetic --save`),
# then runs each twice, alternating: `llama-bench -t T -p 64 -n 64 -d 0,64 -r 3` (its prompt
# from an empty cache, its decode at a depth of 64: the context `bot bench` decodes in) and
# `bot bench --threads T --prompt-tokens 64 --gen-tokens 64 --repeats 3` (default sampler,
# default kernel: what users run). Prints one table row per run and the ratios bot / llama.cpp,
# each round after the machine's plain read rate of that minute on T threads
# (`examples/read_rate.rs`, the faster of a loop with a prefetch hint and one without: a decode
# that streams its weights from memory does not go much faster, and on a shared machine it
# moves with the neighbours).
# Env: THREADS (default: all cores), ROUNDS (2), BOT (default target/release/bot), WORK (/tmp/bot-peers);
# KERNEL (default: none, bot's default `fast`): `--kernel` for bot, e.g. `int8` (8-bit
# activations, as llama.cpp's Q8_0 gives its Q4_0 matmuls: the like-for-like arithmetic);
# READ_RATE (default target/release/examples/read_rate, built if cargo is here; none: no line);
# LB, GGUF_PY, PY, MAKE_GGUF (below) for a machine without ../shared.
# PEER_ISA (default native): holds both sides to one x86-64 instruction set, the proxy for a CPU
# not at hand: bot through BOT_CPU_ISA, llama-bench built for it with GGML_NATIVE off (in
# LLAMA_SRC/build-PEER_ISA, once; LLAMA_SRC defaults to the pinned sdist's source): `avx2`, or
# `avx512-vnni` (Ice Lake's set: AVX-512 F/BW/DQ/VL/CD, VBMI and VNNI; no AMX, AVX-VNNI or BF16).
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS=${PEERS:-../shared/peers}
THREADS=${THREADS:-$(nproc)}
ROUNDS=${ROUNDS:-2}
KERNEL=${KERNEL:-}
KARGS=(); [ -z "$KERNEL" ] || KARGS=(--kernel "$KERNEL")
BOT=${BOT:-target/release/bot}
WORK=${WORK:-/tmp/bot-peers}
SHAPES=("$@"); [ ${#SHAPES[@]} -gt 0 ] || SHAPES=(qwen3-0.6b)
mkdir -p "$WORK"
[ -x "$BOT" ] || cargo build --release >&2
READ_RATE=${READ_RATE:-target/release/examples/read_rate}
if [ ! -x "$READ_RATE" ] && command -v cargo >/dev/null; then
  cargo build --release --example read_rate >&2
fi
PEERS_HOME=${PEERS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/bot-peers}
# PEER_ISA: llama-bench built for that instruction set alone (GGML_NATIVE off, the set held)
PEER_ISA=${PEER_ISA:-native}
held=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
  -DGGML_AVX_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
case "$PEER_ISA" in
  native) held=() ;;
  avx2) held+=(-DGGML_AVX512=OFF) ;;
  avx512-vnni) held+=(-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON) ;;
  *) echo "bench-peers: PEER_ISA=$PEER_ISA: expected native, avx2 or avx512-vnni" >&2; exit 2 ;;
esac
if [ ${#held[@]} -gt 0 ]; then
  export BOT_CPU_ISA=$PEER_ISA
  if [ -z "${LB:-}" ]; then
    LLAMA_SRC=${LLAMA_SRC:-$(dirname "$(bash "$PEERS/build-llama-cpp.sh" gguf-py)")}
    b=$LLAMA_SRC/build-$PEER_ISA
    if [ ! -x "$b/bin/llama-bench" ]; then
      [ ! -d "$PEERS_HOME/venv/bin" ] || PATH=$PEERS_HOME/venv/bin:$PATH
      cmake -S "$LLAMA_SRC" -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "${held[@]}" >&2
      cmake --build "$b" --target llama-bench -j"${JOBS:-$(nproc)}" >&2
    fi
    LB=$b/bin/llama-bench
  fi
fi
# LB, GGUF_PY, PY and MAKE_GGUF may name a llama-bench, gguf-py, a Python with numpy and
# make_random_gguf.py built elsewhere (a machine without ../shared, e.g. the GPU machine's CPU)
LB=${LB:-$(bash "$PEERS/build-llama-cpp.sh" cpu)}
GGUF_PY=${GGUF_PY:-$(bash "$PEERS/build-llama-cpp.sh" gguf-py)}
PY=${PY:-$PEERS_HOME/venv/bin/python}
MAKE_GGUF=${MAKE_GGUF:-$PEERS/make_random_gguf.py}
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//') ($(nproc) cores; $("$BOT" doctor 2>/dev/null | grep '^cpu kernels' || true))"
echo "threads $THREADS; bot kernel ${KERNEL:-default}; instruction set $PEER_ISA; llama-bench: $LB"
for shape in "${SHAPES[@]}"; do
  g=$WORK/$shape-q4_0-pure.gguf; d=$WORK/$shape-mlx
  [ -f "$g" ] || PYTHONPATH=$GGUF_PY "$PY" "$MAKE_GGUF" --model "$shape" --type q4_0 --pure -o "$g" >&2
  [ -f "$d/config.json" ] || "$BOT" bench --synthetic "$shape" --save "$d" >&2
  for r in $(seq "$ROUNDS"); do
    [ ! -x "$READ_RATE" ] || echo "$shape round $r: $("$READ_RATE" "$THREADS" 5)"
    # the prompt from an empty cache; decode after those 64 tokens (`-d 64`), as `bot bench` does
    l=$("$LB" -m "$g" -t "$THREADS" -p 64 -n 64 -d 0,64 -r 3 -o json)
    lp=$(echo "$l" | python3 -c 'import json,sys; r=json.load(sys.stdin); print([x["avg_ts"] for x in r if x["n_prompt"]>0 and x["n_depth"]==0][0])')
    ld=$(echo "$l" | python3 -c 'import json,sys; r=json.load(sys.stdin); print([x["avg_ts"] for x in r if x["n_gen"]>0 and x["n_depth"]==64][0])')
    b=$("$BOT" bench --model "$d" --threads "$THREADS" --prompt-tokens 64 --gen-tokens 64 --repeats 3 "${KARGS[@]}" --json 2>/dev/null)
    bp=$(echo "$b" | python3 -c 'import json,sys; print(json.load(sys.stdin)["prefill_tok_s"])')
    bd=$(echo "$b" | python3 -c 'import json,sys; print(json.load(sys.stdin)["decode_tok_s"])')
    python3 - "$shape" "$r" "$lp" "$ld" "$bp" "$bd" <<'PY'
import sys
shape, r, lp, ld, bp, bd = sys.argv[1], sys.argv[2], *map(float, sys.argv[3:])
print(f"{shape} round {r}: prefill 64 tok/s  llama.cpp {lp:7.1f}  bot {bp:7.1f}  ratio {bp/lp:.2f}x | "
      f"decode tok/s  llama.cpp {ld:6.1f}  bot {bd:6.1f}  ratio {bd/ld:.2f}x")
PY
    echo "$lp $ld $bp $bd" >> "$WORK/rounds-$shape.$$"
  done
  # on a shared machine one round can land in a neighbour's busy minute: the medians over rounds
  python3 - "$shape" "$WORK/rounds-$shape.$$" <<'PY'
import statistics, sys
rows = [list(map(float, l.split())) for l in open(sys.argv[2])]
lp, ld, bp, bd = (statistics.median(c) for c in zip(*rows))
print(f"{sys.argv[1]} median of {len(rows)}: prefill ratio {bp/lp:.2f}x (llama.cpp {lp:.1f}, bot {bp:.1f}) | "
      f"decode ratio {bd/ld:.2f}x (llama.cpp {ld:.1f}, bot {bd:.1f})")
PY
  rm -f "$WORK/rounds-$shape.$$"
done
