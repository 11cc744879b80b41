"""Simulator drafters of issue 51: a target's MTP layer and an EAGLE-3 head,
priced from their shapes by the target's roofline, their acceptance priors,
and `hybridspec simulate --drafter`."""
import json

import pytest

from hybridspec.costs.closed_form import expected_tokens
from hybridspec.errors import ConfigError
from hybridspec.sim.cost_model import break_even_alpha
from hybridspec.sim.drafters import eagle3_draft, mtp_draft, prior_from_length, prior_from_rate
from hybridspec.sim.presets import PRESETS, QWEN3_NEXT_80B, drafted
from test_sim_cli import _run  # the simulate command run in-process, its exit code and output

CONTEXT, GAMMA = 4096, 4


def qwen3_next_mtp_step_bytes(batch_tokens: int = 1) -> float:
    """An MTP step of one sequence on Qwen3-Next, from the published dimensions alone:
    weights read (fc, gated attention, router, shared expert, the top-10 experts one token
    picks, the shared LM head) plus its one attention layer's KV, bf16."""
    hidden, vocab, heads, kv_heads, head_dim = 2048, 151936, 16, 2, 256
    experts, top_k, expert_width, shared_width = 512, 10, 512, 512
    fc = hidden * 2 * hidden
    attention = hidden * 2 * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    moe = experts * hidden + 3 * hidden * shared_width + top_k * batch_tokens * 3 * hidden * expert_width
    lm_head = vocab * hidden
    kv = (CONTEXT + 1) * 2 * kv_heads * head_dim
    return 2.0 * (fc + attention + moe + lm_head + kv)


def c_at(preset, batch: int = 1) -> float:
    costs = preset.cost_model(CONTEXT).step_costs(batch, GAMMA)
    return float(costs.draft_step_s / costs.plain_step_s)


def test_mtp_cost_ratio_on_qwen3_next_is_what_its_shape_gives():
    model_preset = PRESETS["qwen3-next-80b-a3b"]
    mtp = drafted(model_preset, "mtp")
    plain = mtp.cost_model(CONTEXT).step_costs(1, GAMMA).plain_step_s
    expected = qwen3_next_mtp_step_bytes() / model_preset.hardware.memory_bandwidth / plain  # memory-bound
    assert c_at(mtp) == pytest.approx(expected, rel=1e-9)
    # below the separate 0.46B draft model's, though not by much: the full-vocabulary LM head
    # (151936 x 2048) is ~80% of what an MTP step reads
    assert c_at(mtp) < 0.85 * c_at(model_preset)
    lm_head = 2.0 * 151936 * 2048
    assert lm_head > 0.75 * qwen3_next_mtp_step_bytes()


def test_eagle3_head_reads_a_draft_vocabulary_so_it_costs_a_third_of_the_draft_model():
    model_preset = PRESETS["qwen3-next-80b-a3b"]
    head = eagle3_draft(QWEN3_NEXT_80B)
    hidden = 2048
    # fc [h, 3h]; q (with no gate) and o: 2h -> 16·256 -> h; k, v: 2h -> 2·256; SwiGLU of 10·512 + 512; LM head 32000·h
    params = (hidden * 3 * hidden + 2 * hidden * 4096 + 4096 * hidden + 2 * 2 * hidden * 512
              + 3 * hidden * 5632 + 32000 * hidden)
    assert head.total_params() == params
    assert c_at(drafted(model_preset, "eagle3")) < 0.35 * c_at(model_preset)


def test_mtp_shares_the_targets_lm_head_and_holds_one_moe_layer():
    draft = mtp_draft(QWEN3_NEXT_80B)
    cost = draft.model_cost()
    lm_head = 151936 * 2048 * 2
    assert cost.param_bytes - cost.resident_param_bytes == pytest.approx(lm_head)  # read every step, held by the target
    assert draft.total_params() == draft.block_params()  # no embedding of its own
    assert (draft.num_layers, draft.num_attention_layers, draft.num_moe_blocks) == (1, 1, 1)
    assert cost.kv_bytes_per_token == QWEN3_NEXT_80B.kv_bytes_per_token_per_layer()
    assert 1.6e9 < draft.total_params() < 1.7e9  # 512 experts of 3·2048·512 dominate


