"""Tensor names and layouts: hybridspec's canonical names (`adapters.validate.expected_tensors`)
<-> the names and shapes llama.cpp's converter writes (`gguf.constants.TENSOR_NAMES`).

Layouts llama.cpp changes (shapes in torch order, the reverse of GGUF's ne):
    Mamba-2 A_log [n]          -> ssm_a = -exp(A_log) [n, 1]
    D [n]                      -> ssm_d [n, 1]
    conv1d.weight [C, 1, k]    -> ssm_conv1d [C, k]
    norm.weight [n·p]          -> ssm_norm [g, n·p / g] (the gated norm's groups)
    Mamba-1 conv1d [d, 1, k]   -> ssm_conv1d [d, k]; A_log [d, N] -> ssm_a [d, N]
    experts.gate_up_proj [E, 2·I, H] -> ffn_gate_exps [E, I, H] and ffn_up_exps [E, I, H]
    A_log (every SSM)          -> ssm_a = -exp(A_log)
    Qwen's zero-centred norms w -> 1 + w (the reader keeps it and multiplies by it as it is)
    a gated DeltaNet's in_proj  -> its parts, value heads reordered (`gdn`)
    Falcon-H1's µP multipliers  -> folded into the weights (`Arch.fold`, `falcon_h1_meta`); a parallel
                                   mixer's `mixer.attention.*` and `mixer.mamba.*` take the names of
                                   the attention and Mamba-2 tensors (one set of names per block)
Reading A back, A_log is the float32 whose -exp is A exactly (as the model computes it), found
among the neighbours of log(-A): a file hybridspec wrote gives back a model with the same decay.
"""
from __future__ import annotations

import re

import torch

from hybridspec.config import HybridConfig
from hybridspec.adapters.gguf import gdn

GLOBAL = {"embed_tokens.weight": "token_embd.weight", "final_norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
# canonical name under layers.{i}. -> GGUF name under blk.{i}.
LAYER = {
    "input_norm.weight": "attn_norm.weight",
    **{f"mixer.{p}_proj.{kind}": f"attn_{g}.{kind}" for p, g in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                   ("o", "output")) for kind in ("weight", "bias")},
    "mixer.q_norm.weight": "attn_q_norm.weight", "mixer.k_norm.weight": "attn_k_norm.weight",
    "mixer.in_proj.weight": "ssm_in.weight", "mixer.in_proj.bias": "ssm_in.bias",
    "mixer.conv1d.weight": "ssm_conv1d.weight", "mixer.conv1d.bias": "ssm_conv1d.bias",
    "mixer.dt_bias": "ssm_dt.bias", "mixer.A_log": "ssm_a", "mixer.D": "ssm_d",
    "mixer.norm.weight": "ssm_norm.weight",
    "mixer.x_proj.weight": "ssm_x.weight", "mixer.dt_proj.weight": "ssm_dt.weight",
    "mixer.dt_proj.bias": "ssm_dt.bias", "mixer.dt_norm.weight": "ssm_dt_norm.weight",
    "mixer.b_norm.weight": "ssm_b_norm.weight", "mixer.c_norm.weight": "ssm_c_norm.weight",
    "mixer.out_proj.weight": "ssm_out.weight", "mixer.out_proj.bias": "ssm_out.bias",
    **{f"ffn.{p}_proj.{kind}": f"ffn_{p}.{kind}" for p in ("gate", "up", "down") for kind in ("weight", "bias")},
    **{f"ffn.shared.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")},
    "ffn.router.weight": "ffn_gate_inp.weight", "ffn.shared_gate.weight": "ffn_gate_inp_shexp.weight",
    "ffn.router.e_score_correction_bias": "exp_probs_b.bias",
    "ffn.experts.up_proj": "ffn_up_exps.weight", "ffn.experts.down_proj": "ffn_down_exps.weight",
}
GATE_UP = "ffn.experts.gate_up_proj"  # two GGUF tensors: ffn_gate_exps, ffn_up_exps
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")
_PARALLEL = re.compile(r"^mixer\.(?:attention|mamba)\.")


def gguf_names(name: str, arch, config: HybridConfig) -> tuple[str, ...]:
    """The GGUF tensor(s) holding the canonical tensor `name` in `arch`'s layout (several for experts'
    gate_up_proj and a gated DeltaNet's in_proj); () where llama.cpp has no name for it."""
    if name in GLOBAL:
        return (GLOBAL[name],)
    match = _LAYER_NAME.match(name)
    if match is None:
        return ()
    layer, rest = match.group(1), _rest(name)
    if rest == GATE_UP:
        return (f"blk.{layer}.ffn_gate_exps.weight", f"blk.{layer}.ffn_up_exps.weight")
    if rest == "ffn_norm.weight":
        return (f"blk.{layer}.{arch.norm_of_ffn}",)
    if rest == "mixer.in_proj.weight" and config.gdn is not None:
        return tuple(f"blk.{layer}.{part}" for part in gdn.in_proj_parts(config, arch.name))
    return (f"blk.{layer}.{LAYER[rest]}",) if rest in LAYER else ()


def _rest(name: str) -> str:
    """The name under layers.N. (a parallel mixer's parts as plain mixer tensors), or a global name."""
    match = _LAYER_NAME.match(name)
    return _PARALLEL.sub("mixer.", match.group(2)) if match else name


