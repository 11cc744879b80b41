"""Verification of drafts: the accept test, the recovered token and the bonus token.

One row b of a batch verifies γ_b = num_draft[b] drafts d_1..d_γ_b. Its pending
token sits at absolute position m - 1 and ``positions[b] = m`` is the absolute
position of d_1, so d_i and the token sampled from p_i sit at position
``positions[b] + i - 1`` (1-based i; ``positions[b] + j`` for 0-based j).
p_1..p_{γ_b + 1} are the target's post-processed distributions (p_i predicts
the token at that position; p_{γ_b + 1} lies at index γ_b), q_1..q_γ_b the
drafter's. ``draft_probs=None`` says every q_i is one-hot at d_i (a drafter
without probabilities: prompt lookup, a deterministic user drafter); no
[B, G, V] tensor is built for it: q_i(d_i) = 1 and max(0, p_i − q_i) is p_i
with d_i removed.

Terms (docs/design.md glossary):
    accepted   drafts the verifier kept: d_1..d_n, n = num_accepted[b] in 0..γ_b
    recovered  the token emitted at the first rejection, position positions[b] + n
    bonus      the token emitted when all γ_b drafts were accepted, sampled from
               p_{γ_b + 1} at position positions[b] + γ_b
    emitted    accepted + 1 (recovered or bonus): output_tokens[b, :n + 1];
               output_tokens[b, n + 1:] is -1 padding

Modes (``row_mode[b]``, the ``MODE_*`` of ``kernels/reference.py``), mixed freely in one launch:
    MODE_GREEDY     accept while d_i == argmax p_i (lowest index on ties); emit
                    argmax p_{n+1} (the mismatch's target, or the bonus).
    MODE_REJECTION  Leviathan et al. 2023, Alg. 1 / Chen et al. 2023, Alg. 2:
                    accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), as
                    ``q_i(d_i) > 0 and u_i · q_i(d_i) < p_i(d_i)`` with
                    u_i = keyed_uniform(seed, positions[b] + i - 1, PURPOSE_ACCEPT);
                    a draft the drafter could not have sampled (q_i(d_i) = 0) is
                    rejected. The recovered token samples
                    norm(max(0, p_i - q_i)) by Gumbel-max with PURPOSE_RECOVER
                    noise (Gumbel-max needs no normalisation); if the residual
                    sums to at most 1e-12 · sum(p_i) it samples p_i instead. The
                    bonus samples p_{γ_b + 1} with PURPOSE_SAMPLE noise.
    MODE_COUPLED    t_i = Gumbel-max sample of p_i with PURPOSE_SAMPLE noise at
                    position positions[b] + i - 1, the token plain decoding with
                    the same seed would emit there; accept while d_i == t_i and
                    emit t_{n+1}. q is not read.

All arithmetic is float64 (inputs float32 or float64 are upcast), so the
kernel and ``rejection_ref`` agree token for token.
"""

import torch

from hybridspec.kernels.keyed_random import PURPOSE_ACCEPT, PURPOSE_RECOVER, PURPOSE_SAMPLE, keyed_gumbel, keyed_uniform
from hybridspec.kernels.reference import MODE_COUPLED, MODE_GREEDY, MODE_REJECTION
from hybridspec.kernels.triton.keyed_random import gumbel_dev, row_key_dev, uniform_dev
from hybridspec.kernels.triton.triton_import import tl, triton

RESIDUAL_EPS = 1e-12  # residual mass below RESIDUAL_EPS · sum(p_i) counts as zero
_MAX_BLOCK_V = 1024


# ----------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------


