"""Host-to-device copies on a stream of their own, each batch of copies marked by an event
that the consumer's stream waits on before it reads (VeriCache's layer-wise reload,
SpeCache's prefetch).

A copy thread that names no stream copies on the device's default stream, and a
``non_blocking`` copy returns once it is queued: SGLang's forward runs on a stream of its
own, which would read the rows whether or not they have landed. Here the copies run on
their own stream, so that they overlap the layer before on the compute stream instead of
queuing behind it; :meth:`CopyStream.wait` makes the reading stream wait on their event
and ``record_stream``s the staged tensors, so the caching allocator does not hand their
memory to the copy stream again while the reader may still use it. On the CPU there is
no stream: a copy is done when it returns.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, TypeVar

import torch

T = TypeVar("T")


class CopyStream:
    """``module``: the device module (``torch.cuda``); tests pass a stand-in."""

    def __init__(self, device, module=None):
        dev = torch.device(device)
        self.module = module if module is not None else (
            None if dev.type in ("cpu", "meta") else torch.get_device_module(dev))
        self.stream = None if self.module is None else self.module.Stream(dev)
        # the device the constructing (scheduler) thread uses: a new thread starts on
        # device 0, where its copies and events would land on another rank's GPU
        self.index = dev.index if dev.index is not None or self.module is None else self.module.current_device()

    def bind_thread(self) -> None:
        """Make the calling thread use this stream's device (a copy thread's initializer)."""
        if self.module is not None and self.index is not None:
            self.module.set_device(self.index)

    def mark(self) -> Optional[object]:
        """An event on the current (producer's) stream, for a copy that reads what the
        work queued so far computes (SpeCache's top-k positions); None on the CPU."""
        return None if self.stream is None else self.module.current_stream().record_event()

    def fences(self) -> tuple:
        """Events after everything queued so far on the copy stream and on the current
        (consumer's) stream: memory both used is free once both passed (empty on the CPU)."""
        if self.stream is None:
            return ()
        return self.stream.record_event(), self.module.current_stream().record_event()

    def copy(self, fn: Callable[[], T], after=None) -> tuple[T, Optional[object]]:
        """``(fn(), event)``: run ``fn``'s copies on the copy stream, once the ``after``
        event (:meth:`mark`) has passed; the returned event marks their end (None on the
        CPU)."""
        if self.stream is None:
            return fn(), None
        with self.module.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            out = fn()
            event = self.stream.record_event()
        return out, event

    def wait(self, event, tensors: Iterable[Optional[torch.Tensor]]) -> None:
        """Make the current (consumer's) stream wait for the copies, and keep ``tensors``
        from being reused by the copy stream while the consumer still reads them."""
        if event is None:
            return
        current = self.module.current_stream()
        current.wait_event(event)
        for t in tensors:
            if t is not None:
                self.keep_alive(t, current)

    @staticmethod
    def keep_alive(t: torch.Tensor, stream) -> None:
        t.record_stream(stream)
