"""vLLM's side of `benches/vllm_cpu.py`, run by vLLM's own Python (vLLM brings its own torch).

It loads the saved model once, then answers one line per request on stdin with
one line of JSON on stdout: "run N" generates the prompts (greedy, N new
tokens each; "run": NEW_TOKENS) and reports the seconds and the tokens;
"quit" ends. Nothing of hybridspec is imported here.

    VLLM_PYTHON benches/vllm_worker.py MODEL_DIR PROMPTS_JSON DTYPE NEW_TOKENS
"""
from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    model_dir, prompts_path, dtype, new_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")  # one core, as the other side's one thread
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
    from vllm import LLM, SamplingParams
    prompts = json.loads(open(prompts_path).read())
    llm = LLM(model=model_dir, dtype=dtype, max_num_seqs=len(prompts), max_model_len=max(map(len, prompts))
              + new_tokens + 16, enforce_eager=True, seed=0, skip_tokenizer_init=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if words == ["quit"]:
            break
        count = int(words[1]) if len(words) > 1 else new_tokens
        params = SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)
        began = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - began
        print(json.dumps({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outputs]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
