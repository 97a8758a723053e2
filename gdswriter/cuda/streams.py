"""Events, side streams, stream-ordered waits and pinned registration for the snapshot path.

Nothing here runs unless a CUDA tensor is in the state: callers decide from tensor devices
(``cuda_devices``), which needs no CUDA call, so CPU-only jobs on a GPU machine never create a
CUDA context. Every call is made under the tensor's own device, never "the current device",
so a rank driving GPU k creates no context on GPU 0.

The snapshot protocol, per device:
1. ``record_ready``: at ``save_async``, an event on the caller's current (training) stream
   marks the point after which the saved tensors hold the values to save;
2. ``on_side_streams``: the copying thread makes the device's side stream current after it
   waits on that event, so device-to-host copies run behind the training work that produced
   the values, without stalling the training stream or the host;
3. ``record_side``: events on the side streams mark copies done; ``stream_wait`` makes the
   training stream wait for them (no host synchronize) before it may change the tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager

import torch



_side: dict[int, torch.cuda.Stream] = {}
_side_lock = threading.Lock()


def cuda_devices(devices: Iterable[torch.device]) -> list[int]:
    """Indices of the CUDA devices among ``devices`` (sorted). Makes no CUDA call."""
    return sorted({d.index for d in devices if d.type == "cuda"})


def record_ready(devices: Iterable[int]) -> dict[int, torch.cuda.Event]:
    """An event on each device's current stream, recorded now (step 1 above)."""
    events = {}
    for d in devices:
        with torch.cuda.device(d):
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(d))
        events[d] = ev
    return events


def side_stream(device: int) -> torch.cuda.Stream:
    """This process's copy stream on ``device`` (created once; shared by every save)."""
    with _side_lock:
        s = _side.get(device)
        if s is None:
            with torch.cuda.device(device):
                s = _side[device] = torch.cuda.Stream(device=device)
        return s


@contextmanager
def on_side_streams(ready: Mapping[int, torch.cuda.Event]) -> Iterator[None]:
    """In this thread, make each device's side stream current after it waits on ``ready[device]``:
    copies issued inside (``copy_`` uses the source device's current stream) start only
    once the work before the event is done (step 2 above)."""
    with ExitStack() as stack:
        for d, ev in ready.items():
            s = side_stream(d)
            s.wait_event(ev)
            stack.enter_context(torch.cuda.stream(s))
        yield


def record_side(devices: Iterable[int]) -> dict[int, torch.cuda.Event]:
    """An event on each device's side stream: everything copied there so far (step 3 above)."""
    events = {}
    for d in devices:
        with torch.cuda.device(d):
            ev = torch.cuda.Event()
            ev.record(side_stream(d))
        events[d] = ev
    return events


def stream_wait(events: Mapping[int, torch.cuda.Event]) -> None:
    """Make the calling thread's current stream on each device wait for ``events``; the host
    does not wait."""
    for d, ev in events.items():
        torch.cuda.current_stream(d).wait_event(ev)


def events_done(events: Mapping[int, torch.cuda.Event]) -> bool:
    return all(ev.query() for ev in events.values())


def host_wait(events: Mapping[int, torch.cuda.Event]) -> None:
    for ev in events.values():
        ev.synchronize()
