"""How a model's weights lie for its device's products (`HybridModel.pack_for_cpu`
says what and why): the linear weights in panels or input-major, in one
mapping of huge pages on CPU, stored bf16 weights' values kept in 16 bits where
that is exact and the native kernels read them; and the way back (`unpack_panels`,
`widen_16bit`) when a model moves to a device or backend that reads neither."""
from __future__ import annotations

import torch
from torch import nn

from hybridspec.kernels import huge_pages
from hybridspec.kernels.cpu import panels
from hybridspec.kernels.cpu.panels import PanelWeight
from hybridspec.kernels.quant.weight import QuantWeight

from hybridspec.models.common import param
from hybridspec.models.ffn import MoE


# the 2-d weights the layers multiply through `linear` (pack_for_cpu lays them out in panels or input-major)
LINEAR_WEIGHTS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj", "down_proj", "in_proj",
                            "out_proj", "x_proj", "dt_proj", "lm_head"})


HALF_DTYPES = (torch.bfloat16, torch.float16)  # what pack_for_cpu may keep weights in under float32 compute


def storable_16bit(name: str) -> bool:
    """Whether a canonical weight name is one `pack_for_cpu` may keep in bfloat16
    or float16 under float32 compute (a linear weight, a MoE's router or expert stack,
    the embedding), so that `load` need not widen it first; pack_for_cpu widens
    whatever else a float32 model holds in 16 bits."""
    parts = name.split(".")
    return (name == "embed_tokens.weight" or name.endswith(("experts.gate_up_proj", "experts.up_proj",
                                                             "experts.down_proj", "router.weight"))
            or (len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEAR_WEIGHTS))


