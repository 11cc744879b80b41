"""Counter-based random numbers keyed by (request seed, absolute position, purpose, index).

Every random number the runtime draws is a pure function of

    seed      the request's seed, int64 in [0, 2**63)
    position  the absolute position of the token it decides
    purpose   what it is for (the ``PURPOSE_*`` constants below)
    index     which number of that (seed, position, purpose): 0 for the single
              accept-test uniform, the vocabulary id for Gumbel noise; in [0, 2**31)

and of nothing else: never the batch row, γ, or how many numbers were drawn
before. This is what lets speculative output with ``verify="coupled"`` be
token-identical to plain decoding with the same seed.

Hash. ``_mix`` is a 32-bit avalanche finalizer in the murmur3 ``fmix32`` style
(xor-shift, multiply, xor-shift, multiply, xor-shift) with odd multipliers
below 2**31, so that in int64 arithmetic no product overflows: every step is
masked back to 32 bits. The row key is two independent 32-bit chains (a and b)
that fold in the seed's low and high halves, the position's halves and the
purpose; two chains make the key 64 bits, so distinct (seed, position,
purpose) keys give the same noise with probability about 2**-64, not 2**-32.
A 32-bit word for element ``e = 2·index + w`` (w = 0, 1) is
``mix(mix(a ^ e) ^ b)``.

Uniform. Two words give 52 random bits k in [0, 2**52); u = (2k + 1) · 2**-53
lies in the open interval (0, 1) (its extremes are 2**-53 and 1 - 2**-53) and
is exact in float64. With 53 bits the half-ulp offset would need a 54-bit
mantissa and the top value would round to 1.0, so the 53rd bit is given up.

Gumbel. g = -log(-log(u)); sampling from p is ``argmax_v log p(v) + g(v)``
(the Gumbel-max trick), the project's one sampling rule.

The same hash exists twice, bit for bit: here in torch int64 arithmetic (CPU
or GPU tensors), the form every backend's sampler and reference calls, and as
``@triton.jit`` device functions for kernels to call
(``kernels/triton/keyed_random.py``).
"""

import torch

PURPOSE_SAMPLE = 0  # Gumbel noise: plain sampling, the bonus token, both models in coupled mode
PURPOSE_ACCEPT = 1  # the accept-test uniform of rejection sampling
PURPOSE_RECOVER = 2  # Gumbel noise for the recovered token
PURPOSE_DRAFT = 3  # the drafter's own sampling noise in rejection mode

_MASK32 = 0xFFFFFFFF
_MUL_1 = 0x21F0AAAD  # odd, < 2**31: x * _MUL_1 < 2**63 for any 32-bit x
_MUL_2 = 0x735A2D97
_INIT_A = 0x2545F491  # chain a starts from seed_lo + _INIT_A
_INIT_B = 0x4F1BBCDD  # chain b starts from seed_lo + _INIT_B
_SALT_B = 0x61C88647  # folded into every input of chain b so the chains differ
_TWO_POW_M53 = 2.0**-53


def _mix(x: torch.Tensor) -> torch.Tensor:
    """32-bit avalanche finalizer on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL_1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_2) & _MASK32
    return x ^ (x >> 15)


def _chain(seeds: torch.Tensor, positions: torch.Tensor, purpose: int | torch.Tensor, init: int,
           salt: int) -> torch.Tensor:
    """One 32-bit chain folding seed_lo, seed_hi, position_lo, position_hi, purpose."""
    h = _mix(((seeds & _MASK32) + init) & _MASK32)
    h = _mix(h ^ (((seeds >> 32) & _MASK32) ^ salt))
    h = _mix(h ^ ((positions & _MASK32) ^ salt))
    h = _mix(h ^ (((positions >> 32) & _MASK32) ^ salt))
    return _mix(h ^ (purpose ^ salt))


def _row_key(seeds: torch.Tensor, positions: torch.Tensor,
             purpose: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row key (key_a, key_b): two independent chains; shapes broadcast."""
    key_a = _chain(seeds, positions, purpose, _INIT_A, 0)
    key_b = _chain(seeds, positions, purpose, _INIT_B, _SALT_B)
    return key_a, key_b


