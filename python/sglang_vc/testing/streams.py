"""A stand-in for ``torch.cuda``'s streams and events on a machine without a GPU: it
records which thread copied under which stream, which events each stream waited on, and
which events were recorded where, so that tests can check the ordering a GPU would
enforce (:class:`sglang_vc.kvruntime.CopyStream`)."""

from __future__ import annotations

import contextlib
import threading
import types


class StandInStreams:
    COMPUTE = "compute"

    def __init__(self):
        self.local = threading.local()
        self.log: list[tuple[str, object]] = []  # ("record" | "wait" | "copy-wait" | "sync", event)

    def Stream(self, device):  # noqa: N802 - the torch.cuda name
        return types.SimpleNamespace(name="copy", record_event=lambda: self._event("copy"),
                                     wait_event=lambda e: self.log.append(("copy-wait", e)))

    def _event(self, stream: str):
        event = types.SimpleNamespace(stream=stream, layer_copied=getattr(self.local, "inside", None))
        event.synchronize = lambda: self.log.append(("sync", event))  # a host wait for it
        event.query = lambda: True  # a stand-in GPU is never behind
        self.log.append(("record", event))
        return event

    def inside(self) -> str | None:
        """The stream the calling thread is issuing work on (None: the default one)."""
        return getattr(self.local, "inside", None)

    def stream(self, s):
        @contextlib.contextmanager
        def ctx():
            self.local.inside = s.name
            try:
                yield
            finally:
                self.local.inside = None
        return ctx()

    def current_device(self) -> int:
        """The calling thread's device (a new thread's is 0, as in CUDA)."""
        return getattr(self.local, "device", 0)

    def set_device(self, index: int) -> None:
        self.local.device = index

    def current_stream(self):
        return types.SimpleNamespace(wait_event=lambda e: self.log.append(("wait", e)),
                                     record_event=lambda: self._event(self.COMPUTE))