def test_a_dense_targets_mtp_layer_has_its_dense_mlp():
    bamba = PRESETS["bamba-9b"].target
    draft = mtp_draft(bamba)
    assert (draft.num_mlp_blocks, draft.num_moe_blocks, draft.num_mamba_layers) == (1, 0, 0)
    assert draft.block_params() == bamba.attention_params() + bamba.mlp_params() + 2 * 4096 * 4096


def test_mtp_pays_from_a_lower_alpha_than_the_draft_model_on_qwen3_next():
    model_preset = PRESETS["qwen3-next-80b-a3b"]
    by_kind = {kind: break_even_alpha(drafted(model_preset, kind).cost_model(CONTEXT), 1, GAMMA, 0, True)
               for kind in ("model", "mtp", "eagle3")}
    assert 0.0 < by_kind["eagle3"] < by_kind["mtp"] < by_kind["model"] < 1.0
    model = drafted(model_preset, "mtp").cost_model(CONTEXT)
    alpha = by_kind["mtp"]
    assert model.speedup(1, GAMMA, alpha, 0, True) > 1.0 >= model.speedup(1, GAMMA, alpha - 1e-3, 0, True)


def test_a_sharded_drafter_pays_its_own_all_reduces_under_tensor_parallel():
    preset = drafted(PRESETS["qwen3-next-80b-a3b-tp8"], "mtp")
    model = preset.cost_model(CONTEXT)
    assert model.draft_sharded
    draft_s = model.step_costs(8, GAMMA).draft_step_s
    assert draft_s == pytest.approx(model.forward_time(model.draft, 8, 1))
    assert model.all_reduce_time(model.draft, 8, 1) == pytest.approx(2 * model.all_reduce.time(2048 * 8 * 2))
    assert not PRESETS["qwen3-next-80b-a3b-tp8"].cost_model().draft_sharded  # a draft model runs whole on one rank


def test_priors_invert_published_figures():
    mtp = prior_from_rate(0.76, 4, "x")
    assert expected_tokens(mtp.alpha, 4) == pytest.approx(1 + 4 * 0.76, rel=1e-6)
    eagle = prior_from_length(2.67, 5, "x")
    assert expected_tokens(eagle.alpha, 5) == pytest.approx(2.67, rel=1e-6)
    with pytest.raises(ConfigError, match="acceptance length 7"):
        prior_from_length(7.0, 5, "x")
    assert drafted(PRESETS["qwen3-next-80b-a3b"], "mtp").prior.source.startswith("published")
    assert drafted(PRESETS["bamba-9b"], "mtp").prior.source.startswith("assumed")
    assert drafted(PRESETS["bamba-9b"], "model").prior is None


FAST = ["--rounds", "2000", "--alphas", "0.7,0.9", "--gammas", "4"]


def test_simulate_drafter_reports_each_drafter_and_its_c(capsys):
    code, out, _ = _run(FAST + ["--drafter", "model,mtp,eagle3", "--json", "-"], capsys)
    assert code == 0
    presets = {p["name"]: p for p in json.loads(out)["presets"]}
    assert set(presets) == {f"{name}{suffix}" for name in PRESETS for suffix in ("", "+mtp", "+eagle3")}
    mtp = presets["qwen3-next-80b-a3b+mtp"]
    assert mtp["drafter"]["kind"] == "mtp" and mtp["drafter"]["prior"]["alpha"] > 0.85
    assert mtp["c_at_batch"]["1"] == pytest.approx(c_at(drafted(PRESETS["qwen3-next-80b-a3b"], "mtp")))
    assert presets["qwen3-next-80b-a3b"]["drafter"] == {"kind": "model", "prior": None, "sharded": False}
    assert presets["qwen3-next-80b-a3b"]["at_prior"] is None and len(mtp["at_prior"]) == 3 * 4
    code, out, _ = _run(FAST + ["--drafter", "mtp"], capsys)
    assert code == 0 and "qwen3-next-80b-a3b+mtp on 2x H200 SXM" in out
    assert "drafter mtp: MTP layer of Qwen3-Next-80B-A3B-shaped" in out and "pays from alpha" in out
    assert "drafter model" not in out


@pytest.mark.parametrize("value, message", [("medusa", "'medusa' is not one of model, mtp, eagle3"),
                                            ("mtp,mtp", "name each drafter once"), ("", "name each drafter once")])
def test_simulate_rejects_a_bad_drafter(value, message, capsys):
    code, out, err = _run(FAST + ["--drafter", value], capsys)
    assert code == 2 and out == "" and message in err and err.startswith("hybridspec simulate: error:")
