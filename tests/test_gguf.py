"""GGUF files (`adapters.gguf`): models written in llama.cpp's layout (`write_gguf`, `hybridspec
quantize`) load back with the logits of their model directory (float: equal; quantized: equal to
`hs.load(dir, quantize=...)`, bit for bit); loading is strict; the file's tokenizer gives text in and
out; speculative output on a GGUF target equals plain output."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import hybridspec as hs
import oracles
from hybridspec.adapters.gguf.archs import ARCHS
from hybridspec.adapters.gguf.writer import canonical_weights, stored_tensors, write_file, write_gguf
from hybridspec.cache.hybrid_cache import HybridCache
from hybridspec.cli.main import main
from hybridspec.errors import ModelFilesError, UnsupportedModelError
from hybridspec.kernels.quant.weight import QuantWeight
from native_cpu import x86_with_compiler

pytest.importorskip("gguf")
TOKENS = [[5, 7, 9, 11, 3, 2, 40, 50, 60, 61, 62, 17]]
EXACT_MULTIPLIERS = (3.0, 0.625, 0.25, 2.5)  # float32 values: GGUF stores the multipliers in float32
GDN_EVERY_2 = ("linear_attention", "full_attention") * 2  # llama.cpp's full_attention_interval 2
FAMILIES = {
    "granite-moe": lambda: oracles.granite(multipliers=EXACT_MULTIPLIERS, dtype=torch.float32),
    "granite-dense": lambda: oracles.granite(num_experts=0, rope=False, multipliers=EXACT_MULTIPLIERS,
                                             dtype=torch.float32),
    "bamba": lambda: oracles.bamba(dtype=torch.float32),
    "nemotron-h": lambda: oracles.nemotron_h(dtype=torch.float32),
    "mamba2": lambda: pure_mamba2(),
    "qwen3-next": lambda: oracles.qwen3_next(layer_types=GDN_EVERY_2, dtype=torch.float32),
    "qwen3.5": lambda: oracles.qwen3_5(layer_types=GDN_EVERY_2, dtype=torch.float32),
    "qwen3.5-moe": lambda: oracles.qwen3_5_moe(layer_types=GDN_EVERY_2, dtype=torch.float32),
}


class MambaSsmDirectory:
    """A pure Mamba-2 in mamba_ssm's layout (llama.cpp's `mamba2` architecture), tied, with a Δ clamp."""

    def __init__(self, model):
        self.model = model

    def save_pretrained(self, path):
        import json
        path.mkdir(parents=True)
        state = {k.replace("backbone.embeddings.", "backbone.embedding."): v
                 for k, v in self.model.state_dict().items() if k != "lm_head.weight"}
        ssm_cfg = {"layer": "Mamba2", "d_state": 8, "d_conv": 4, "expand": 2, "headdim": 16, "ngroups": 2,
                   "chunk_size": 8, "dt_limit": [0.05, 2.0]}
        (path / "config.json").write_text(json.dumps(
            {"d_model": 32, "n_layer": 2, "d_intermediate": 0, "vocab_size": 100, "ssm_cfg": ssm_cfg,
             "rms_norm": True, "pad_vocab_size_multiple": 8, "tie_embeddings": True}))
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))


def pure_mamba2():
    from transformers import Mamba2Config, Mamba2ForCausalLM
    cfg = Mamba2Config(vocab_size=104, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                       state_size=8, n_groups=2, chunk_size=8, tie_word_embeddings=True)
    torch.manual_seed(8)
    return MambaSsmDirectory(oracles.randomize_(Mamba2ForCausalLM(cfg), 8).float().eval())


def logits(model) -> torch.Tensor:
    cache = HybridCache(model.config, max_seqs=1, num_blocks=4, block_size=16, ring_slots=2, dtype=model.dtype,
                        device=model.device)
    return model.prefill(cache, [0], TOKENS)


def saved(model, path):
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_float_gguf_has_the_logits_of_its_directory(family, tmp_path):
    directory = saved(FAMILIES[family](), tmp_path / "hf")
    write_gguf(directory, tmp_path / "model.gguf")
    expected, got = logits(hs.load(directory)), logits(hs.load(tmp_path / "model.gguf"))
    assert (got - expected).abs().max() <= 1e-6 * expected.abs().max()


def quantizable_granite(tmp_path):
    """A Granite-4.0-H whose products take every format: hidden 256 (Q4_K's super-block)."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    cfg = GraniteMoeHybridConfig(
        vocab_size=97, hidden_size=256, intermediate_size=64, shared_intermediate_size=288, num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"], num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=0, position_embedding_type="rope", mamba_n_heads=4, mamba_d_state=16, mamba_n_groups=1,
        mamba_chunk_size=8, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.125,
        logits_scaling=4.0, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    return saved(oracles.randomize_(GraniteMoeHybridForCausalLM(cfg), 0).float().eval(), tmp_path / "hf")


@x86_with_compiler
@pytest.mark.parametrize("fmt", ("q8_0", "q4_0", "q4_k"))
def test_hybridspec_quantize_writes_what_load_quantize_multiplies_bit_for_bit(fmt, tmp_path):
    directory = quantizable_granite(tmp_path)
    assert main(["quantize", str(directory), str(tmp_path / "model.gguf"), "--type", fmt]) == 0
    model = hs.load(tmp_path / "model.gguf")
    assert model.layers[0].mixer.in_proj.fmt.name == fmt and model.lm_head.fmt.name == "q8_0"
    assert torch.equal(logits(model), logits(hs.load(directory, quantize=fmt)))


@x86_with_compiler
@pytest.mark.parametrize("family", ("nemotron-h", "mamba2"))
def test_a_quantized_model_of_another_family_round_trips_bit_for_bit(family, tmp_path):
    directory = saved(FAMILIES[family](), tmp_path / "hf")
    write_gguf(directory, tmp_path / "model.gguf", "q4_0")
    model = hs.load(tmp_path / "model.gguf")
    assert isinstance(model.layers[0].mixer.in_proj, QuantWeight)
    assert torch.equal(logits(model), logits(hs.load(directory, quantize="q4_0")))


@x86_with_compiler
def test_a_quantized_qwen3_next_round_trips_bit_for_bit_through_its_split_projections(tmp_path):
    directory = saved(FAMILIES["qwen3-next"](), tmp_path / "hf")
    write_gguf(directory, tmp_path / "model.gguf", "q8_0")
    from hybridspec.adapters.gguf.reader import open_file
    assert {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_ba.weight"} <= \
        {t.name for t in open_file(tmp_path / "model.gguf").tensors}
    model = hs.load(tmp_path / "model.gguf")
    assert isinstance(model.layers[0].mixer.in_proj, QuantWeight)
    assert torch.equal(logits(model), logits(hs.load(directory, quantize="q8_0")))


@x86_with_compiler
def test_a_quantized_qwen3_5_keeps_its_reordered_value_heads(tmp_path):
    """Qwen3.5's value heads are tiled in the file: in_proj's rows reassemble into our blocks (quantized,
    bit for bit), out_proj's columns do not (read as float: here, one block a row, the values of ours)."""
    directory = saved(FAMILIES["qwen3.5-moe"](), tmp_path / "hf")
    write_gguf(directory, tmp_path / "model.gguf", "q8_0")
    model, expected = hs.load(tmp_path / "model.gguf", pack=False), hs.load(directory, quantize="q8_0")
    gdn = model.layers[0].mixer
    assert isinstance(gdn.in_proj, QuantWeight) and not isinstance(gdn.out_proj, QuantWeight)
    assert torch.equal(gdn.in_proj.data, expected.layers[0].mixer.in_proj.data)
    assert torch.equal(gdn.out_proj, expected.layers[0].mixer.out_proj.dequantize())


def test_qwen_norms_are_stored_as_one_plus_w_and_the_value_heads_tiled(tmp_path):
    """As llama.cpp's converter writes them: every norm but the GDN's gated one as 1 + w; Qwen3.5's
    A (= -exp(A_log)) in tiled value-head order (position i·HK + h holds head h·r + i)."""
    model = FAMILIES["qwen3.5"]()
    directory = saved(model, tmp_path / "hf")
    write_gguf(directory, tmp_path / "model.gguf")
    from hybridspec.adapters.gguf.reader import as_float, open_file
    stored = {t.name: as_float(t) for t in open_file(tmp_path / "model.gguf").tensors}
    hf = model.model.layers[0]
    assert torch.equal(stored["blk.0.attn_norm.weight"], 1 + hf.input_layernorm.weight)
    assert torch.equal(stored["blk.0.ssm_norm.weight"], hf.linear_attn.norm.weight)
    a = -torch.exp(hf.linear_attn.A_log.detach())  # [HV] = [HK·r], grouped
    assert torch.equal(stored["blk.0.ssm_a"], a.reshape(2, 2).t().reshape(-1))


def rewritten(tmp_path, change) -> str:
    """The granite model's float GGUF with `change(tensors)` applied to its tensors."""
    directory = saved(FAMILIES["granite-moe"](), tmp_path / "hf")
    write_gguf(directory, tmp_path / "model.gguf")
    from hybridspec.adapters.gguf.reader import metadata, open_file
    meta = metadata(open_file(tmp_path / "model.gguf"))
    config, weights = canonical_weights(directory)
    tensors = stored_tensors(config, weights, None)
    change(tensors)
    out = tmp_path / "changed.gguf"
    write_file(out, "granitehybrid", {k: v for k, v in meta.items() if k != "general.architecture"}, tensors)
    return str(out)


@pytest.mark.parametrize("change, named", [
    (lambda t: t.pop("blk.1.attn_k.weight"), r"missing 1: blk\.1\.attn_k\.weight"),
    (lambda t: t.update({"blk.0.ssm_d": t["blk.0.ssm_d"][:3]}), r"wrong shape 1: blk\.0\.ssm_d is \[3, 1\]"),
    (lambda t: t.update({"blk.2.ssm_out.weight": t["blk.2.ssm_out.weight"].astype(np.float64)}),
     r"unsupported type 1: blk\.2\.ssm_out\.weight \(F64\)"),
    (lambda t: t.update({"blk.0.extra.weight": np.zeros(4, np.float32)}), r"not used by the model 1: blk\.0\.extra"),
])
def test_loading_is_strict_and_names_the_tensor(change, named, tmp_path):
    path = rewritten(tmp_path, change)
    with pytest.raises(ModelFilesError, match=named):
        hs.load(path)


def test_a_one_group_norm_stored_without_its_leading_one_loads_as_llama_cpps_quantizer_writes_it(tmp_path):
    """llama.cpp's quantizer writes each tensor with ggml_n_dims dimensions: a [1, n] Mamba-2 norm comes
    out as [n]; the file loads with the same logits."""
    def flatten_one_group_norms(tensors):
        norms = [k for k, v in tensors.items() if k.endswith("ssm_norm.weight") and v.shape[0] == 1]
        assert norms  # the oracle's Mamba-2 layers have one group
        tensors.update({k: tensors[k].reshape(-1) for k in norms})
    expected = logits(hs.load(rewritten(tmp_path / "same", lambda t: None)))
    assert torch.equal(logits(hs.load(rewritten(tmp_path, flatten_one_group_norms))), expected)

def test_an_architecture_it_does_not_map_is_a_typed_error(tmp_path):
    from hybridspec.adapters.gguf.writer import write_file as write
    write(tmp_path / "m.gguf", "rwkv7", {}, {"token_embd.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(UnsupportedModelError, match="rwkv7.*" + ", ".join(sorted(ARCHS))):
        hs.load(tmp_path / "m.gguf")


def byte_level_tokenizer(directory, vocab_size: int):
    """A byte-level BPE tokenizer trained on a few sentences (256 bytes + merges), saved to `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the cat sat on the mat", "hello world, héllo wörld", "def main(): return 0"] * 20,
                                  trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end|>")
    fast.save_pretrained(directory)
    return fast


TEXTS = ["the cat sat on the mat", "héllo wörld <|end|> again", "  spaces\tand\nlines 123", "日本語 ✓"]


def test_the_tokenizer_round_trips_through_the_file(tmp_path):
    directory = saved(oracles.granite(vocab=300, multipliers=EXACT_MULTIPLIERS, dtype=torch.float32),
                      tmp_path / "hf")
    original = byte_level_tokenizer(directory, 300)
    write_gguf(directory, tmp_path / "model.gguf")
    from hybridspec.text.gguf_vocab import gguf_codec
    codec = gguf_codec(tmp_path / "model.gguf")
    for text in TEXTS:
        assert codec.encode(text) == original.encode(text)
        assert codec.decode(codec.encode(text)) == original.decode(original.encode(text), skip_special_tokens=True)
    assert codec.eos_token_ids == (original.eos_token_id,)


def test_a_tokenizer_model_it_does_not_read_is_a_typed_error_naming_it():
    from hybridspec.text.gguf_vocab import tokenizer_of
    with pytest.raises(UnsupportedModelError, match="tokenizer.ggml.model='t5'.*tokenizer="):
        tokenizer_of({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]}, "m.gguf")


def test_a_file_written_without_a_tokenizer_says_so_as_llama_cpp_reads_it(tmp_path):
    """No tokenizer.json beside the model: the file names "no_vocab" (llama.cpp refuses a file
    that names no tokenizer model), loads, and asks for tokenizer= when text is wanted."""
    from hybridspec.adapters.gguf.reader import metadata, open_file
    from hybridspec.text.gguf_vocab import gguf_codec
    directory = saved(FAMILIES["granite-dense"](), tmp_path / "hf")
    assert not (directory / "tokenizer.json").exists()
    write_gguf(directory, tmp_path / "model.gguf")
    assert metadata(open_file(tmp_path / "model.gguf"))["tokenizer.ggml.model"] == "no_vocab"
    assert hs.load(tmp_path / "model.gguf").vocab_size > 0
    with pytest.raises(UnsupportedModelError, match="carries no tokenizer.*tokenizer="):
        gguf_codec(tmp_path / "model.gguf")


@x86_with_compiler
def test_llm_on_a_gguf_file_decodes_text_and_speculates_exactly(tmp_path):
    directory = saved(oracles.granite(vocab=300, multipliers=EXACT_MULTIPLIERS, dtype=torch.float32),
                      tmp_path / "hf")
    byte_level_tokenizer(directory, 300)
    draft_dir = saved(oracles.granite(seed=1, vocab=300, layer_types=("mamba", "attention"),
                                      multipliers=EXACT_MULTIPLIERS, dtype=torch.float32), tmp_path / "draft")
    write_gguf(directory, tmp_path / "target.gguf", "q4_0")
    write_gguf(draft_dir, tmp_path / "draft.gguf", "q8_0")
    params = hs.SamplingParams(max_new_tokens=16)
    prompts = ["the cat sat", "hello world"]
    plain = hs.LLM(str(tmp_path / "target.gguf"), draft=None).generate(prompts, params)
    assert all(o.text and o.token_ids for o in plain)
    expected = hs.LLM(hs.load(directory, quantize="q4_0"), draft=None, tokenizer=str(directory)).generate(prompts,
                                                                                                          params)
    assert [o.text for o in plain] == [o.text for o in expected]
    for draft in (str(tmp_path / "draft.gguf"), "ngram"):
        got = hs.LLM(str(tmp_path / "target.gguf"), draft=draft).generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in plain]
