"""Hugging Face transformers in bf16 on the same Qwen3-8B shape as `bot bench --synthetic
qwen3-8b` (random weights from the config, built on the GPU): prefill of 64 tokens and greedy
decode of 256 tokens with the KV cache, batch 1. Run on the GPU machine beside `bot bench`.
Prints one JSON line."""
import json, sys, time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

cfg = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                  num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  max_position_embeddings=4096)
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = Qwen3ForCausalLM(cfg).eval()
prompt = torch.randint(0, cfg.vocab_size, (1, 64), device="cuda")
gen = int(sys.argv[1]) if len(sys.argv) > 1 else 256

def sync_time(f):
    torch.cuda.synchronize(); t = time.perf_counter(); r = f(); torch.cuda.synchronize()
    return time.perf_counter() - t, r

with torch.inference_mode():
    for _ in range(2):  # warm-up
        model(prompt)
    pre = sorted(sync_time(lambda: model(prompt))[0] for _ in range(5))[2]
    kw = dict(max_new_tokens=gen, min_new_tokens=gen, do_sample=False)
    model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    total, _ = sync_time(lambda: model.generate(prompt, **kw))
print(json.dumps({"engine": "transformers-bf16", "prefill_ms": pre * 1e3,
                  "prefill_tok_s": 64 / pre, "decode_tok_s": gen / max(total - pre, 1e-9),
                  "transformers": __import__("transformers").__version__}))
