"""``bench.served_acceptance`` compares the server with the lab on the lab's own pooling."""

from __future__ import annotations

import pytest

from sglang_vc.bench.served_acceptance import lab_acceptance


def test_lab_acceptance_reads_the_pooled_and_per_prompt_figures():
    per = [{"rounds": {"30": {"rounds": 4, "committed": 95, "accepted": 91}}},
           {"rounds": {"30": {"rounds": 8, "committed": 95, "accepted": 87}}}]
    lab = {"results": [{"label": "snapkv@0.25", "acceptance_length": {"30": 1.0}, "per_prompt": per},
                       {"label": "specache@2b/nonspec", "acceptance_length": {"30": 190 / 12}, "per_prompt": per}]}
    pooled, each = lab_acceptance(lab, "specache@2b/nonspec", 30)
    assert pooled == pytest.approx(190 / 12) and each == [95 / 4, 95 / 8]
    with pytest.raises(KeyError, match="no result labelled"):
        lab_acceptance(lab, "kivi@2bit", 30)
