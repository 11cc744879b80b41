"""Plain decoding: `Engine(target)` against HF `generate` on the same weights.

A Bamba-shaped random model (float32, CPU, ~185M parameters: hidden 768, 16
layers with one attention layer in eight, Mamba2 headdim 64 and d_state 128,
vocabulary 32000) is built with `transformers.BambaForCausalLM` (random
weights, nothing downloaded). The engine runs it twice: sharing HF's weights
(`hs.from_hf`) and with its linear weights packed input-major
(`HybridModel.pack_for_cpu`, what `hs.load` does on CPU). At batch 1 and 4 the implementations decode
the same greedy continuation of the same prompts, alternating call by call
(one warm-up each, median of `--repeats`); the table gives tokens/s
(batch * new tokens / wall seconds of the whole generate call, prefill
included) and whether the tokens are equal.

    python benches/plain_decode.py            # the measurement (minutes)
    python benches/plain_decode.py --quick    # tiny model, a few tokens
"""
from __future__ import annotations

import sys

import torch

from common import bench_parser, describe_machine, print_table, set_threads, side_by_side, write_json

FULL = dict(hidden_size=768, num_hidden_layers=16, attn_layer_indices=[4, 12], intermediate_size=2048,
            num_attention_heads=12, num_key_value_heads=4, mamba_n_heads=24, mamba_d_head=64,
            mamba_d_state=128, vocab_size=32000)
QUICK = dict(hidden_size=64, num_hidden_layers=4, attn_layer_indices=[1], intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=32,
             mamba_d_state=16, vocab_size=512)


def build_bamba(shape: dict, seed: int = 0):
    """A random float32 BambaForCausalLM with no EOS (so HF decodes exactly max_new_tokens)."""
    from transformers import BambaConfig, BambaForCausalLM
    config = BambaConfig(**shape, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
                         max_position_embeddings=4096, tie_word_embeddings=False,
                         pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    model = BambaForCausalLM(config).float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy(model, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """HF generate on equal-length prompts: exactly `num_tokens` greedy tokens per row."""
    ids = torch.tensor(prompts)  # [batch, prompt_len]
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=num_tokens, min_new_tokens=num_tokens)
    return out[:, ids.shape[1]:].tolist()


def engine_greedy(engine, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    import hybridspec as hs
    outs = engine.generate(prompts, hs.SamplingParams(max_new_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


def first_mismatch(a: list[list[int]], b: list[list[int]]) -> int | None:
    """The first new-token index where any row differs (None when all equal)."""
    diffs = [i for x, y in zip(a, b) for i, (s, t) in enumerate(zip(x, y)) if s != t]
    diffs += [min(len(x), len(y)) for x, y in zip(a, b) if len(x) != len(y)]
    return min(diffs) if diffs else None


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated per sequence (default 64)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per implementation (default 3)")
    args = parser.parse_args(argv)
    import hybridspec as hs

    threads = set_threads(args.threads)
    shape = QUICK if args.quick else FULL
    num_tokens = args.new_tokens or (8 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)
    model = build_bamba(shape)
    target = hs.from_hf(model)
    params = target.num_parameters()
    print(f"Bamba-shaped random model: {params / 1e6:.1f}M parameters, float32; {describe_machine()}", flush=True)

    sizes = dict(max_batch_size=max(args.batches), max_model_len=args.prompt_len + num_tokens + 1)
    engine = hs.Engine(target, **sizes)  # shares HF's weights (from_hf)
    packed = hs.Engine(hs.from_hf(model).pack_for_cpu(), **sizes)  # input-major weights, as hs.load gives on CPU
    g = torch.Generator().manual_seed(1)
    rows = []
    for batch in args.batches:
        prompts = torch.randint(1, shape["vocab_size"], (batch, args.prompt_len), generator=g).tolist()
        results = {}
        seconds = side_by_side({
            "engine": lambda: results.__setitem__("engine", engine_greedy(engine, prompts, num_tokens)),
            "packed": lambda: results.__setitem__("packed", engine_greedy(packed, prompts, num_tokens)),
            "hf": lambda: results.__setitem__("hf", hf_greedy(model, prompts, num_tokens)),
        }, repeats=repeats)
        mismatch = first_mismatch(results["engine"], results["hf"])
        packed_mismatch = first_mismatch(results["packed"], results["hf"])
        engine_tps, hf_tps = batch * num_tokens / seconds["engine"], batch * num_tokens / seconds["hf"]
        packed_tps = batch * num_tokens / seconds["packed"]
        rows.append(dict(batch=batch, new_tokens=num_tokens, engine_tok_s=engine_tps, packed_tok_s=packed_tps,
                         hf_tok_s=hf_tps, ratio=engine_tps / hf_tps, packed_ratio=packed_tps / hf_tps,
                         engine_s=seconds["engine"], packed_s=seconds["packed"], hf_s=seconds["hf"],
                         tokens_equal=mismatch is None and packed_mismatch is None,
                         first_mismatch=mismatch if mismatch is not None else packed_mismatch))
        print(f"batch {batch}: engine {engine_tps:.1f} tok/s (packed weights {packed_tps:.1f}), HF {hf_tps:.1f} "
              f"tok/s, tokens equal: {'yes' if rows[-1]['tokens_equal'] else 'no'}", flush=True)

    print_table(rows, [("batch", "batch"), ("engine_tok_s", "engine tok/s"), ("packed_tok_s", "packed tok/s"),
                       ("hf_tok_s", "HF tok/s"), ("ratio", "engine/HF"), ("packed_ratio", "packed/HF"),
                       ("tokens_equal", "tokens equal")],
                title=f"plain greedy decoding, {num_tokens} new tokens after a {args.prompt_len}-token prompt, "
                      f"{threads} thread(s), median of {repeats}")
    write_json(args.out or "plain_decode.json", dict(
        bench="plain_decode", quick=args.quick, model=dict(family="bamba", parameters=params, dtype="float32",
                                                           **shape),
        prompt_len=args.prompt_len, new_tokens=num_tokens, repeats=repeats, threads=threads, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