def stored_shapes(name: str, shape: tuple[int, ...], config: HybridConfig, arch) -> tuple[tuple[int, ...], ...]:
    """The torch-order shape(s) of `gguf_names(name)` for a canonical tensor of `shape`."""
    rest = _rest(name)
    if rest in ("mixer.A_log", "mixer.D") and config.mamba2 is not None:
        return ((shape[0], 1),)
    if rest == "mixer.conv1d.weight":
        return ((shape[0], shape[2]),)
    if rest == "mixer.norm.weight" and config.mamba2 is not None:
        groups = config.mamba2.n_groups
        return ((groups, shape[0] // groups),)
    if rest == GATE_UP:
        half = (shape[0], shape[1] // 2, shape[2])
        return (half, half)
    if rest == "mixer.in_proj.weight" and config.gdn is not None:
        return tuple((len(rows), shape[1]) for rows in gdn.in_proj_parts(config, arch.name).values())
    return (shape,)


def zero_centred(name: str, config: HybridConfig) -> bool:
    """Whether `name` is a norm llama.cpp stores as 1 + w (Qwen's zero-centred norms; not the GDN's gated
    norm): its converter adds the 1, so a file holds the weight the model multiplies by."""
    return config.zero_centred_norms and _rest(name) in ZERO_CENTRED


ZERO_CENTRED = ("final_norm.weight", "input_norm.weight", "ffn_norm.weight", "mixer.q_norm.weight",
                "mixer.k_norm.weight")


def to_stored(name: str, tensor: torch.Tensor, config: HybridConfig, arch) -> tuple[torch.Tensor, ...]:
    """The canonical tensor as llama.cpp stores it (see the module)."""
    from hybridspec.models.common import norm_weight
    rest = _rest(name)
    if rest == GATE_UP:
        return tuple(tensor.chunk(2, dim=1))
    if rest == "mixer.in_proj.weight" and config.gdn is not None:
        return tuple(tensor[rows] for rows in gdn.in_proj_parts(config, arch.name).values())
    shapes = stored_shapes(name, tuple(tensor.shape), config, arch)
    if rest == "mixer.A_log":
        tensor = -torch.exp(tensor.float())
    if zero_centred(name, config):
        tensor = norm_weight(tensor, True)
    if arch.fold is not None:
        tensor = arch.fold(rest, tensor, config)
    rows, columns = gdn.row_map(rest, config, arch.name), gdn.column_map(rest, config, arch.name)
    if rows is not None:
        tensor = tensor[rows]
    if columns is not None:
        tensor = tensor[:, columns]
    return (tensor.reshape(shapes[0]),)


def from_stored(name: str, parts: list[torch.Tensor], shape: tuple[int, ...], config: HybridConfig,
                arch) -> torch.Tensor:
    """to_stored's inverse: the canonical tensor of `shape` from its stored part(s) (a zero-centred norm
    stays 1 + w: the reader's config multiplies by it as it is)."""
    rest = _rest(name)
    if rest == GATE_UP:
        return torch.cat(parts, dim=1)
    if rest == "mixer.in_proj.weight" and config.gdn is not None:
        order = torch.cat(list(gdn.in_proj_parts(config, arch.name).values()))
        return torch.cat(parts)[gdn.inverse(order)]
    tensor = parts[0]
    if rest == "mixer.A_log":
        tensor = a_log_of(tensor.reshape(-1))
    rows, columns = gdn.row_map(rest, config, arch.name), gdn.column_map(rest, config, arch.name)
    tensor = tensor.reshape(shape) if rows is None else tensor.reshape(shape[0], -1)[gdn.inverse(rows)]
    if columns is not None:
        tensor = tensor[:, gdn.inverse(columns)]
    return tensor.reshape(shape).contiguous()


def columns_moved(name: str, config: HybridConfig, arch) -> bool:
    """Whether llama.cpp stores the product weight `name` with its input columns reordered: its
    quantized blocks are not the canonical tensor's, so it is read as float."""
    return gdn.column_map(_rest(name), config, arch.name) is not None


def block_rows(name: str, config: HybridConfig, arch) -> torch.Tensor | None:
    """The canonical rows of a product weight stored in several GGUF tensors, in stored order (their
    quantized blocks concatenate and reorder into the canonical blocks); None for one stored whole."""
    rest = _rest(name)
    if rest == "mixer.in_proj.weight" and config.gdn is not None:
        return torch.cat(list(gdn.in_proj_parts(config, arch.name).values()))
    return None


def a_log_of(a: torch.Tensor) -> torch.Tensor:
    """The float32 A_log [n] whose -exp is `a` [n] exactly where a neighbour of log(-a) has it, else log(-a)."""
    a = a.float()
    guess = torch.log(-a.double()).float()
    best = guess.clone()
    for step in (0, 1, -1, 2, -2):
        candidate = guess
        for _ in range(abs(step)):
            candidate = torch.nextafter(candidate, torch.full_like(candidate, step * float("inf")))
        hit = (-torch.exp(candidate) == a) & (-torch.exp(best) != a)
        best = torch.where(hit, candidate, best)
    return best


_QUANTIZABLE = re.compile(r"^layers\.\d+\.(?:mixer|mixer\.attention|mixer\.mamba|ffn|ffn\.shared)\."
                          r"(?:q|k|v|o|gate|up|down|in|out)_proj\.weight$")


def quantizable(name: str) -> bool:
    """Whether the canonical tensor `name` is a product weight `HybridModel.quantize` quantizes (the
    decoder layers' linear weights, `models.quantizing.QUANTIZED`) or the LM head."""
    return name == "lm_head.weight" or _QUANTIZABLE.match(name) is not None


def kept_quantized(name: str) -> bool:
    """Whether the reader keeps the canonical tensor `name` as its blocks where the file stores it in a
    format hybridspec multiplies: a product weight (`quantizable`) or the token embedding (its lookup
    dequantizes only the rows it reads, `QuantWeight.rows`)."""
    return name == "embed_tokens.weight" or quantizable(name)