@triton.jit
def _argmax_over_vocab(
    p_ptr, q_ptr, draft_token, V, seed, position, PICK: tl.constexpr, HAS_Q: tl.constexpr, EPS: tl.constexpr,
    BLOCK_V: tl.constexpr
):
    """One pass over the vocabulary of one distribution; returns a token id.

    PICK 0: argmax p (lowest index on ties).
    PICK 1: Gumbel-max sample of p, PURPOSE_SAMPLE noise at ``position``.
    PICK 2: Gumbel-max sample of max(0, p - q), PURPOSE_RECOVER noise, falling
            back to p (same noise) when the residual sums to at most EPS · sum(p);
            without HAS_Q, q is one-hot at ``draft_token``.
    """
    if PICK == 2:
        key_a, key_b = row_key_dev(seed, position, 2)  # PURPOSE_RECOVER
    else:
        key_a, key_b = row_key_dev(seed, position, 0)  # PURPOSE_SAMPLE
    best_p = tl.full((), float("-inf"), tl.float64)
    token_p = tl.zeros((), dtype=tl.int32)
    best_r = best_p
    token_r = token_p
    sum_p = tl.zeros((), dtype=tl.float64)
    sum_r = tl.zeros((), dtype=tl.float64)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        in_vocab = offs < V
        p = tl.load(p_ptr + offs, mask=in_vocab, other=0.0).to(tl.float64)
        if PICK == 0:
            score_p = tl.where(in_vocab, p, -float("inf"))
        else:
            noise = gumbel_dev(key_a, key_b, offs)
            score_p = tl.where(in_vocab, tl.log(p) + noise, -float("inf"))
            if PICK == 2:
                if HAS_Q:
                    q = tl.load(q_ptr + offs, mask=in_vocab, other=0.0).to(tl.float64)
                else:
                    q = tl.where(offs == draft_token, 1.0, 0.0).to(tl.float64)
                r = tl.maximum(p - q, 0.0)
                sum_p += tl.sum(p, axis=0)
                sum_r += tl.sum(r, axis=0)
                score_r = tl.where(in_vocab, tl.log(r) + noise, -float("inf"))
                block_best_r = tl.max(score_r, axis=0)
                block_token_r = tl.argmax(score_r, axis=0, tie_break_left=True) + start
                token_r = tl.where(block_best_r > best_r, block_token_r, token_r)
                best_r = tl.maximum(block_best_r, best_r)
        block_best_p = tl.max(score_p, axis=0)
        block_token_p = tl.argmax(score_p, axis=0, tie_break_left=True) + start
        token_p = tl.where(block_best_p > best_p, block_token_p, token_p)  # strict: earlier block wins ties
        best_p = tl.maximum(block_best_p, best_p)
    if PICK == 2:
        token_p = tl.where(sum_r > EPS * sum_p, token_r, token_p)
    return token_p


