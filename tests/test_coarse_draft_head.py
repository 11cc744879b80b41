"""A greedy draft's LM head, coarse to exact (`cpu_forward.DRAFT_HEAD_TOP`, cpu/quant.c's
`hs_quant_top`): where the drafter reads only the tokens and the head is Q6_K, each draft step scores
the vocabulary by a coarse pass and takes the argmax of the best columns' exact logits. Its drafts
may then differ from the exact argmax's; the output may not: speculative == plain, greedy, on a
file whose LM head is Q6_K, with a shortlist small enough that some drafts do differ."""
from __future__ import annotations

import pytest
import torch

import hybridspec as hs
from hybridspec.kernels.cpu import forward as cpu_forward
from hybridspec.kernels.quant import formats
from native_cpu import x86_with_compiler
from test_gguf_q6_k import files

pytest.importorskip("gguf")
pytestmark = x86_with_compiler


def test_greedy_drafts_through_the_coarse_head_keep_the_output(tmp_path, monkeypatch):
    quantized, _ = files(tmp_path, vocab_size=160)  # the head Q6_K [160, 256]: ten 16-row tiles
    model = hs.load(quantized)
    assert model.lm_head.fmt is formats.Q6_K
    seen = []
    inner = cpu_forward.extend_greedy

    def recording(*args, head_top=0, **kwargs):
        out = inner(*args, head_top=head_top, **kwargs)
        seen.append((head_top, out[2]))
        return out
    monkeypatch.setattr(cpu_forward, "extend_greedy", recording)
    prompts = [[5, 17, 42, 9, 77, 3], [11, 150, 2, 64]]
    params = hs.SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in hs.Engine(model, max_batch_size=2, max_model_len=128).generate(prompts, params)]

    def speculative(top: int) -> tuple[list[list[int]], float]:
        monkeypatch.setattr(cpu_forward, "DRAFT_HEAD_TOP", top)
        engine = hs.Engine(model, draft="layers:1", num_draft_tokens=3, max_batch_size=2, max_model_len=128)
        tokens = [o.token_ids for o in engine.generate(prompts, params)]
        return tokens, engine.stats.acceptance_rate
    exact_tokens, exact_acceptance = speculative(160)  # every column: the exact argmax (vocab ≤ top)
    seen.clear()
    coarse_tokens, coarse_acceptance = speculative(3)  # of 160 columns: the coarse pass decides
    assert exact_tokens == coarse_tokens == plain
    assert coarse_acceptance != exact_acceptance  # some drafts differed
    assert seen and all(top == 3 for top, _ in seen)
    for _, logits in seen:  # each step's 3 best columns kept, the others −∞
        assert (torch.isfinite(logits).sum(-1) == 3).all()
