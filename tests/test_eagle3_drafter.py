"""EAGLE-3 heads (`models/eagle3.py`, `adapters/eagle3.py`, `spec/eagle3_drafter.py`):
the loader refuses a head that does not fit the target, naming the mismatch;
the head's forward is the published EAGLE-3 formula (a float64 reference
written here), over a catch-up in chunks and a recursive step on its own
output; and the Engine keeps its guarantees with it: greedy and coupled output
equal plain decoding's on the embedded target with the shipped head and on
tiny float64 Bamba and Qwen3-Next targets with random heads, prefix cache on
or off, with HYBRIDSPEC_CHECK=1, and through preemption."""
import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import hybridspec as hs
from hybridspec.adapters.eagle3 import load_eagle3
from hybridspec.errors import ConfigError, ModelFilesError
from hybridspec.spec.eagle3_drafter import Eagle3Drafter
from oracles import bamba, qwen3_next

SHIPPED = Path(hs.__file__).resolve().parent / "assets" / "embedded" / "eagle3"
HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, EPS = 2, 1, 8, 24, 1e-6


def random_head(target, seed=0, draft_vocab=None, points=(0, 1, 3), scale=0.3):
    """(config dict, tensors in published names) of a random head for `target`."""
    g = torch.Generator().manual_seed(seed)
    H, V = target.config.hidden_size, target.vocab_size
    Vd = draft_vocab or V

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    chosen = torch.randperm(V, generator=g)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    tensors = {"fc.weight": r(H, 3 * H), "norm.weight": 1 + r(H), "lm_head.weight": r(Vd, H),
               "d2t": chosen - torch.arange(Vd), "t2d": t2d,
               "midlayer.input_layernorm.weight": 1 + r(H), "midlayer.hidden_norm.weight": 1 + r(H),
               "midlayer.post_attention_layernorm.weight": 1 + r(H),
               "midlayer.self_attn.q_proj.weight": r(q, 2 * H), "midlayer.self_attn.k_proj.weight": r(kv, 2 * H),
               "midlayer.self_attn.v_proj.weight": r(kv, 2 * H), "midlayer.self_attn.o_proj.weight": r(H, q),
               "midlayer.mlp.gate_proj.weight": r(INTERMEDIATE, H), "midlayer.mlp.up_proj.weight": r(INTERMEDIATE, H),
               "midlayer.mlp.down_proj.weight": r(H, INTERMEDIATE)}
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
              "intermediate_size": INTERMEDIATE, "rms_norm_eps": EPS, "rope_theta": 10000.0, "vocab_size": V,
              "draft_vocab_size": Vd, "num_hidden_layers": 1, "hidden_act": "silu", "target_hidden_size": H}
    if points is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(points)}
    return config, tensors


def save(directory: Path, config: dict, tensors: dict) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return str(directory)


@pytest.fixture(scope="module")
def tiny_bamba():
    return hs.from_hf(bamba(seed=1, attn_layers=(1,), num_layers=3, vocab=12))


# -- loading ----------------------------------------------------------------------------------------

def _wider_fc(c, t):
    c["target_hidden_size"] = c["hidden_size"] + 8
    t["fc.weight"] = torch.zeros(c["hidden_size"], 3 * (c["hidden_size"] + 8), dtype=torch.float64)


def _duplicate_d2t(c, t):
    t["d2t"] = torch.zeros_like(t["d2t"]) - torch.arange(len(t["d2t"]))  # every draft id -> target id 0
    del t["t2d"]


@pytest.mark.parametrize("break_it, error, match", [
    (_wider_fc, ConfigError, "hidden states of size 40"),
    (lambda c, t: c.update(vocab_size=c["vocab_size"] + 1), ConfigError, "vocab_size=13"),
    (lambda c, t: c.update(draft_vocab_size=c["vocab_size"] + 1), ConfigError, "draft_vocab_size"),
    (lambda c, t: t.pop("midlayer.hidden_norm.weight"), ModelFilesError, "lacks hidden_norm.weight"),
    (lambda c, t: t.pop("d2t"), ModelFilesError, "lacks d2t"),
    (lambda c, t: t.update({"lm_head.weight": t["lm_head.weight"][:-1]}), ModelFilesError, "lm_head.weight is"),
    (lambda c, t: t.update({"midlayer.extra.weight": t["norm.weight"].clone()}), ModelFilesError, "midlayer.extra"),
    (_duplicate_d2t, ModelFilesError, "onto one token twice"),
    (lambda c, t: t.update(t2d=~t["t2d"]), ModelFilesError, "t2d"),
    (lambda c, t: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}), ConfigError,
     "eagle_aux_hidden_state_layer_ids"),
    (lambda c, t: c.update(num_hidden_layers=2), ConfigError, "num_hidden_layers=2"),
    (lambda c, t: c.pop("intermediate_size"), ConfigError, "lacks intermediate_size"),
], ids=["hidden", "vocab", "draft-vocab", "missing", "missing-d2t", "shape", "unknown", "d2t", "t2d", "points",
        "layers", "config"])
