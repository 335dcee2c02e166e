"""Looking inside Pallas' TPU interpreter: the race detector's verdict and a trace of what a kernel did.

Used by the megakernel tests (and handy when debugging a kernel on CPU). These reach into
`jax._src.pallas.mosaic.interpret` (jax 0.10.2); nothing here is needed to *run* a kernel.

- `races_found()`: whether the race detector (InterpretParams(detect_races=True)) flagged a race in the last
  interpreted kernel. The interpreter keeps this state until the next kernel starts, so call it right after
  `jax.block_until_ready` on the kernel's outputs.
- `trace_interpreter()`: a context manager that records, in program order, the buffers the interpreter
  allocates, every DMA start, every kernel load, and the bytes each DMA actually moved. The interpreter binds
  its callbacks when a kernel is *traced*, so trace the function inside the context (a fresh `jax.jit`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _ipc
from jax._src.pallas.mosaic.interpret import utils as _iutils


def races_found() -> bool:
    return bool(_ipc.races is not None and _ipc.races.races_found)


def reset() -> None:
    """Reset the interpreter's global state (needed after a kernel raised)."""
    _ipc.reset_tpu_interpret_mode_state()


def _space(index) -> str:
    return _ipc.TPU_MEMORY_SPACE_NAMES[int(index)]


def _range(transforms) -> tuple:
    return tuple(_iutils.to_range(jax.tree.map(int, transforms)))


@dataclasses.dataclass
class Trace:
    # (space, buffer id) -> (shape, dtype) for every buffer allocated (inputs, outputs, scratch)
    buffers: dict[tuple[str, int], tuple[tuple[int, ...], Any]] = dataclasses.field(default_factory=dict)
    # program order: ("dma_start", src_key, src_range, dst_key, dst_range) | ("load", key, range)
    events: list[tuple] = dataclasses.field(default_factory=list)
    # DMAs as executed: (src_key, src_range, dst_key, nbytes)
    copies: list[tuple] = dataclasses.field(default_factory=list)

    def keys_with_shape(self, shape: tuple[int, ...], space: str | None = None) -> list[tuple[str, int]]:
        return [k for k, (s, _) in self.buffers.items()
                if tuple(s) == tuple(shape) and (space is None or k[0] == space)]

    def bytes_from(self, keys) -> int:
        keys = set(keys)
        return sum(n for src, _, _, n in self.copies if src in keys)

    def bytes_to(self, keys) -> int:
        keys = set(keys)
        return sum(n for _, _, dst, n in self.copies if dst in keys)


_active: list[Trace] = []  # the trace being recorded (wrappers baked into compiled kernels check this)


def _wrap(fn, record):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        if _active:
            record(_active[-1], out, *args, **kwargs)
        return out
    # DMAs call `get.__wrapped__` / `store.__wrapped__` directly; keep those unrecorded
    wrapper.__wrapped__ = getattr(fn, "__wrapped__", fn)
    return wrapper


def _record_alloc(trace, out, token, device_id, local_core_id, memory_space, val, source_info=None):
    trace.buffers[(_space(memory_space), int(out[1]))] = (tuple(np.shape(val)), np.asarray(val).dtype)


def _record_dma_start(trace, out, token, device_id, src_local_core_id, src_memory_space, src_id, src_transforms,
                      dst_memory_space, dst_id, dst_transforms, *rest, **kwargs):
    trace.events.append(("dma_start", (_space(src_memory_space), int(src_id)), _range(src_transforms),
                         (_space(dst_memory_space), int(dst_id)), _range(dst_transforms)))


def _record_get(trace, out, token, device_id, local_core_id, memory_space, buffer_id, transforms, *rest, **kw):
    trace.events.append(("load", (_space(memory_space), int(buffer_id)), _range(transforms)))


@contextlib.contextmanager
def trace_interpreter():
    """Record what interpreted kernels traced inside this context do (see the module docstring)."""
    trace = Trace()
    originals = {name: getattr(_ipc, name) for name in ("_allocate_buffer", "dma_start", "get")}
    original_read = _ipc.DMA.execute_read

    def execute_read(self):
        was_started = self.state == _ipc.DmaState.STARTED
        original_read(self)
        if _active and was_started and self.data is not None:
            _active[-1].copies.append(((_space(self.src_memory_space), self.src_buffer_id),
                                       tuple(_iutils.to_range(self.src_transforms)),
                                       (_space(self.dst_memory_space), self.dst_buffer_id), int(self.data.nbytes)))

    _ipc._allocate_buffer = _wrap(originals["_allocate_buffer"], _record_alloc)
    _ipc.dma_start = _wrap(originals["dma_start"], _record_dma_start)
    _ipc.get = _wrap(originals["get"], _record_get)
    _ipc.DMA.execute_read = execute_read
    _active.append(trace)
    try:
        yield trace
    finally:
        _active.remove(trace)
        for name, fn in originals.items():
            setattr(_ipc, name, fn)
        _ipc.DMA.execute_read = original_read
