"""Product weights laid out in panels, the layout the CPU products stream fastest (`cpu/panels.c`).

A weight [out, in] multiplies as w [K = in, N = out]. In panels its N columns are cut into
PANEL-column panels, each holding all K rows of its columns contiguously, the panels one after
another; bfloat16 keeps rows 2j and 2j + 1 side by side in each 32-bit lane (`pair_rows`), which is
what AVX512-BF16's dot product takes and what a shift and a mask widen. A decode step then reads
each panel as one sequential stream and keeps its sums in registers over all of K, where the
input-major layout reads a dozen rows far apart and loads and stores the sums every few: faster
at one row, most of all for bfloat16 and for a verify's few rows (docs/results/llamacpp.md,
"Panels"). The bits are those of the input-major products.

No strided view of [out, in] lies in panels, so a packed weight is its own Parameter type,
`PanelWeight`: data [panels, rows, PANEL · R] (zero past K and N) and the logical `out_features`,
`in_features`. `HybridModel.pack_for_cpu` makes them where the backend's products read panels
(`Backend.reads_panels`); the product kernels read them (`cpu_rows.rows_matmul`, the HS_PANELS
address tag), `matmul` multiplies by one with torch where the kernels do not, `rows` looks up an
embedding tied to one, `unpack` gives the values back as [out, in].
"""
from __future__ import annotations

import torch
from torch import nn

PANEL = 64  # columns per panel (cpu/panels.c; a thread's share of a product is whole panels)


def pair_rows(dtype: torch.dtype) -> int:
    """R, the weight rows a panel row holds side by side: 2 for bfloat16, else 1."""
    return 2 if dtype is torch.bfloat16 else 1


def panel_shape(out_features: int, in_features: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """The data's shape: [panels, ceil(in / R), PANEL · R]."""
    r = pair_rows(dtype)
    return -(-out_features // PANEL), -(-in_features // r), PANEL * r


class PanelWeight(nn.Parameter):
    """A frozen product weight [out_features, in_features] whose data lies in panels (see the module)."""

    def __new__(cls, data: torch.Tensor, out_features: int, in_features: int) -> "PanelWeight":
        if tuple(data.shape) != panel_shape(out_features, in_features, data.dtype):
            raise ValueError(f"PanelWeight: data {tuple(data.shape)} is not the panels of [{out_features}, "
                             f"{in_features}] in {data.dtype}: {panel_shape(out_features, in_features, data.dtype)}")
        weight = super().__new__(cls, data, requires_grad=False)
        weight.out_features, weight.in_features = out_features, in_features
        return weight

    def __deepcopy__(self, memo) -> "PanelWeight":
        if id(self) not in memo:
            memo[id(self)] = PanelWeight(self.data.clone(), self.out_features, self.in_features)
        return memo[id(self)]

    def __reduce_ex__(self, protocol):
        return PanelWeight, (self.data, self.out_features, self.in_features)

    def __repr__(self) -> str:
        return f"PanelWeight([{self.out_features}, {self.in_features}], dtype={self.dtype}, panels={self.shape[0]})"


def out_features(weight: torch.Tensor) -> int:
    """A product weight's output size, packed in panels or [out, in]."""
    return weight.out_features if isinstance(weight, PanelWeight) else weight.shape[0]


def pack(weight: torch.Tensor, into: torch.Tensor) -> PanelWeight:
    """weight [out, in] (any float dtype; rounded as `.to` rounds where `into` is narrower) written into
    `into`, zeroed memory of `panel_shape(out, in, into.dtype)`."""
    out_features, in_features = weight.shape
    panels, rows, width = into.shape
    r = width // PANEL
    with torch.no_grad():
        # into[p, j, c·R + h] = weight[p·PANEL + c, j·R + h]
        padded = into.new_zeros(panels * PANEL, rows * r)
        padded[:out_features, :in_features] = weight
        into.copy_(padded.view(panels, PANEL, rows, r).permute(0, 2, 1, 3).reshape(panels, rows, width))
    return PanelWeight(into, out_features, in_features)


def unpack(weight: PanelWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The values [out, in] (contiguous; in `dtype`, exact where it is wider)."""
    panels, rows, width = weight.shape
    r = width // PANEL
    data = weight.detach() if dtype is None else weight.detach().to(dtype)
    full = data.view(panels, rows, PANEL, r).permute(0, 2, 1, 3).reshape(panels * PANEL, rows * r)
    return full[:weight.out_features, :weight.in_features].contiguous()


# rows up to which torch multiplies panel by panel (no copy of a float32 weight); past them MKL packs
# x once per panel, which costs more than unpacking the weight (docs/results/llamacpp.md, "Panels")
PANELWISE_MAX_ROWS = 256


def matmul(x: torch.Tensor, weight: PanelWeight) -> torch.Tensor:
    """x [M, K] @ the values' transpose by torch: [M, N]; up to PANELWISE_MAX_ROWS rows panel by
    panel (16-bit panels widened to x's dtype, bfloat16's row pairs split), else on the unpacked
    weight."""
    if x.shape[0] > PANELWISE_MAX_ROWS:
        return x @ unpack_t(weight, x.dtype)
    panels_, rows, width = weight.shape
    data = weight.detach()
    if width != PANEL:  # [panels, rows, PANEL, 2] -> [panels, 2 · rows, PANEL]
        data = data.view(panels_, rows, PANEL, 2).transpose(2, 3).reshape(panels_, 2 * rows, PANEL)
    data = data[:, :weight.in_features]
    out = torch.matmul(x, data if data.dtype is x.dtype else data.to(x.dtype))  # [panels, M, PANEL]
    return out.transpose(0, 1).reshape(x.shape[0], panels_ * PANEL)[:, :weight.out_features]


def unpack_t(weight: PanelWeight, dtype: torch.dtype) -> torch.Tensor:
    """The values as [in, out] contiguous in `dtype`: what torch's product reads fastest."""
    panels, rows, width = weight.shape
    r = width // PANEL
    data = weight.detach().view(panels, rows, PANEL, r).permute(1, 3, 0, 2).reshape(rows * r, panels * PANEL)
    return data[:weight.in_features, :weight.out_features].to(dtype, memory_format=torch.contiguous_format)


def rows(weight: PanelWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [n] of the values [out, in] (an embedding tied to a packed LM head): [n, in]."""
    panels, per_panel, width = weight.shape
    r = width // PANEL
    # index pairs split by a slice: their dimension comes first, [n, rows, R]
    gathered = weight.detach().view(panels, per_panel, PANEL, r)[ids // PANEL, :, ids % PANEL, :]
    return gathered.reshape(len(ids), per_panel * r)[:, :weight.in_features]