@triton.jit
def _rejection_kernel(
    target_probs_ptr,  # [B, G + 1, V]
    draft_probs_ptr,  # [B, G, V]
    draft_tokens_ptr,  # [B, G]
    num_draft_ptr,  # [B]
    row_mode_ptr,  # [B]
    seeds_ptr,  # [B]
    positions_ptr,  # [B]
    output_tokens_ptr,  # [B, G + 1]
    num_accepted_ptr,  # [B]
    stride_target_b,
    stride_target_g,
    stride_draft_b,
    stride_draft_g,
    stride_tokens_b,
    stride_output_b,
    V,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_V: tl.constexpr,
    EPS: tl.constexpr,
    HAS_Q: tl.constexpr,  # False: draft_probs_ptr is unused, every q_i is one-hot at d_i
):
    b = tl.program_id(0).to(tl.int64)
    gamma = tl.load(num_draft_ptr + b)
    mode = tl.load(row_mode_ptr + b)
    seed = tl.load(seeds_ptr + b)
    base_position = tl.load(positions_ptr + b)
    target_row = target_probs_ptr + b * stride_target_b
    draft_row = draft_probs_ptr + b * stride_draft_b
    tokens_row = draft_tokens_ptr + b * stride_tokens_b

    num_accepted = tl.zeros((), dtype=tl.int64)
    final_token = tl.zeros((), dtype=tl.int64)
    is_rejected = tl.zeros((), dtype=tl.int1)
    while (num_accepted < gamma) & (is_rejected == 0):
        j = num_accepted  # 0-based: d_{j+1} against p_{j+1}, at position base_position + j
        position = base_position + j
        draft_token = tl.load(tokens_row + j)
        p_row = target_row + j * stride_target_g
        q_row = draft_row + j * stride_draft_g
        if mode == 1:  # MODE_REJECTION: accept with probability min(1, p / q)
            p_draft = tl.load(p_row + draft_token).to(tl.float64)
            if HAS_Q:
                q_draft = tl.load(q_row + draft_token).to(tl.float64)
            else:
                q_draft = tl.full((), 1.0, tl.float64)
            key_a, key_b = row_key_dev(seed, position, 1)  # PURPOSE_ACCEPT
            u = uniform_dev(key_a, key_b, tl.zeros((), dtype=tl.int64))
            is_accepted = (q_draft > 0.0) & (u * q_draft < p_draft)
            if is_accepted == 0:
                final_token = _argmax_over_vocab(p_row, q_row, draft_token, V, seed, position, 2, HAS_Q, EPS,
                                                 BLOCK_V).to(tl.int64)
        else:
            if mode == 0:  # MODE_GREEDY
                target_token = _argmax_over_vocab(p_row, q_row, draft_token, V, seed, position, 0, HAS_Q, EPS,
                                                  BLOCK_V).to(tl.int64)
            else:  # MODE_COUPLED
                target_token = _argmax_over_vocab(p_row, q_row, draft_token, V, seed, position, 1, HAS_Q, EPS,
                                                  BLOCK_V).to(tl.int64)
            is_accepted = draft_token == target_token
            final_token = target_token
        is_rejected = is_accepted == 0
        num_accepted += is_accepted.to(tl.int64)

    if is_rejected == 0:  # all γ accepted: bonus from p_{γ+1}
        p_row = target_row + gamma * stride_target_g
        position = base_position + gamma
        if mode == 0:
            final_token = _argmax_over_vocab(p_row, p_row, 0, V, seed, position, 0, HAS_Q, EPS, BLOCK_V).to(tl.int64)
        else:
            final_token = _argmax_over_vocab(p_row, p_row, 0, V, seed, position, 1, HAS_Q, EPS, BLOCK_V).to(tl.int64)

    offs_g = tl.arange(0, BLOCK_G)
    drafts = tl.load(tokens_row + offs_g, mask=offs_g < num_accepted, other=-1)
    out = tl.where(offs_g == num_accepted, final_token, drafts)
    tl.store(output_tokens_ptr + b * stride_output_b + offs_g, out, mask=offs_g < G + 1)
    tl.store(num_accepted_ptr + b, num_accepted)


def _check_args(target_probs, draft_probs, draft_tokens, num_draft, row_mode, seeds, positions) -> None:
    """Shapes, dtypes, devices and values; raises before anything is computed."""
    tensors = dict(
        target_probs=target_probs,
        draft_probs=draft_probs,
        draft_tokens=draft_tokens,
        num_draft=num_draft,
        row_mode=row_mode,
        seeds=seeds,
        positions=positions,
    )
    if draft_probs is None:  # one-hot drafts
        del tensors["draft_probs"]
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [batch, gamma + 1, vocab], got shape {tuple(target_probs.shape)}")
    B, G1, V = target_probs.shape
    G = G1 - 1
    if G < 0 or V == 0:
        raise ValueError(f"target_probs must hold at least one distribution over a non-empty vocab, got {(B, G1, V)}")
    expected = dict(
        draft_probs=(B, G, V), draft_tokens=(B, G), num_draft=(B,), row_mode=(B,), seeds=(B,), positions=(B,)
    )
    for name, shape in expected.items():
        if name in tensors and tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"{name} must have shape {shape} to match target_probs {(B, G1, V)}, got {tuple(tensors[name].shape)}"
            )
    q_dtype = target_probs.dtype if draft_probs is None else draft_probs.dtype
    if target_probs.dtype not in (torch.float32, torch.float64) or q_dtype != target_probs.dtype:
        raise TypeError(
            f"target_probs and draft_probs must both be float32 or both float64, "
            f"got {target_probs.dtype} and {q_dtype}"
        )
    for name in ("draft_tokens", "num_draft", "seeds", "positions"):
        if tensors[name].dtype != torch.int64:
            raise TypeError(f"{name} must be int64, got {tensors[name].dtype}; convert it with .long()")
    if row_mode.dtype.is_floating_point or row_mode.dtype.is_complex or row_mode.dtype == torch.bool:
        raise TypeError(f"row_mode must be an integer tensor of MODE_* values, got {row_mode.dtype}")
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    if B == 0:
        return
    if int(num_draft.min()) < 0 or int(num_draft.max()) > G:
        raise ValueError(f"num_draft must lie in [0, {G}] (G = target_probs.shape[1] - 1), got {num_draft.tolist()}")
    if int(row_mode.min()) < MODE_GREEDY or int(row_mode.max()) > MODE_COUPLED:
        raise ValueError(
            f"row_mode values must be MODE_GREEDY (0), MODE_REJECTION (1) or MODE_COUPLED (2), got {row_mode.tolist()}"
        )
    is_draft = torch.arange(G, device=draft_tokens.device)[None, :] < num_draft[:, None]  # [B, G]
    if bool(((draft_tokens < 0) | (draft_tokens >= V))[is_draft].any()):
        raise ValueError(f"draft_tokens of drafted positions must lie in [0, {V}) (the vocab size)")


