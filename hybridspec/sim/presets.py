"""Preset hardware and model shapes. Every figure here is *assumed*: datasheet
peaks and published config dimensions, not measurements on this machine."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from hybridspec.sim.cost_model import AllReduceLink, CostModel, Hardware
from hybridspec.sim.drafters import (AcceptancePrior, check_drafter_kind, eagle3_draft, mtp_draft, prior_from_length,
                                     prior_from_rate)
from hybridspec.sim.mixers import GdnMixer
from hybridspec.sim.shapes import HybridShape

H200 = Hardware(
    name="H200 SXM",
    memory_bandwidth=4.8e12,  # bytes/s, HBM3e
    peak_flops=989e12,  # dense BF16 (1979e12 is the 2:4-sparse figure)
    memory_bytes=141e9,
    source="assumed: NVIDIA H200 SXM datasheet (4.8 TB/s, 141 GB HBM3e, 989 TFLOPS dense BF16); achieved rates are lower",
)

# Qwen3-Next-80B-A3B's bf16 weights (~159 GB) do not fit one H200
def ganged(device: Hardware, count: int, source: str) -> Hardware:
    """`count` of `device` counted as one device: `count` times its bandwidth, FLOPs and memory."""
    return Hardware(name=f"{count}x {device.name}", memory_bandwidth=count * device.memory_bandwidth,
                    peak_flops=count * device.peak_flops, memory_bytes=count * device.memory_bytes, source=source)


H200_X2 = ganged(H200, 2, "assumed: two H200 SXM as one device (tensor parallel at twice one H200's bandwidth, "
                          "FLOPs and HBM, communication free)")

H200_X8 = ganged(H200, 8, "assumed: eight H200 SXM of one NVLink node as one device (each rank a shard: 8x one "
                          "H200's bandwidth, FLOPs and HBM); the all-reduces are NVLINK_H200_X8's")

NVLINK_H200_X8 = AllReduceLink(
    ranks=8,
    bandwidth=450e9,  # bytes/s per GPU per direction: NVLink 4, 900 GB/s bidirectional
    latency=10e-6,  # s per all-reduce: NCCL's small-message latency within one NVSwitch node
    source="assumed: NVLink 4 / NVSwitch, 450 GB/s per direction per H200 (900 GB/s bidirectional, the "
           "datasheet's; NCCL reaches less), 10 us per all-reduce (NCCL small messages in one node); ring all-reduce",
)

BAMBA_9B = HybridShape(
    name="Bamba-9B-shaped",
    d_model=4096,
    vocab_size=128256,
    num_mamba_layers=29,
    num_attention_layers=3,  # attn_layer_indices [9, 18, 27] of 32
    num_mlp_blocks=32,  # every layer: mixer + gated (SwiGLU) MLP
    mlp_intermediate=14336,
    mlp_matrices=3,
    separate_mlp_layers=False,
    mamba_d_state=128,
    mamba_headdim=64,  # 128 Mamba heads
    mamba_ngroups=1,
    mamba_expand=2,
    mamba_d_conv=4,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    tie_embeddings=False,
    weight_bytes=2,  # bf16 weights, KV, logged activations
    state_bytes=4,  # float32 SSM state and conv window, as Engine keeps them by default
    source="assumed: dimensions from the published Bamba-9B config (ibm-ai-platform/Bamba-9B), fp32 state",
)

NEMOTRON_H_8B = HybridShape(
    name="Nemotron-H-8B-shaped",
    d_model=4096,
    vocab_size=131072,
    num_mamba_layers=24,
    num_attention_layers=4,
    num_mlp_blocks=24,  # MLP layers of their own: squared-ReLU up/down, no gate
    mlp_intermediate=21504,
    mlp_matrices=2,
    separate_mlp_layers=True,
    mamba_d_state=128,
    mamba_headdim=64,  # 128 Mamba heads
    mamba_ngroups=8,
    mamba_expand=2,
    mamba_d_conv=4,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    tie_embeddings=False,
    weight_bytes=2,
    state_bytes=4,  # the config's mamba_ssm_cache_dtype is float32
    source="assumed: dimensions from the published Nemotron-H-8B config (nvidia/Nemotron-H-8B-Base-8K), fp32 SSM cache",
)

NEMOTRON_3_NANO_30B = HybridShape(
    name="Nemotron-3-Nano-30B-A3B-shaped",
    d_model=2688,
    vocab_size=131072,
    num_mamba_layers=23,
    num_attention_layers=6,
    num_mlp_blocks=0,  # no dense MLP layers: the 23 "E" layers hold the feed-forward
    mlp_intermediate=0,
    mlp_matrices=2,
    separate_mlp_layers=True,
    mamba_d_state=128,
    mamba_headdim=64,  # 64 Mamba heads: d_inner 4096, not an integer expand of 2688
    mamba_ngroups=8,
    mamba_expand=2,
    mamba_d_conv=4,
    num_heads=32,
    num_kv_heads=2,
    head_dim=128,
    tie_embeddings=False,
    weight_bytes=2,
    state_bytes=4,
    source="assumed: dimensions as recalled from the published Nemotron-3-Nano-30B-A3B config "
           "(nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B: 52 layers, 23 Mamba2 + 23 MoE + 6 attention, 128 experts top-6), "
           "not read from the file here; uniform routing assumed for the experts a batch touches",
    mamba_d_inner=4096,
    num_moe_blocks=23,
    moe_num_experts=128,
    moe_top_k=6,
    moe_intermediate=1856,
    moe_shared_intermediate=3712,
    moe_matrices=2,  # squared-ReLU experts: up, down
)

FALCON_H1_7B = HybridShape(
    name="Falcon-H1-7B-shaped",
    d_model=3072,
    vocab_size=130048,
    num_mamba_layers=44,
    num_attention_layers=44,  # every layer runs attention and Mamba2 side by side
    num_mlp_blocks=44,  # every layer: SwiGLU MLP after the parallel mixer
    mlp_intermediate=12288,
    mlp_matrices=3,
    separate_mlp_layers=False,
    mamba_d_state=256,
    mamba_headdim=128,  # 24 Mamba heads over mamba_d_ssm 3072
    mamba_ngroups=1,
    mamba_expand=1,
    mamba_d_conv=4,
    num_heads=12,
    num_kv_heads=2,
    head_dim=128,
    tie_embeddings=False,
    weight_bytes=2,
    state_bytes=4,
    source="assumed: dimensions as recalled from the published Falcon-H1-7B config (tiiuae/Falcon-H1-7B-Base: "
           "44 layers, hidden 3072, 12/2 attention heads of 128, 24 Mamba heads of 128, d_state 256), "
           "not read from the file here",
    mamba_d_inner=3072,
    parallel_mixers=True,
)

_ZAMBA2_7B_OCCURRENCES = 13  # hybrid layers, each running one of the 2 shared blocks
_ZAMBA2_7B_RANK = 128
ZAMBA2_7B = HybridShape(
    name="Zamba2-7B-shaped",
    d_model=3584,
    vocab_size=32000,
    num_mamba_layers=81,
    num_attention_layers=_ZAMBA2_7B_OCCURRENCES,  # KV pages per occurrence
    num_mlp_blocks=_ZAMBA2_7B_OCCURRENCES,  # each occurrence runs its block's gated MLP
    mlp_intermediate=4 * 3584,
    mlp_matrices=3,
    separate_mlp_layers=False,
    mamba_d_state=64,
    mamba_headdim=64,  # 112 Mamba heads
    mamba_ngroups=2,
    mamba_expand=2,
    mamba_d_conv=4,
    num_heads=32,
    num_kv_heads=32,
    head_dim=224,  # 2·d_model / heads: the block attends over [h, embeddings]
    tie_embeddings=True,
    weight_bytes=2,
    state_bytes=4,
    source="assumed: dimensions as recalled from the published Zamba2-7B config (Zyphra/Zamba2-7B: 81 Mamba2 "
           "layers, 13 hybrid layers over 2 shared blocks, LoRA rank 128), not read from the file here",
    attention_weight_copies=2,
    mlp_weight_copies=2,
    attention_input_dim=2 * 3584,
    # per occurrence: its [d, d] linear, q/k/v adapters [2d -> r -> 2d] and the MLP adapter [d -> r -> 2·I]
    extra_params=_ZAMBA2_7B_OCCURRENCES * (3584 * 3584 + 3 * 2 * (2 * 3584 * _ZAMBA2_7B_RANK)
                                           + _ZAMBA2_7B_RANK * (3584 + 2 * 4 * 3584)),
    stack_layers=81,
)

QWEN3_NEXT_80B = HybridShape(
    name="Qwen3-Next-80B-A3B-shaped",
    d_model=2048,
    vocab_size=151936,
    num_mamba_layers=36,  # GDN layers: 12 × (3 GDN + 1 attention), each followed by its MoE
    num_attention_layers=12,
    num_mlp_blocks=0,  # no dense MLP (mlp_only_layers is empty): every layer's feed-forward is the MoE
    mlp_intermediate=0,
    mlp_matrices=3,
    separate_mlp_layers=False,
    gdn=GdnMixer(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, d_conv=4),
    num_heads=16,
    num_kv_heads=2,
    head_dim=256,
    attention_output_gate=True,
    tie_embeddings=False,
    weight_bytes=2,
    state_bytes=4,  # float32 GDN state, as Engine keeps it by default
    source="assumed: Qwen3-Next-80B-A3B-shaped, from its model card (48 layers, hidden 2048, 12 x (3 Gated DeltaNet "
           "+ 1 gated attention), attention 16 q / 2 KV heads of 256, GDN 16 qk / 32 v heads of 128, 512 experts "
           "top-10 + 1 shared of 512) and HF's Qwen3NextConfig defaults (conv 4, vocab 151936, shared expert 512), "
           "config.json not read here; uniform routing assumed for the experts a batch touches",
    num_moe_blocks=48,
    moe_num_experts=512,
    moe_top_k=10,
    moe_intermediate=512,
    moe_shared_intermediate=512,
    moe_matrices=3,  # SwiGLU experts: gate, up, down
)


def small_hybrid_draft(target: HybridShape) -> HybridShape:
    """A hypothetical ~0.43B hybrid drafter sharing the target's vocabulary
    (neither family publishes a drafter): 16 layers of width 1024, 14 Mamba2
    and 2 attention, each with a gated MLP, tied embeddings."""
    return HybridShape(
        name=f"draft-0.43B-hybrid ({target.name} vocab)",
        d_model=1024,
        vocab_size=target.vocab_size,
        num_mamba_layers=14,
        num_attention_layers=2,
        num_mlp_blocks=16,
        mlp_intermediate=4096,
        mlp_matrices=3,
        separate_mlp_layers=False,
        mamba_d_state=128,
        mamba_headdim=64,
        mamba_ngroups=1,
        mamba_expand=2,
        mamba_d_conv=4,
        num_heads=16,
        num_kv_heads=8,
        head_dim=64,
        tie_embeddings=True,
        weight_bytes=target.weight_bytes,
        state_bytes=target.state_bytes,
        source="assumed: hypothetical drafter shape, not a published model",
    )


# Acceptance priors (per-draft alpha of the i.i.d. model), from published figures where there are any.
# MTP: llama.cpp's Qwen3.6-35B-A3B MTP runtime card (fraQtl/Qwen3.6-35B-A3B-Hi-Fi-MTP-runtime, May 2026): 76.0%
# draft acceptance at n_max = 4, greedy, 50 chat prompts on an A100 -- a Qwen3.x MTP layer of the Qwen3-Next
# lineage; Qwen3-Next's own model card gives no acceptance figure. ik_llama.cpp PR 2369 reports 91-92% on code
# and 47% on stories at n_max = 3 for a Qwen MTP layer: the prior is a middle, task-dependent figure.
QWEN_MTP_PRIOR = prior_from_rate(0.76, 4, "published: 76.0% draft acceptance at 4 drafts, Qwen3.6-35B-A3B MTP in "
                                          "llama.cpp (greedy, chat prompts); a Qwen3.x MTP layer, not Qwen3-Next's")
# The Mamba2 families publish no MTP layer: a layer trained as tools/train_mtp.py trains one is assumed to reach
# the Qwen figure.
ASSUMED_MTP_PRIOR = dataclasses.replace(QWEN_MTP_PRIOR, source="assumed: no published MTP layer for this family; "
                                                                "the Qwen3.x MTP figure carried over")
# EAGLE-3: the paper's acceptance lengths (tau ~6.5 for LLaMA-3.1-8B, temperature 0) are for tree drafts of up to
# 8 levels, not a chain of gamma drafts. The chain figure here is vLLM's "Mean acceptance length: 2.67" at 5
# speculative tokens for Qwen3-8B with a published EAGLE-3 head (vllm-ascend issue 13665, one card).
EAGLE3_PRIOR = prior_from_length(2.67, 5, "published: mean acceptance length 2.67 at 5 drafts, Qwen3-8B with an "
                                          "EAGLE-3 head in vLLM (chain); carried over to this target: assumed")


@dataclass(frozen=True)
class Preset:
    """A target, its drafter and the accelerator they run on. `drafter` names
    the drafter's kind (`hybridspec.sim.drafters.DRAFTER_KINDS`); `prior` is
    the acceptance it is expected to reach, None where nothing is published."""

    name: str
    target: HybridShape
    draft: HybridShape
    hardware: Hardware
    all_reduce: Optional[AllReduceLink] = None  # the target tensor-parallel over `hardware`'s ranks
    drafter: str = "model"
    prior: Optional[AcceptancePrior] = None

    def cost_model(self, context_len: int = 4096) -> CostModel:
        return CostModel(
            hardware=self.hardware,
            target=self.target.model_cost(),
            draft=self.draft.model_cost(),
            context_len=context_len,
            all_reduce=self.all_reduce,
            # MTP and EAGLE-3 run at the target's tensor-parallel size (MTP shares its sharded LM head)
            draft_sharded=self.drafter != "model",
        )


def drafted(preset: Preset, kind: str) -> Preset:
    """`preset` with a drafter of `kind`, named '<preset>+<kind>'; 'model' gives
    `preset` itself (its separate draft model)."""
    if check_drafter_kind(kind) == "model":
        return preset
    target = preset.target
    if kind == "mtp":
        draft = mtp_draft(target)
        prior = QWEN_MTP_PRIOR if target.gdn is not None else ASSUMED_MTP_PRIOR
    else:
        draft, prior = eagle3_draft(target), EAGLE3_PRIOR
    return dataclasses.replace(preset, name=f"{preset.name}+{kind}", draft=draft, drafter=kind, prior=prior)


PRESETS = {
    "bamba-9b": Preset("bamba-9b", BAMBA_9B, small_hybrid_draft(BAMBA_9B), H200),
    "nemotron-h-8b": Preset("nemotron-h-8b", NEMOTRON_H_8B, small_hybrid_draft(NEMOTRON_H_8B), H200),
    "nemotron-3-nano-30b-a3b": Preset("nemotron-3-nano-30b-a3b", NEMOTRON_3_NANO_30B,
                                      small_hybrid_draft(NEMOTRON_3_NANO_30B), H200),
    "falcon-h1-7b": Preset("falcon-h1-7b", FALCON_H1_7B, small_hybrid_draft(FALCON_H1_7B), H200),
    "zamba2-7b": Preset("zamba2-7b", ZAMBA2_7B, small_hybrid_draft(ZAMBA2_7B), H200),
    "qwen3-next-80b-a3b": Preset("qwen3-next-80b-a3b", QWEN3_NEXT_80B, small_hybrid_draft(QWEN3_NEXT_80B), H200_X2),
    # the projection: the target tensor-parallel over 8 H200s, its all-reduces charged
    "qwen3-next-80b-a3b-tp8": Preset("qwen3-next-80b-a3b-tp8", QWEN3_NEXT_80B, small_hybrid_draft(QWEN3_NEXT_80B),
                                     H200_X8, NVLINK_H200_X8),
}
