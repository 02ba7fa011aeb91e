"""Host memory that two processes share, without filling /dev/shm.

torch's `share_memory_()` (and its pickling of tensors for a spawned process) puts them in /dev/shm, a tmpfs that a
Docker container sizes at 64 MB unless `--shm-size` says more: a 113M float32 policy is 450 MB. Past the space it
raises `unable to allocate shared memory(shm) ... No space left on device`, which is how `python src/train.py
mode=async` ended in a 256 KB /dev/shm (2026-12-04). A memfd (memfd_create) is the same memory (shmem pages, counted
against the process's memory cgroup, freed when no process holds them), with no mount to fill:

- `SharedBlock`: named tensors laid out in one memfd, which a forked process inherits mapped and a spawned one
  receives as a file descriptor (multiprocessing's DupFd) and maps again.
- `share_in_place(params)`: parameters moved into one, in place (`p.data`, as `Module.to` moves them): the same
  Parameter objects, so the optimizer and a tied head keep them; a process forked after reads each update's values.
- `through_memfd(model)`: a model for a spawned process, saved into a memfd whose descriptor the process inherits.

Without memfd_create (not Linux) they fall back to torch's own shared memory, as before.
"""

from __future__ import annotations

import copy
import os
import weakref
from multiprocessing.reduction import DupFd

import torch


class SharedBlock:
    """Tensors of the given shapes and dtypes, zeroed, in one memfd: `tensors[name]`.

    A forked process inherits the mapping (the same memory); pickled for a spawned one (its arguments), the memfd's
    descriptor goes with it and the process maps it again. Freed when no process holds the descriptor or a mapping.
    """

    ALIGN = 64  # every tensor starts at a multiple: whole cache lines, and any dtype's element size

    def __init__(self, layout: dict[str, tuple[tuple[int, ...], torch.dtype]], name: str = "rlhflab") -> None:
        self.layout = {n: (tuple(shape), dtype) for n, (shape, dtype) in layout.items()}
        self.fd = None
        if not hasattr(os, "memfd_create"):  # torch's shared memory, which it pickles for a spawned process itself
            self.tensors = {n: torch.zeros(shape, dtype=dtype).share_memory_()
                            for n, (shape, dtype) in self.layout.items()}
            return
        self.fd = os.memfd_create(name)
        weakref.finalize(self, os.close, self.fd)
        os.ftruncate(self.fd, self._size())
        self._map()

    def _spans(self):
        offset = 0
        for name, (shape, dtype) in self.layout.items():
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            yield name, offset, nbytes
            offset += -(-nbytes // self.ALIGN) * self.ALIGN

    def _size(self) -> int:
        """The memfd's bytes: the spans', and at least one line (an empty layout still maps)."""
        return max((offset + nbytes for _, offset, nbytes in self._spans()), default=0) or self.ALIGN

    def _map(self) -> None:
        data = torch.from_file(f"/proc/self/fd/{self.fd}", shared=True, size=self._size(), dtype=torch.uint8)
        self.tensors = {name: data[offset:offset + nbytes].view(self.layout[name][1]).view(self.layout[name][0])
                        for name, offset, nbytes in self._spans()}

    def __getstate__(self) -> dict:
        if self.fd is None:
            return {"layout": self.layout, "tensors": self.tensors}
        return {"layout": self.layout, "fd": DupFd(self.fd)}

    def __setstate__(self, state: dict) -> None:
        self.layout = state["layout"]
        if "tensors" in state:
            self.fd, self.tensors = None, state["tensors"]
            return
        self.fd = state["fd"].detach()
        weakref.finalize(self, os.close, self.fd)
        self._map()


def share_in_place(params) -> None:
    """Move the parameters' data into shared memory, in place (`p.data`, as `Module.to` moves a module's): one memfd
    for all of them, each Parameter the same object (its optimizer, its grad accumulator and a tied head keep it). A
    process forked after this sees every later in-place update. Those already shared stay where they are."""
    params = [p for p in {id(p): p for p in params}.values() if not p.is_shared()]
    if not params:
        return
    if not hasattr(os, "memfd_create"):
        for p in params:
            p.data.share_memory_()
        return
    block = SharedBlock({str(i): (p.shape, p.dtype) for i, p in enumerate(params)}, "rlhflab-params")
    with torch.no_grad():
        for i, p in enumerate(params):
            block.tensors[str(i)].copy_(p.data)
            p.data = block.tensors[str(i)]


class _SavedModel:
    """What pickles a model as a memfd holding its torch.save (see through_memfd)."""

    def __init__(self, model) -> None:
        self.fd = os.memfd_create("rlhflab-model")
        with open(self.fd, "wb", closefd=False) as f:
            torch.save(model, f)
        self.close = weakref.finalize(self, os.close, self.fd)

    def __reduce__(self):
        return _load_model, (DupFd(self.fd),)


def _load_model(fd):
    with open(fd.detach(), "rb") as f:
        f.seek(0)  # the descriptor shares its offset with the learner's, which wrote it to the end
        return torch.load(f, map_location="cpu", weights_only=False)


class _HostCopy:
    """Without memfd_create: a host copy of the model, which torch pickles through its shared memory."""

    def __init__(self, model) -> None:
        self.model = copy.deepcopy(model).to("cpu")

    def __reduce__(self):
        return _unwrap, (self.model,)

    def close(self) -> None:
        self.model = None


def _unwrap(model):
    return model


def through_memfd(model) -> _SavedModel | _HostCopy:
    """`model` for a spawned process's arguments: unpickled there as the model (on the CPU), read from a memfd rather
    than from the /dev/shm copies torch's pickling of each tensor makes. Close it (`.close()`) once the process has
    started; until then it holds one host copy of the model's tensors."""
    return _SavedModel(model) if hasattr(os, "memfd_create") else _HostCopy(model)