def rejection(
    target_probs: torch.Tensor,  # [B, G + 1, V] float32/float64
    draft_probs: torch.Tensor | None,  # [B, G, V] same dtype; None: one-hot drafts
    draft_tokens: torch.Tensor,  # [B, G] int64
    num_draft: torch.Tensor,  # [B] int64, γ_b <= G
    row_mode: torch.Tensor,  # [B] int, MODE_*
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64, absolute position of d_1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a batch of drafts in one launch (one program per row).

    Returns output_tokens int64 [B, G + 1] (accepted drafts, then the recovered
    or bonus token, then -1) and num_accepted int64 [B]. See the module
    docstring for the rule of each mode.
    """
    _check_args(target_probs, draft_probs, draft_tokens, num_draft, row_mode, seeds, positions)
    B, G1, V = target_probs.shape
    has_q = draft_probs is not None
    if target_probs.stride(2) != 1 or (has_q and draft_probs.stride(2) != 1) or draft_tokens.stride(1) != 1:
        raise ValueError("target_probs, draft_probs and draft_tokens must be contiguous in their last dimension")
    output_tokens = torch.full((B, G1), -1, dtype=torch.int64, device=target_probs.device)  # [B, G + 1]
    num_accepted = torch.zeros(B, dtype=torch.int64, device=target_probs.device)  # [B]
    if B == 0:
        return output_tokens, num_accepted
    q = draft_probs if has_q else target_probs  # without q the pointer is never read
    _rejection_kernel[(B,)](
        target_probs,
        q,
        draft_tokens,
        num_draft.contiguous(),
        row_mode.to(torch.int32).contiguous(),
        seeds.contiguous(),
        positions.contiguous(),
        output_tokens,
        num_accepted,
        target_probs.stride(0),
        target_probs.stride(1),
        q.stride(0) if has_q else 0,
        q.stride(1) if has_q else 0,
        draft_tokens.stride(0),
        output_tokens.stride(0),
        V,
        G=G1 - 1,
        BLOCK_G=triton.next_power_of_2(G1),
        BLOCK_V=min(triton.next_power_of_2(V), _MAX_BLOCK_V),
        EPS=RESIDUAL_EPS,
        HAS_Q=has_q,
    )
    return output_tokens, num_accepted


# ----------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------


def _gumbel_argmax_3d(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, purpose: int) -> torch.Tensor:
    """Gumbel-max over the last dim of float64 probs [B, K, V] at positions [B, K]; -> int64 [B, K]."""
    B, K, V = probs.shape
    noise = keyed_gumbel(seeds[:, None].expand(B, K).reshape(-1), positions.reshape(-1), purpose, V)  # [B*K, V]
    return torch.argmax(torch.log(probs) + noise.view(B, K, V), dim=2)


def rejection_ref(
    target_probs: torch.Tensor,  # [B, G + 1, V] float32/float64
    draft_probs: torch.Tensor | None,  # [B, G, V] same dtype; None: one-hot drafts
    draft_tokens: torch.Tensor,  # [B, G] int64
    num_draft: torch.Tensor,  # [B] int64, γ_b <= G
    row_mode: torch.Tensor,  # [B] int, MODE_*
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64, absolute position of d_1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch ``rejection``: same arguments, same results, vectorised over rows."""
    _check_args(target_probs, draft_probs, draft_tokens, num_draft, row_mode, seeds, positions)
    B, G1, V = target_probs.shape
    G = G1 - 1
    device = target_probs.device
    p = target_probs.to(torch.float64)  # [B, G + 1, V]
    mode = row_mode.to(torch.int64)[:, None]  # [B, 1]
    steps = torch.arange(G1, device=device)  # [G + 1]
    token_positions = positions[:, None] + steps  # [B, G + 1]: position of the token sampled from p_{j+1}

    greedy_tokens = torch.argmax(p, dim=2)  # [B, G + 1]
    modes = row_mode.tolist()  # the reference decides on the host which parts any row needs
    is_random = any(m != MODE_GREEDY for m in modes)  # noise is drawn only when some row samples
    any_rejection = any(m == MODE_REJECTION for m in modes)
    sampled_tokens = (_gumbel_argmax_3d(p, seeds, token_positions, PURPOSE_SAMPLE)
                      if is_random else greedy_tokens)  # [B, G + 1]
    target_tokens = (torch.where(mode == MODE_GREEDY, greedy_tokens, sampled_tokens)
                     if is_random else greedy_tokens)  # [B, G + 1]
    is_draft = steps[None, :G] < num_draft[:, None]  # [B, G]
    is_accepted = draft_tokens == target_tokens[:, :G]  # greedy and coupled rows: the draft is the target's token

    # Rejection: accept d with probability min(1, p(d) / q(d)).
    safe_tokens = torch.where(is_draft, draft_tokens, 0)[:, :, None]  # [B, G, 1]: padding may be any value
    if any_rejection:
        p_draft = p[:, :G].gather(2, safe_tokens).squeeze(2)  # [B, G]
        if draft_probs is None:  # one-hot q: q(d) = 1
            q_draft = torch.ones_like(p_draft)  # [B, G]
        else:
            q_draft = draft_probs.to(torch.float64).gather(2, safe_tokens).squeeze(2)  # [B, G]
        u = keyed_uniform(seeds[:, None], token_positions[:, :G], PURPOSE_ACCEPT)  # [B, G]
        is_accepted_rejection = (q_draft > 0) & (u * q_draft < p_draft)  # [B, G]
        is_accepted = torch.where(mode == MODE_REJECTION, is_accepted_rejection, is_accepted)  # [B, G]
    is_accepted &= is_draft
    num_accepted = torch.cumprod(is_accepted.to(torch.int64), dim=1).sum(1)  # [B]

    final_tokens = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)  # [B]: mismatch target or bonus
    if G > 0 and any_rejection:
        is_recovered = (row_mode == MODE_REJECTION) & (num_accepted < num_draft)  # [B]
        if bool(is_recovered.any()):
            if draft_probs is None:  # max(0, p - one_hot(d)) is p without d
                residual = p[:, :G].scatter(2, safe_tokens, 0.0)  # [B, G, V]
            else:
                residual = torch.clamp(p[:, :G] - draft_probs.to(torch.float64), min=0.0)  # [B, G, V]: max(0, p - q)
            is_residual_zero = residual.sum(2) <= RESIDUAL_EPS * p[:, :G].sum(2)  # [B, G]
            residual = torch.where(is_residual_zero[:, :, None], p[:, :G], residual)
            recovered_tokens = _gumbel_argmax_3d(residual, seeds, token_positions[:, :G], PURPOSE_RECOVER)  # [B, G]
            recovered = recovered_tokens.gather(1, num_accepted.clamp(max=G - 1)[:, None]).squeeze(1)  # [B]
            final_tokens = torch.where(is_recovered, recovered, final_tokens)

    output_tokens = torch.full((B, G1), -1, dtype=torch.int64, device=device)  # [B, G + 1]
    output_tokens[:, :G] = torch.where(steps[None, :G] < num_accepted[:, None], draft_tokens, -1)
    output_tokens.scatter_(1, num_accepted[:, None], final_tokens[:, None])
    return output_tokens, num_accepted
