"""TokenRing: fixed preallocated message slots in shared memory, one writer and one reader.

Each slot is [seq, kind, step, n_ints, n_floats | ints | floats]. The writer marks a slot busy (seq = -1),
writes the payload, then publishes its sequence number; the reader copies a slot only when its seq is the one
it expects and re-checks it after the copy, so a stale slot is never consumed and an overwritten one is
detected. drafts/host.py defines the messages and wakes the reader through a pipe; the engine creates (and
unlinks) both rings, the host process attaches to them by name.
"""

from contextlib import suppress
from dataclasses import dataclass
import mmap
import os
import sys
from multiprocessing import shared_memory
from typing import Optional, Union

import numpy as np

HEADER_INTS = 5
BUSY = -1
TRACE_ENV = "MIRROR_MLX_TRACE_SHM"  # set: each ring made is named on stderr

class _Attached:
    """A segment mapped by name without registering it with this process's resource tracker."""

    def __init__(self, name: str):
        import _posixshmem  # (CPython's shm_open: SharedMemory(track=False) is 3.13+)

        fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.buf, self.name = memoryview(self._mmap), name

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()

    def unlink(self) -> None:
        raise RuntimeError("an attached ring is unlinked by the process that created it")


class RingOverwritten(RuntimeError):
    """The expected message was overwritten before it was read (the reader fell too far behind)."""


class RingFull(RuntimeError):
    """Writing would overwrite a message the reader has not consumed yet."""


@dataclass
class Message:
    seq: int
    kind: int
    step: int
    ints: np.ndarray
    floats: np.ndarray


class TokenRing:
    """One direction of the token channel: `put` on the writer side, `get` on the reader side."""

    def __init__(self, capacity: int = 8, max_ints: int = 1024, max_floats: int = 512,
                 name: Optional[str] = None, create: bool = True, track: bool = True):
        self.capacity, self.max_ints, self.max_floats = capacity, max_ints, max_floats
        self.slot_words = HEADER_INTS + max_ints + max_floats
        nbytes = 8 * (2 + capacity * self.slot_words)  # [next_seq, read_seq] + slots
        self.shm: Union[shared_memory.SharedMemory, _Attached]
        if create or track:
            self.shm = shared_memory.SharedMemory(name=name, create=create, size=nbytes if create else 0)
        else:  # another process created it and unlinks it: no resource tracker of ours may (Python < 3.13)
            assert name is not None, "a ring is attached by its name"
            self.shm = _Attached(name)
        self._words = np.ndarray((2 + capacity * self.slot_words,), dtype=np.int64, buffer=self.shm.buf)
        if create:
            if os.environ.get(TRACE_ENV):  # leak checks without /dev/shm (macOS): the names to look for afterwards
                print(f"mirror-mlx: shared memory made: {self.shm.name}", file=sys.stderr, flush=True)
            self._words[:] = 0
            self._words[2:].reshape(capacity, self.slot_words)[:, 0] = BUSY
        self._slots = self._words[2:].reshape(capacity, self.slot_words)
        # floats live in the same int64 words, reinterpreted: one float64 per word
        self._fslots = self._slots.view(np.float64)

    @property
    def name(self) -> str:
        return self.shm.name

    def put(self, kind: int, step: int, ints=(), floats=()) -> int:
        """Write one message; returns its sequence number (1, 2, ...)."""
        ints = np.asarray(ints, dtype=np.int64).ravel()
        floats = np.asarray(floats, dtype=np.float64).ravel()
        if ints.size > self.max_ints or floats.size > self.max_floats:
            raise ValueError(f"message of {ints.size} ints / {floats.size} floats exceeds the ring's slot size")
        seq, consumed = int(self._words[0]) + 1, int(self._words[1])
        if seq - consumed > self.capacity:
            raise RingFull(f"ring of {self.capacity} slots is full: message {consumed + 1} not read yet")
        slot = self._slots[seq % self.capacity]
        slot[0] = BUSY
        slot[1:HEADER_INTS] = (kind, step, ints.size, floats.size)
        slot[HEADER_INTS : HEADER_INTS + ints.size] = ints
        f0 = HEADER_INTS + self.max_ints
        self._fslots[seq % self.capacity, f0 : f0 + floats.size] = floats
        slot[0] = seq  # publish last
        self._words[0] = seq
        return seq

    def get(self, seq: int) -> Optional[Message]:
        """Read message `seq`, or None if it is not written yet (a stale slot is never consumed)."""
        row = seq % self.capacity
        slot = self._slots[row]
        found = int(slot[0])
        if found > seq:
            raise RingOverwritten(f"message {seq} was overwritten by message {found}")
        if found != seq:
            return None
        kind, step, n_i, n_f = slot[1:HEADER_INTS].tolist()
        f0 = HEADER_INTS + self.max_ints
        ints = slot[HEADER_INTS : HEADER_INTS + n_i].copy()
        floats = self._fslots[row, f0 : f0 + n_f].copy()
        if int(slot[0]) != seq:  # overwritten while copying
            raise RingOverwritten(f"message {seq} was overwritten while being read")
        self._words[1] = max(int(self._words[1]), seq)
        return Message(seq, kind, step, ints, floats)

    def close(self, unlink: bool = True) -> None:
        self._slots = self._fslots = self._words = None
        self.shm.close()
        if unlink:
            with suppress(FileNotFoundError):
                self.shm.unlink()
