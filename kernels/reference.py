"""Torch forms that every backend shares and the runtime calls outside the op
objects: the verification modes (the rows' codes of the ``rejection`` op,
``kernels/triton/rejection.py``) with the all-greedy accept on the host, and a
sequence's pages gathered out of a paged K/V cache. They import only torch;
the Triton files import them back."""

import torch

MODE_GREEDY = 0
MODE_REJECTION = 1
MODE_COUPLED = 2


def greedy_accept(
    target_probs: torch.Tensor,  # [B, G + 1, V] float32/float64
    drafts: list[list[int]],  # [B][γ_b] d_1..d_γ_b of each row, γ_b <= G
) -> tuple[list[list[int]], list[int]]:
    """MODE_GREEDY for a batch whose every row is greedy, on the host: the
    output_tokens and num_accepted of ``rejection`` as lists, from one argmax
    and one readback (the kernels' argument checks and float64 copies are what
    a greedy round would otherwise pay for). argmax takes the lowest index on
    ties, in any dtype, as the kernels do."""
    if target_probs.dim() != 3 or len(drafts) != target_probs.shape[0] \
            or any(len(d) >= target_probs.shape[1] for d in drafts):
        raise ValueError(f"greedy_accept: {len(drafts)} rows of up to {max(map(len, drafts), default=0)} drafts "
                         f"do not fit target_probs of shape {tuple(target_probs.shape)} ([B, G + 1, V])")
    width = target_probs.shape[1]
    tokens, accepted = [], []
    for d, target in zip(drafts, target_probs.argmax(dim=2).tolist()):
        n = 0
        while n < len(d) and d[n] == target[n]:
            n += 1
        tokens.append(d[:n] + [target[n]] + [-1] * (width - n - 1))
        accepted.append(n)
    return tokens, accepted


def gather_pages(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, max_blocks], padded with -1
    context_lens: torch.Tensor,  # [batch]
) -> torch.Tensor:  # [batch, max(context_lens), num_kv_heads, head_dim], zeros past context_lens
    """Copy each row's first context_lens[b] entries out of its pages, in position order."""
    block_size = cache.shape[1]
    max_context = int(context_lens.max()) if context_lens.numel() else 0
    if max_context > block_tables.shape[1] * block_size:
        raise ValueError(
            f"context length {max_context} needs more than the {block_tables.shape[1]} pages in block_tables"
        )
    pos = torch.arange(max_context, device=cache.device)  # [max_context]
    pages = block_tables.long()[:, pos // block_size]  # [batch, max_context]
    is_valid = pos[None, :] < context_lens[:, None]  # [batch, max_context]
    slots = torch.where(is_valid, pages * block_size + pos % block_size, 0)  # [batch, max_context]
    flat = cache.reshape(-1, *cache.shape[2:])  # [num_blocks * block_size, num_kv_heads, head_dim]
    return flat[slots].masked_fill(~is_valid[:, :, None, None], 0)
