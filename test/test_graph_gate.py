"""Decode CUDA graphs under the project's ``vc_torch`` backend: SGLang's can-run gate
skips them for a batch holding a compressed request (it runs eagerly, the project's
attention); every other batch captures and replays the full-KV backend's graph protocol
(SGLang's own backend). No GPU here: the gate and the protocol are driven the way
SGLang's ``DecodeCudaGraphRunner`` drives them (``test_platform_resolution`` shows that
decode graphs stay on under SGLang's CUDA platform)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from sglang_vc.kvruntime.graphs import no_graph_for_compressed_batches
from sglang_vc.kvruntime.backend import VCTorchAttnBackend
from sglang_vc.kvruntime.runtime import BatchView

# the graph protocol the wrapper forwards: each a method of SGLang's AttentionBackend
GRAPH_PROTOCOL = ("init_cuda_graph_state", "get_cuda_graph_seq_len_fill_value", "init_forward_metadata_out_graph",
                  "init_forward_metadata_in_graph", "on_after_cuda_graph_warmup")


class Recorder:
    """Stands in for SGLang's full-KV backend: records the graph protocol's calls."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append(name)
            return f"{name}-result"
        return call


class Runtime:
    def __init__(self, compressed):
        self.compressed = set(compressed)
        self.batch = "stale view of the last eager forward"

    def compressed_rids(self):
        return set(self.compressed)

    def no_forward(self):
        self.batch = None

    def begin_forward(self, forward_batch):
        entries = ["compressed" if rid in self.compressed else None for rid in forward_batch.rids]
        self.batch = BatchView(entries, [], {})
        return self.batch


def backend(compressed, full_kv="recorder"):
    b = object.__new__(VCTorchAttnBackend)  # no model runner: only the gate and the protocol
    b.use_sliding_window_kv_pool = False
    b.runtime = Runtime(compressed)
    b.full_kv = Recorder() if full_kv == "recorder" else full_kv
    b.full_kv_name = "triton" if b.full_kv is not None else "torch_native"
    return b


def can_run(attn_backend, rids, sglang_says=True):
    runner = SimpleNamespace(attn_backend=attn_backend)
    return no_graph_for_compressed_batches(lambda r, fb: sglang_says, runner, SimpleNamespace(rids=rids))


def test_gate_refuses_only_batches_holding_a_compressed_request():
    assert can_run(backend(compressed={"c"}), ["a", "b"])
    assert not can_run(backend(compressed={"b"}), ["a", "b"])
    assert not can_run(backend(compressed={"b"}), None)  # ids unknown: eager is always correct
    assert can_run(backend(compressed=()), None)
    assert not can_run(backend(compressed=()), ["a"], sglang_says=False)  # SGLang's own answer stands
    assert can_run(SimpleNamespace(), ["a"])  # another backend: SGLang's gate alone


def decode_batch(rids):
    return SimpleNamespace(rids=rids, seq_lens=torch.tensor([5] * len(rids)), out_cache_loc=None,
                           forward_mode=SimpleNamespace(is_target_verify=lambda: False, is_decode=lambda: True,
                                                        is_extend=lambda: False))


