"""The host-synchronisation counter itself (``pytest -k sync``): what it counts, and
that SGLang's CPU full-KV backend is counted apart (:mod:`sglang_vc.kvruntime.syncs`)."""

import torch

from sglang_vc.kvruntime import syncs


def test_sync_counter_counts_host_reads_and_sets_the_cpu_stand_in_apart():
    t = torch.arange(4)
    stand_in = compile("t.tolist(); int(t[0]); t[:t[1]]", "/x/sglang/srt/layers/attention/torch_native_backend.py", "exec")
    with syncs.SyncCounter() as c:
        t.tolist()
        t[0].item()
        t.to("cpu")
        t.to(torch.float32)  # not a device-to-host copy
        exec(stand_in, {"t": t})
    assert c.by_kind["tolist"] == 1 and c.by_kind["item"] == 1 and c.by_kind["to"] == 1
    assert c.by_kind[syncs.STAND_IN] >= 3
    assert c.total == 3
