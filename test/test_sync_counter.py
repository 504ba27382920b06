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


def test_sync_counter_counts_blocking_host_to_device_copies():
    t = torch.arange(4)
    dev = torch.device("cpu")  # the serving device, written as the project writes it
    with syncs.SyncCounter() as c:
        torch.tensor([1, 2, 3], device=dev)  # pageable host list -> device: waits
        torch.as_tensor([1, 2], device=dev)
        t.to(dev)  # blocking copy (or a no-op a GPU would not wait on: counted either way)
        t.to(dev, torch.float32)
        t.to(device=dev)
        t.pin_memory().to(dev, non_blocking=True) if torch.cuda.is_available() else t.to(dev, non_blocking=True)
        torch.tensor([1, 2])  # host only: no device named
        torch.as_tensor(t, device=dev)  # a tensor already: not a host list
        t.to(torch.float64)  # a dtype change
    assert c.by_kind[syncs.H2D] == 5, c.by_kind
    assert c.total == 5
    torch.tensor([1], device=dev)  # after the block: torch's own factory, not counted
    assert c.by_kind[syncs.H2D] == 5