def test_graph_protocol_is_the_full_kv_backends(monkeypatch):
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    for name in GRAPH_PROTOCOL:  # SGLang still calls them so
        assert callable(getattr(AttentionBackend, name, None)), name
    monkeypatch.setattr("sglang_vc.kvruntime.graphs.graph_gate_in_place", lambda: True)
    b = backend(compressed={"c"})
    b.init_cuda_graph_state(8, 8)
    assert b.get_cuda_graph_seq_len_fill_value() == "get_cuda_graph_seq_len_fill_value-result"
    # capture / replay: no request of the batch is compressed (the gate said so)
    b.init_forward_metadata_out_graph(SimpleNamespace(rids=["a"]), in_capture=True)
    b.init_forward_metadata_in_graph(SimpleNamespace(rids=["a"]))
    assert b.delegated and b.runtime.batch is None and b.decode_index is None
    layer = SimpleNamespace(layer_id=0, is_cross_attention=False)
    assert b.forward_decode("q", "k", "v", layer, SimpleNamespace()) == "forward_decode-result"
    b.on_after_cuda_graph_warmup()
    assert b.full_kv.calls == ["init_cuda_graph_state", "get_cuda_graph_seq_len_fill_value",
                               "init_forward_metadata_out_graph", "init_forward_metadata_in_graph",
                               "forward_decode", "on_after_cuda_graph_warmup"]
    # the next forward holds a compressed request: eager, and no longer the full-KV backend's
    b.init_forward_metadata(decode_batch(["a", "c"]))
    assert not b.delegated and b.runtime.batch.any_compressed
    # and one without: eager through the full-KV backend
    b.init_forward_metadata(decode_batch(["a"]))
    assert b.delegated and b.full_kv.calls[-1] == "init_forward_metadata"


def test_graphs_are_refused_without_the_gate(monkeypatch):
    """HookRegistry only logs a patch it could not apply: without the gate a compressed
    batch would replay a full-KV graph over null slots, so the backend captures none.
    (Whether the gate is in place depends on what this process applied before: pinned
    here; ``test_every_hook_target_resolves`` checks the real answer in a fresh process.)"""
    monkeypatch.setattr("sglang_vc.kvruntime.graphs.graph_gate_in_place", lambda: False)
    with pytest.raises(RuntimeError, match="can-run gate"):
        backend(compressed=()).init_cuda_graph_state(8, 8)


def test_torch_native_full_kv_backend_refuses_graphs_with_a_message():
    with pytest.raises(ValueError, match="does not capture CUDA graphs.*--cuda-graph-backend-decode disabled"):
        backend(compressed=(), full_kv=None).init_cuda_graph_state(8, 8)


def test_every_hook_target_resolves():
    """A hook whose target SGLang renamed is only logged when applied: check them all."""
    code = (
        "import pkgutil\n"
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "from sglang_vc import hooks\n"
        "from sglang_vc.kvruntime.graphs import graph_gate_in_place\n"
        "assert not graph_gate_in_place()\n"
        "hooks.install()\n"
        "HookRegistry.apply_hooks()\n"
        "assert graph_gate_in_place()\n"
        "targets = sorted(HookRegistry._hooks)\n"
        "assert any(t.endswith('DecodeCudaGraphRunner.can_run_graph') for t in targets), targets\n"
        "for t in targets:\n"
        "    obj, attr = t.rsplit('.', 1)\n"
        "    assert hasattr(pkgutil.resolve_name(obj), attr), t\n"
        "print('RESOLVED', len(targets))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "RESOLVED" in r.stdout, r.stderr[-3000:]


def test_launcher_keeps_decode_graphs_only_where_the_gate_can_hold():
    """Lossy serving keeps SGLang's decode graphs (prefill graphs off); with the CPU's
    torch_native doing full-KV attention (it captures none) they are off too, a warning
    with that reason; DP attention, whose ranks vote on graphs together, is refused."""
    from sglang_vc import notices
    from sglang_vc.config import ConfigError, VCConfig
    from sglang_vc.launch_server import backend_flags

    lossy = VCConfig(vc_compressor="knorm", vc_compression_ratio=0.5)
    extra = backend_flags(lossy, [])
    assert "--cuda-graph-backend-prefill" in extra and "--cuda-graph-backend-decode" not in extra
    native = VCConfig(vc_compressor="knorm", vc_compression_ratio=0.5, vc_full_kv_attention_backend="torch_native")
    extra = backend_flags(native, [])
    assert extra[extra.index("--cuda-graph-backend-decode") + 1] == "disabled"
    assert any(n.capability == "decode CUDA graphs" and "torch_native" in n.reason for n in notices.all_switched_off())
    with pytest.raises(ConfigError, match="--enable-dp-attention is not supported"):
        backend_flags(lossy, ["--enable-dp-attention"])