def _word(key_a: torch.Tensor, key_b: torch.Tensor, element: torch.Tensor) -> torch.Tensor:
    """One 32-bit random word for element ``2·index + w`` of a row key."""
    return _mix(_mix(key_a ^ (element & _MASK32)) ^ key_b)


def _uniform(key_a: torch.Tensor, key_b: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    high = _word(key_a, key_b, 2 * index) >> 6  # 26 bits
    low = _word(key_a, key_b, 2 * index + 1) >> 6  # 26 bits
    bits = (high << 26) | low  # [0, 2**52)
    return (2 * bits + 1).to(torch.float64) * _TWO_POW_M53


def _check_int64(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name} must be an int64 tensor, got {got}; convert it with .long()")


def keyed_uniform(
    seeds: torch.Tensor, positions: torch.Tensor, purpose: int, index: torch.Tensor | None = None
) -> torch.Tensor:
    """Uniforms in the open interval (0, 1), float64, one per broadcast element.

    seeds:     int64, e.g. [N]          request seeds in [0, 2**63)
    positions: int64, e.g. [N]          absolute token positions
    purpose:   one of the PURPOSE_* ints
    index:     int64 or None (= 0)      in [0, 2**31)
    returns:   float64, the broadcast shape of seeds, positions and index
    """
    _check_int64("seeds", seeds)
    _check_int64("positions", positions)
    if index is None:
        index = torch.zeros((), dtype=torch.int64, device=seeds.device)
    _check_int64("index", index)
    key_a, key_b = _row_key(seeds, positions, purpose)
    return _uniform(key_a, key_b, index)


def keyed_gumbel(seeds: torch.Tensor, positions: torch.Tensor, purpose: int | torch.Tensor,
                 vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise g = -log(-log u), float64.

    seeds, positions: int64 [N]
    purpose:          one of the PURPOSE_* ints, or int64 [N] (one per row)
    returns:          float64 [N, vocab_size]; entry [n, v] uses index v
    """
    _check_int64("seeds", seeds)
    _check_int64("positions", positions)
    if seeds.dim() != 1 or positions.shape != seeds.shape:
        raise ValueError(
            f"seeds and positions must both be [N], got {tuple(seeds.shape)} and {tuple(positions.shape)}"
        )
    key_a, key_b = _row_key(seeds, positions, purpose)  # [N], [N]
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)  # [V]
    u = _uniform(key_a[:, None], key_b[:, None], vocab[None, :])  # [N, V]
    return -torch.log(-torch.log(u))


def gumbel_argmax(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  purpose: int | torch.Tensor) -> torch.Tensor:
    """Sample one token per row from ``probs`` by Gumbel-max with keyed noise.

    token[n] = argmax_v log(probs[n, v]) + g[n, v]  (float64; tokens with
    probability 0 never win). ``probs`` need not be normalised: the sample
    follows probs / probs.sum().

    probs:            float [N, V]
    seeds, positions: int64 [N]
    purpose:          one of the PURPOSE_* ints, or int64 [N] (one per row)
    returns:          int64 [N]
    """
    if probs.dim() != 2 or probs.shape[0] != seeds.shape[0]:
        raise ValueError(f"probs must be [N, V] with N = len(seeds) = {seeds.shape[0]}, got {tuple(probs.shape)}")
    if not probs.is_floating_point():
        raise TypeError(f"probs must be a float tensor, got {probs.dtype}")
    noise = keyed_gumbel(seeds, positions, purpose, probs.shape[1])  # [N, V]
    return torch.argmax(torch.log(probs.to(torch.float64)) + noise, dim=1)
