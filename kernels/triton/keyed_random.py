"""The keyed random numbers of ``kernels/keyed_random.py`` as ``@triton.jit``
device functions for kernels to call: the same hash, bit for bit, in int64
arithmetic (``row_key_dev``, ``uniform_dev``, ``gumbel_dev``). The module
docstring there defines the hash, the uniform and the Gumbel noise; a
``purpose`` here is one of its ``PURPOSE_*`` constants.
"""

from hybridspec.kernels.triton.triton_import import tl, triton


@triton.jit
def _mix_dev(x):
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


@triton.jit
def _chain_dev(seed, position, purpose, init, salt):
    h = _mix_dev(((seed & 0xFFFFFFFF) + init) & 0xFFFFFFFF)
    h = _mix_dev(h ^ (((seed >> 32) & 0xFFFFFFFF) ^ salt))
    h = _mix_dev(h ^ ((position & 0xFFFFFFFF) ^ salt))
    h = _mix_dev(h ^ (((position >> 32) & 0xFFFFFFFF) ^ salt))
    return _mix_dev(h ^ (purpose ^ salt))


@triton.jit
def row_key_dev(seed, position, purpose: tl.constexpr):
    """Row key (key_a, key_b) of int64 ``seed``/``position`` for a PURPOSE_* constant."""
    seed = seed.to(tl.int64)
    position = position.to(tl.int64)
    key_a = _chain_dev(seed, position, purpose, 0x2545F491, 0)  # _INIT_A
    key_b = _chain_dev(seed, position, purpose, 0x4F1BBCDD, 0x61C88647)  # _INIT_B, _SALT_B
    return key_a, key_b


@triton.jit
def _word_dev(key_a, key_b, element):
    return _mix_dev(_mix_dev(key_a ^ (element & 0xFFFFFFFF)) ^ key_b)


@triton.jit
def uniform_dev(key_a, key_b, index):
    """float64 uniforms in (0, 1) for int ``index`` (any shape) under a row key."""
    index = index.to(tl.int64)
    high = _word_dev(key_a, key_b, 2 * index) >> 6
    low = _word_dev(key_a, key_b, 2 * index + 1) >> 6
    bits = (high << 26) | low
    return (2 * bits + 1).to(tl.float64) * 1.1102230246251565e-16  # 2**-53


@triton.jit
def gumbel_dev(key_a, key_b, index):
    """float64 Gumbel noise -log(-log u) for int ``index`` under a row key."""
    u = uniform_dev(key_a, key_b, index)
    return -tl.log(-tl.log(u))
