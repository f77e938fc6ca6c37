#!/usr/bin/env bash
# `bot bench` beside llama.cpp's llama-bench on the GPU machine, same run, alternating, and the
# ratios (issue #24). Two halves, because the GPU machine has nvcc and CMake but no Rust and
# no network, and this machine has Rust but builds llama.cpp's CUDA kernels too slowly:
#
#   bash scripts/bench-peers-cuda.sh pack     # here: gpu/ <- bot (CUDA build, xz), llama.cpp source, gguf-py
#   # then, through the device tool, with carry ["gpu"]:
#   bash scripts/bench-peers-cuda.sh run      # there: build llama-bench (sm_90, ~4.5 min on 16 cores) if
#                                             # missing, write the GGUFs and the mlx_lm directory, alternate
#
# llama.cpp is the pinned source of ../shared/peers/build-llama-cpp.sh (llama-cpp-python's vendored
# copy), built with GGML_CUDA for sm_90, flash attention on (`-fa 1`). Both run the 8B shape: a
# random GGUF from ../shared/peers/make_random_gguf.py (Q4_0 with llama-quantize's default mix,
# and `--pure` Q4_0, the closest byte count to MLX 4-bit g64) and `bot bench --synthetic qwen3-8b`.
# llama-bench's prompt runs from an empty cache and its decode at a depth of 64 (`-d 0,64`), the
# context `bot bench --prompt-tokens 64` decodes in.
# Env: BOT_CUDA (pack: the CUDA binary, default target-cuda/release/bot), ROUNDS (run: 3).
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS=${PEERS:-../shared/peers}
case "${1:-}" in
  pack)
    BIN=${BOT_CUDA:-target-cuda/release/bot}
    [ -x "$BIN" ] || { echo "no CUDA build at $BIN: see ../shared/cuda/README.md (cargo build --release --features cuda --target-dir target-cuda)" >&2; exit 1; }
    GGUF_PY=$(bash "$PEERS/build-llama-cpp.sh" gguf-py)   # fetches the pinned source if missing
    SRC=$(dirname "$GGUF_PY")
    mkdir -p gpu
    strip -o gpu/bot "$BIN" && xz -f -T2 -6 gpu/bot
    tar -C "$(dirname "$SRC")" -cJf gpu/llama-src.tar.xz --exclude='llama.cpp/build-*' --exclude=llama.cpp/docs \
      --exclude=llama.cpp/models --exclude=llama.cpp/examples --exclude=llama.cpp/tests --exclude=llama.cpp/benches \
      --exclude=llama.cpp/.github --exclude=llama.cpp/gguf-py "$(basename "$SRC")"
    tar -C "$SRC" -cJf gpu/gguf-py.tar.xz gguf-py
    cp "$PEERS/make_random_gguf.py" gpu/
    du -sh gpu >&2
    echo "now: run 'bash scripts/bench-peers-cuda.sh run' on the GPU machine with carry [\"gpu\"]" >&2 ;;
  run)
    ROUNDS=${ROUNDS:-3}
    W=/tmp/bot-peers-cuda; mkdir -p "$W"
    xz -dc gpu/bot.xz > "$W/bot" && chmod +x "$W/bot"
    if [ ! -x "$W/lb/bin/llama-bench" ]; then
      rm -rf "$W/src" && mkdir -p "$W/src" && tar xJf gpu/llama-src.tar.xz -C "$W/src" && tar xJf gpu/gguf-py.tar.xz -C "$W/src"
      ( for t in "--type q4_0 --pure:q4_0-pure" "--type q4_0:q4_0"; do
          PYTHONPATH=$W/src/gguf-py nice python3 gpu/make_random_gguf.py --model qwen3-8b ${t%%:*} -o "$W/q8b-${t##*:}.gguf"
        done > "$W/gguf.log" 2>&1 ) &
      cmake -S "$W/src/llama.cpp" -B "$W/lb" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF > "$W/cmake.log" 2>&1
      ninja -C "$W/lb" -j"$(nproc)" llama-bench > "$W/ninja.log" 2>&1 || { tail -20 "$W/ninja.log"; exit 1; }
      wait
      cat "$W/gguf.log"
    fi
    NV=$(python3 -c 'import os,nvidia;print(next(os.path.join(p,"cu13","lib") for p in nvidia.__path__ if os.path.isdir(os.path.join(p,"cu13","lib"))))')
    export LD_LIBRARY_PATH=$NV:/usr/local/cuda/lib64:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    [ -f "$W/q8b/config.json" ] || "$W/bot" bench --synthetic qwen3-8b --save "$W/q8b" > /dev/null 2>&1
    for r in $(seq "$ROUNDS"); do
      for g in q4_0 q4_0-pure; do
        l=$("$W/lb/bin/llama-bench" -m "$W/q8b-$g.gguf" -ngl 99 -fa 1 -p 64 -n 256 -d 0,64 -r 5 -o json 2>/dev/null)
        b=$("$W/bot" bench --model "$W/q8b" --device cuda --prompt-tokens 64 --gen-tokens 256 --repeats 3 --json 2>/dev/null)
        python3 - "$r" "$g" "$l" "$b" <<'PY'
import json, sys
r, g, l, b = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
lp = [x for x in l if x["n_prompt"] > 0 and x["n_depth"] == 0][0]
ld = [x for x in l if x["n_gen"] > 0 and x["n_depth"] == 64][0]
lms = [64e3 / t for t in lp["samples_ts"]]
bms = 64e3 / b["prefill_tok_s"]
print(f"round {r} vs llama.cpp {g}: prefill 64 ms  llama.cpp {min(lms):.2f} (best of 5; mean {64e3 / lp['avg_ts']:.2f})  "
      f"bot {bms:.2f}  | decode tok/s  llama.cpp {ld['avg_ts']:.1f}  bot {b['decode_tok_s']:.1f}  "
      f"ratio {b['decode_tok_s'] / ld['avg_ts']:.2f}x")
PY
      done
      "$W/bot" bench --model "$W/q8b" --device cuda --prompt-tokens 64 --gen-tokens 256 --repeats 3 --json --synthetic-lora 2>/dev/null \
        | python3 -c 'import json,sys; d=json.load(sys.stdin); print("round", sys.argv[1], "bot --synthetic-lora: decode %.1f tok/s" % d["decode_tok_s"])' "$r"
    done ;;
  *) echo "usage: bench-peers-cuda.sh pack|run" >&2; exit 2 ;;
esac
