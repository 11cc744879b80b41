"""The native CPU kernels name SIMD instructions only through `kernels/cpu/simd.h`'s vocabulary,
so that another ISA means editing that one header: no other C source or header of
`kernels/cpu/` includes the x86 intrinsics header or spells an intrinsic, an intrinsic's
vector or mask type, or a prefetch hint."""
from __future__ import annotations

import re
from pathlib import Path

from hybridspec.kernels.cpu import native

CPU_DIR = Path(native.__file__).parent
MAPPING = CPU_DIR / "simd.h"
# _mm256_add_ps, _mm_prefetch, _MM_HINT_T0, _mm512_dpbf16_ps, __m256, __m512i, __mmask16, __m512bh
INTRINSIC = re.compile(r"\b(_mm\w*|_MM_\w+|__m\d+\w*|__mmask\d+)\b")


def kernel_files() -> list[Path]:
    """Every C source and header of the kernels: what native.py builds, and anything else there."""
    files = {*native.SOURCES, *native.HEADERS, *CPU_DIR.glob("*.c"), *CPU_DIR.glob("*.h")}
    return sorted(files)


def test_the_mapping_header_is_where_the_intrinsics_are():
    text = MAPPING.read_text()
    assert "#include <immintrin.h>" in text
    assert INTRINSIC.search(text), "simd.h maps the vocabulary to no intrinsic: is the pattern stale?"
    assert MAPPING in kernel_files()


def test_no_intrinsics_outside_the_mapping_header():
    found = {}
    for path in kernel_files():
        if path == MAPPING:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "immintrin.h" in line or INTRINSIC.search(line):
                found.setdefault(path.name, []).append(f"{number}: {line.strip()}")
    assert not found, f"intrinsics outside simd.h (use or extend its vocabulary): {found}"
