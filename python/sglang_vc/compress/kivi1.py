"""1-bit KIVI as modified by SpeCache ("SpeCache: Speculative Key-Value Caching
for Efficient Generation of LLMs", Jie et al.), section 3.4, eq. 3.

With plain KIVI at 1 bit every element becomes ``min X`` or ``max X``, which inflates the
cache's magnitude. Assuming values uniform on ``[min X, max X]`` and minimising the
error, SpeCache uses

    z = (3 min X + max X) / 4,    s = (max X - min X) / 2,

so ``round((X - z) / s)`` (clamped to {0, 1}) maps the lower half of the range to
``z = (3 min + max) / 4`` and the upper half to ``z + s = (min + 3 max) / 4``: the midpoints
of the two halves, error ``<= (max - min) / 4 = s / 2``. Grouping, residual and packing
are KIVI's (SpeCache uses group size 32 or 64 and a residual of 64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from .kivi import KIVI


@dataclass
class KIVI1(KIVI):
    name: ClassVar[str] = "kivi1"
    supported_bits: ClassVar[tuple[int, ...]] = (1, 16)

    residual_length: int = 64

    def zero_scale(self, mn: Tensor, mx: Tensor, bits: int) -> tuple[Tensor, Tensor]:
        return (3 * mn + mx) / 4, (mx - mn) / 2