def test_a_head_that_does_not_fit_is_refused(tiny_bamba, tmp_path, break_it, error, match):
    config, tensors = random_head(tiny_bamba, draft_vocab=8)
    break_it(config, tensors)
    with pytest.raises(error, match=match):
        load_eagle3(tiny_bamba, save(tmp_path / "head", config, tensors))


def test_the_draft_names(tiny_bamba, tmp_path):
    with pytest.raises(ConfigError, match="shipped for the embedded target"):
        hs.Engine(tiny_bamba, draft="eagle3")
    head = save(tmp_path / "head", *random_head(tiny_bamba, draft_vocab=8, points=None))
    drafter = hs.Engine(tiny_bamba, draft=f"eagle3:{head}").speculator.drafter
    assert isinstance(drafter, Eagle3Drafter)
    assert drafter.layer.points == (2, 1, 0)  # EAGLE-3's (2, L//2, L-3) of a 3-layer target
    assert drafter.hidden.points == (0, 1, 2)


# -- the forward ------------------------------------------------------------------------------------

def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope(x, positions):
    """Rotate-half rotary embeddings over the whole head, the frequencies formed in
    float32 as HF forms them; x [n, heads, d]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = positions[:, None].double() * inv_freq.double()
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def reference(t, embed, g, tokens, vocab, norm_before_residual=False):
    """The EAGLE-3 layer over positions 0..n-1 from inputs g [n, H] beside tokens [n]:
    (logits [n, vocab] with -inf off the draft vocabulary, pre-norm y [n, H])."""
    n = len(tokens)
    x = torch.cat([rms(embed[tokens], t["midlayer.input_layernorm.weight"]),
                   rms(g, t["midlayer.hidden_norm.weight"])], -1)
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    q, k = rope(q, torch.arange(n)), rope(k, torch.arange(n))
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    residual = rms(g, t["midlayer.hidden_norm.weight"]) if norm_before_residual else g
    r = residual + attended @ t["midlayer.self_attn.o_proj.weight"].T
    m = rms(r, t["midlayer.post_attention_layernorm.weight"])
    y = r + (F.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (m @ t["midlayer.mlp.up_proj.weight"].T)) \
        @ t["midlayer.mlp.down_proj.weight"].T
    draft = rms(y, t["norm.weight"]) @ t["lm_head.weight"].T
    logits = torch.full((n, vocab), float("-inf"), dtype=torch.float64)
    logits[:, torch.arange(draft.shape[1]) + t["d2t"]] = draft
    return logits, y


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("own_embedding", [False, True])
def test_the_forward_is_the_published_formula(tiny_bamba, tmp_path, norm_before_residual, own_embedding):
    """A catch-up in two chunks, then a step on the head's own output: each
    returned row equals the reference's at that position (the head's residual
    before or after its hidden norm; the target's embedding or its own)."""
    config, tensors = random_head(tiny_bamba, draft_vocab=7, points=(0, 1, 3))
    config["norm_before_residual"] = norm_before_residual
    if own_embedding:
        tensors["embed_tokens.weight"] = torch.randn(tiny_bamba.vocab_size, tiny_bamba.config.hidden_size,
                                                     dtype=torch.float64)
    head = load_eagle3(tiny_bamba, save(tmp_path / "head", config, tensors))
    g = torch.Generator().manual_seed(5)
    n, H = 11, tiny_bamba.config.hidden_size
    low_mid_high = torch.randn(n, 3, H, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, tiny_bamba.vocab_size, (n + 1,), generator=g)
    fused = head.fuse(low_mid_high)
    torch.testing.assert_close(fused, low_mid_high.flatten(1) @ tensors["fc.weight"].T, rtol=1e-12, atol=1e-12)
    cache = head.new_cache(max_seqs=1, num_blocks=8, block_size=4)
    cache.add_sequences([0])
    got = [head.extend(cache, [0], [tokens[:4].tolist()], [fused[:4]]),
           head.extend(cache, [0], [tokens[4:n].tolist()], [fused[4:]])]
    got.append(head.extend(cache, [0], [[int(tokens[n])]], [got[-1][1][0][None]]))
    inputs = torch.cat([fused, got[1][1]])  # position n reads the head's own y at n-1
    embed = tensors["embed_tokens.weight"] if own_embedding else tiny_bamba.embed
    want_logits, want_y = reference(tensors, embed, inputs, tokens, tiny_bamba.vocab_size, norm_before_residual)
    for (logits, y), row in zip(got, (3, n - 1, n)):
        torch.testing.assert_close(logits[0], want_logits[row], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(y[0], want_y[row], rtol=1e-12, atol=1e-12)
    assert torch.isinf(got[0][0]).sum() == tiny_bamba.vocab_size - 7  # off the draft vocabulary


# -- the Engine -------------------------------------------------------------------------------------

def prompts_for(vocab, seed, count=5):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 9))] for _ in range(count)]


