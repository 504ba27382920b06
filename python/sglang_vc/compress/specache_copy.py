"""SpeCache's device copy as a compressor (``specache``): KIVI at 2 bits, and at 1 bit
KIVI with SpeCache's eq. 3 zero-point and scale (:class:`.kivi1.KIVI1`'s rule), with
SpeCache's residual of 64 full-precision tokens.

The payload alone is lossy KIVI; what makes it SpeCache is how it is read: each query
attends over it with its top-k rows per KV head put back in full precision from a host
copy (eq. 1). So it is served only where a full host copy exists
(``needs_full_rows``): as VERICACHE's drafter (``--vc-compressor specache``), which
keeps the full KV on the host for its verify anyway. SpeCache as the model's own decoder
is ``--speculative-algorithm SPECACHE``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from .kivi import KIVI
from .kivi1 import KIVI1


@dataclass
class SpeCacheCopy(KIVI):
    name: ClassVar[str] = "specache"
    supported_bits: ClassVar[tuple[int, ...]] = (1, 2)
    needs_full_rows: ClassVar[bool] = True

    residual_length: int = 64

    def zero_scale(self, mn: Tensor, mx: Tensor, bits: int) -> tuple[Tensor, Tensor]:
        if bits == 1:
            return KIVI1.zero_scale(self, mn, mx, bits)
        return super().zero_scale(mn, mx, bits)