def exact_in(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a float32 weight's every value is a `dtype` value (weights stored in it, widened)."""
    if weight.dtype is not torch.float32:
        return False
    with torch.no_grad():
        head = weight[:1]  # a view: a float32-trained weight fails on it without all of it converted
        return bool(torch.equal(head, head.to(dtype).to(torch.float32))
                    and torch.equal(weight, weight.to(dtype).to(torch.float32)))


def pack(model, exact_16bit: bool = True) -> None:
    """`HybridModel.pack_for_cpu`'s work on `model`: each product weight laid out, stored and rebound."""
    def key(weight):  # one tensor's memory, a view of another included
        return weight.data_ptr(), tuple(weight.shape), weight.stride()

    def products(module, name: str, weight) -> bool:  # a linear weight, a MoE's router or stack of experts'
        if isinstance(weight, QuantWeight):  # GGUF blocks: never transposed or panelled (lay_out_quantized moves them)
            return False
        return ((name in LINEAR_WEIGHTS and (weight.dim() == 2 or isinstance(weight, PanelWeight)))
                or (isinstance(module, MoE) and name in ("up", "down") and weight.dim() == 3)
                or routes(module, name, weight))

    def routes(module, name: str, weight) -> bool:  # a MoE's router: laid out like the others, never rounded
        return isinstance(module, MoE) and name == "router" and (weight.dim() == 2 or isinstance(weight, PanelWeight))

    elsewhere = {key(weight) for module in model.modules()  # weights some other parameter also is
                 for name, weight in module.named_parameters(recurse=False, remove_duplicate=False)
                 if not products(module, name, weight) and name != "embed" and not isinstance(weight, QuantWeight)}
    routers = {key(weight) for module in model.modules()  # bfloat16 compute keeps their products exact
               for name, weight in module.named_parameters(recurse=False, remove_duplicate=False)
               if routes(module, name, weight)}
    float32 = model.dtype is torch.float32
    panels_here = float32 and model.backend.reads_panels

    # 16 bits only where the native kernels run: torch's products widen a copy per call, which makes
    # a decode step with the kernels off slower than from float32
    exact_16bit = exact_16bit and float32 and model.backend.reads_16bit_weights

    rounded = float32 and model.compute is torch.bfloat16  # the products multiply bfloat16 weights

    def storage(k, weight, product: bool = True) -> torch.dtype:
        """The dtype of the weight whose key is k and values [out, in] `weight`: bfloat16, else
        float16, where that is exact and allowed (a product weight: bfloat16 under bfloat16
        compute); a 16-bit weight of a float32 model (`load`'s) else widened; any other as it is."""
        if rounded and k in routers:  # a 16-bit router would multiply rounded activations
            return torch.float32
        if rounded and product and k not in elsewhere:
            return torch.bfloat16
        if exact_16bit and k not in elsewhere:
            for half in HALF_DTYPES:
                if weight.dtype is half or exact_in(weight, half):
                    return half
        return torch.float32 if float32 and weight.dtype in HALF_DTYPES else weight.dtype

    values: dict[tuple, torch.Tensor] = {}  # each product weight once, by key: its values (a packed one unpacked)
    for module in model.modules():
        for name, weight in module.named_parameters(recurse=False, remove_duplicate=False):
            if products(module, name, weight) and key(weight) not in values:
                values[key(weight)] = panels.unpack(weight) if isinstance(weight, PanelWeight) else weight.detach()
    dtypes = {k: storage(k, weight) for k, weight in values.items()}

    def shape(weight, dtype) -> tuple[int, ...]:  # panels (a 2-d weight where they are read), or [..., in, out]
        if panels_here and weight.dim() == 2:
            return panels.panel_shape(*weight.shape, dtype)
        return (*weight.shape[:-2], weight.shape[-1], weight.shape[-2])

    # on CPU side by side in huge pages (a packed weight moves too: the memory it shares with the
    # others is then released)
    stores = huge_pages.zeros([(shape(weight, dtypes[k]), dtypes[k]) for k, weight in values.items()], model.device)
    packed: dict[tuple, nn.Parameter] = {}
    for (k, weight), stored in zip(values.items(), stores):  # rounds as `.to` does where the dtype narrows
        if panels_here and weight.dim() == 2:
            packed[k] = panels.pack(weight, stored)
        else:
            stored.copy_(weight.transpose(-1, -2))
            packed[k] = param(stored.transpose(-1, -2))
    for module in model.modules():  # the product weights, and those tied to one (an embedding to lm_head)
        for name, weight in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if key(weight) in packed:
                setattr(module, name, packed[key(weight)])
    embed = model.embed  # untied: stays [vocab, hidden], rows contiguous for the lookup
    if key(embed) not in packed and (dtype := storage(key(embed), embed, product=False)) is not embed.dtype:
        model.embed = param(embed.detach().to(dtype))
    if float32:  # anything else `load` left in 16 bits takes the float32 model's own dtype
        widen_16bit(model, keep=lambda module, name, weight: (products(module, name, weight)
                                                              or key(weight) == key(model.embed)))
    lay_out_quantized(model)
    model.bind_backend(model.backend_name)  # the kernels' weight pointers name the old tensors


def lay_out_quantized(model) -> None:
    """Every quantized weight moved into one mapping of huge pages on CPU (a decode step streams the
    products' blocks as it does float weights: `kernels/huge_pages.py`), then each product weight laid
    out as the backend's products read it fastest (`Linear.quant_layout`: Q4_K interleaved,
    the same bytes in another order), but the embedding and a weight tied to it (the
    lookup reads its rows as GGUF lays them). A weight several modules hold (a shared block, a tied
    head) stays one. Weights move one at a time, each old copy released once every holder has the new
    one, so a load holds little more than the blocks once. The caller rebinds the backend."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}  # each weight once, by id: where it is held
    for module in model.modules():
        for name, weight in module.named_parameters(recurse=False, remove_duplicate=False):
            if isinstance(weight, QuantWeight):
                holders.setdefault(id(weight), []).append((module, name))
    if not holders:
        return
    embed = model.embed.data_ptr()
    model.release_bindings()
    shapes = [tuple(getattr(*places[0]).shape) for places in holders.values()]
    for places, stored in zip(holders.values(), huge_pages.zeros([(s, torch.uint8) for s in shapes], model.device)):
        weight = getattr(*places[0])
        with torch.no_grad():
            stored.copy_(weight.detach())
        moved = QuantWeight(stored, weight.fmt, weight.out_features, weight.in_features, weight.interleaved)
        if weight.data_ptr() != embed:
            moved = model.backend.linear.quant_layout(moved)
        del weight  # the holders are the last to hold it: the old blocks go as they are replaced
        for module, name in places:
            setattr(module, name, moved)


def widen_16bit(model, keep=lambda module, name, weight: False) -> None:
    """Each 16-bit parameter widened to float32 (a packed one unpacked to [out, in]), but
    those `keep` names (a Parameter tied to several names stays one)."""
    replace(model, lambda module, name, weight: weight.dtype in HALF_DTYPES and not keep(module, name, weight),
            lambda weight: (panels.unpack(weight, torch.float32) if isinstance(weight, PanelWeight)
                            else weight.detach().to(torch.float32)))


def unpack_panels(model) -> bool:
    """Each `PanelWeight` back to a plain [out, in] Parameter in its dtype; whether there was one."""
    return replace(model, lambda module, name, weight: isinstance(weight, PanelWeight), panels.unpack)


def replace(model, which, new) -> bool:
    """Each parameter `which(module, name, weight)` names replaced by param(new(weight)), once per
    Parameter (tied names stay tied); whether any was."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, weight in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if which(module, name, weight):
                if id(weight) not in replaced:
                    replaced[id(weight)] = param(new(weight))
                setattr(module, name, replaced[id(weight)])
    return bool(replaced)


def has_16bit(model) -> bool:
    """Whether any of `model`'s parameters is bfloat16 or float16."""
    return any(weight.dtype in HALF_DTYPES for weight in model.parameters())