def sampled(verify, count=5, tokens=20):
    if verify == "greedy":
        return [hs.SamplingParams(max_new_tokens=tokens, ignore_eos=True)] * count
    return [hs.SamplingParams(max_new_tokens=tokens, ignore_eos=True, temperature=0.9, seed=i,
                              top_k=0 if i % 2 else 5) for i in range(count)]


def outputs(engine, prompts, params):
    return [o.token_ids for o in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def embedded():
    return hs.load(hs.embedded_paths()[0])


@pytest.fixture(scope="module")
def tiny_qwen3_next():
    return hs.from_hf(qwen3_next(seed=2))


@pytest.mark.parametrize("model", ["embedded", "tiny_bamba", "tiny_qwen3_next"])
@pytest.mark.parametrize("verify", ["greedy", "coupled"])
def test_speculative_output_is_plain_output(model, verify, request, tmp_path, monkeypatch):
    """Batches of 5 at concurrency 3, γ = 3, HYBRIDSPEC_CHECK=1 (the boundary
    invariants after every round, the head's K/V length included), prefix cache
    on with the second batch repeating the first's prompts (hits), equal to
    plain decoding with the cache off."""
    target = request.getfixturevalue(model)
    if model == "embedded":
        head = str(SHIPPED)
        prompts = [list(s.encode()) for s in ("import os\n\ndef ", "class Box:\n    def __init__(self",
                                             "    return self.", "for i in range(", "if __name__ == ")]
    else:
        head = save(tmp_path / "head", *random_head(target, seed=3, draft_vocab=target.vocab_size - 3,
                                                    points=(1, 2, 3)))
        prompts = prompts_for(target.vocab_size, seed=4)
    params = sampled(verify)
    monkeypatch.setenv("HYBRIDSPEC_CHECK", "1")
    spec = hs.Engine(target, draft=f"eagle3:{head}", num_draft_tokens=3, max_batch_size=3, block_size=4,
                     prefix_cache=True, verify="coupled" if verify == "coupled" else "rejection")
    monkeypatch.delenv("HYBRIDSPEC_CHECK")
    assert spec.check_invariants
    plain = hs.Engine(target, max_batch_size=3, block_size=4)
    want = outputs(plain, prompts, params)
    for _ in range(2):  # the second time the prompts hit the prefix cache
        assert outputs(spec, prompts, params) == want
    assert spec.total_stats.drafted_tokens > 0 and spec.total_stats.prefix_hit_tokens > 0
    if model != "tiny_qwen3_next":  # 97 tokens: a random head is rarely right
        assert spec.total_stats.accepted_tokens > 0


@pytest.mark.parametrize("verify", ["rejection", "coupled"])
def test_preemption_changes_no_token(tiny_bamba, tmp_path, verify):
    """A pool that holds the prompts but not their growth: sequences are
    preempted, the head forgets them and catches up again when they resume."""
    target = tiny_bamba
    head = save(tmp_path / "head", *random_head(target, seed=6, draft_vocab=9))
    prompts = prompts_for(target.vocab_size, seed=7, count=4)
    params = sampled("greedy" if verify == "rejection" else "coupled", count=4, tokens=14)
    pages = -(-max(len(p) + 14 for p in prompts) // 4) + 2
    engine = hs.Engine(target, draft=f"eagle3:{head}", num_draft_tokens=3, max_batch_size=4, block_size=4,
                       num_blocks=pages, verify=verify)
    engine.check_invariants = engine.speculator.check = True
    outs = outputs(engine, prompts, params)
    assert engine.stats.preemptions > 0 and engine.stats.drafted_tokens > 0
    assert outs == [outputs(hs.Engine(target, block_size=4), [p], [q])[0] for p, q in zip(prompts, params)]


def test_generate_runs_the_shipped_head_on_the_embedded_default(capsys):
    from hybridspec.cli.main import main
    assert main(["generate", "def ", "--draft", "eagle3", "-n", "24", "--gamma", "3"]) == 0
    err = capsys.readouterr().err
    assert "eagle3 (EAGLE-3 head)" in err and "same tokens as plain: yes" in err
