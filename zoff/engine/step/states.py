"""The states interface: what the optimizer and the engine ask of a rank's optimizer states (each unit's fp32
master, exp_avg and exp_avg_sq), wherever its tier keeps them.

Beside the tier interface (tiers.py): a tier makes its States (Tier.make_states), and the optimizer and the
engine use them only through these methods, never asking which kind they have. The defaults are those of
states held in memory: nothing to read ahead, no swap file, no disk bytes, no file to copy for a checkpoint.
The disk tier's SwappedStates (disk/state_swap.py) overrides them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

KINDS = ("master", "exp_avg", "exp_avg_sq")

Span = tuple[int, int, int]  # (piece, lo, hi): a piece of a unit, its shard's elements [lo, hi)


class States:
    """A rank's optimizer states, unit by unit, each unit in one or more pieces."""

    # every unit's states as tensors in memory; None where they are not all there (read() and write() them)
    masters: list[torch.Tensor] | None = None
    exp_avg: list[torch.Tensor] | None = None
    exp_avg_sq: list[torch.Tensor] | None = None

    def spans(self, i: int) -> list[Span]:
        """Unit i's pieces, in the walk's order."""
        raise NotImplementedError

    def open(self, k: int, write_back: bool = True) -> contextlib.AbstractContextManager:
        """Piece k's (master, exp_avg, exp_avg_sq), in memory while the block runs; `write_back=False`: only
        read."""
        raise NotImplementedError

    def read(self, i: int, kind: str) -> torch.Tensor:
        """One kind of unit i's states (KINDS)."""
        raise NotImplementedError

    def write(self, i: int, kind: str, src: torch.Tensor) -> None:
        raise NotImplementedError

    def resident_bytes(self, shards: list[torch.Tensor]) -> int:
        """Bytes of memory the states hold (`shards`: the live shards, which fp32 may step in place)."""
        raise NotImplementedError

    def prefetch(self) -> None:
        """Start reading the next walk's first pieces (the engine calls it as a step's backward starts)."""

    @property
    def files(self) -> list:
        """The swap files the states live in (their I/O counters are the step's disk report)."""
        return []

    def disk_bytes(self) -> int:
        return 0

    def save_file(self, path: Path) -> str | None:
        """The states copied file to file into a checkpoint shard (its sha256), or None: the checkpoint
        streams them unit by unit."""
        return None

    def load_file(self, path: Path) -> str | None:
        """The states copied from a checkpoint shard laid out as their file (its sha256), or None: not loaded."""
        return None

    def close(self) -> None:
        """Release what outlives the process's memory (a swap file)."""

    # ---------------------------------------------------------- speculation (step/speculate.py)
    def speculable(self, k: int) -> bool:
        """Piece k has a second place that a speculative update may be computed into."""
        return False

    def speculate(self, k: int, after: int | None = None) -> contextlib.AbstractContextManager:
        """Piece k's (master, exp_avg, exp_avg_sq) as copies to update in place while the block runs; the
        result stays in the piece's second place, invisible until commit(k). `after`: the piece the
        speculation takes next (the disk reads it meanwhile)."""
        raise NotImplementedError

    def commit(self, k: int) -> None:
        """Piece k's speculative result becomes its states (its second place the originals' next time)."""
        raise NotImplementedError

    def allocate_second(self) -> None:
        """Claim the second places' room before the first speculation (a disk's file); OSError if it cannot."""

    def end_speculation(self) -> None:
        """After the commits: every speculative result not committed is forgotten (the states are what they
        were) and its I/O has landed."""

    @property
    def keeps_speculated_master(self) -> bool:
        """A committed piece's master stays in RAM, readable by open() (else the speculation keeps the new
        parameters itself)."""
        return False


class ResidentStates(States):
    """Master, exp_avg and exp_avg_sq of every unit held in memory (device or host tier).

    Speculation (host tier): a second set of buffers per unit, allocated on its first speculation (12 B per
    element); commit swaps the moments' buffers with them, and the master's too unless the master is the live
    shard itself (`aliased`: fp32 on a host-only machine), which then takes a copy of the new master."""

    def __init__(self, masters: list[torch.Tensor], zeros, aliased: bool = False, speculable: bool = False):
        self.masters = masters
        self.exp_avg = [zeros(m) for m in masters]
        self.exp_avg_sq = [zeros(m) for m in masters]
        self._zeros, self._aliased, self._speculable = zeros, aliased, speculable
        self._second: dict[int, list[torch.Tensor]] = {}  # piece -> its second (master, exp_avg, exp_avg_sq)

    def speculable(self, k: int) -> bool:
        return self._speculable

    @contextlib.contextmanager
    def speculate(
        self, k: int, after: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        live = (self.masters[k], self.exp_avg[k], self.exp_avg_sq[k])
        second = self._second.get(k)
        if second is None:
            second = self._second[k] = [self._zeros(t) for t in live]
        for dst, src in zip(second, live, strict=True):
            dst.copy_(src)
        yield tuple(second)

    def commit(self, k: int) -> None:
        second = self._second[k]
        if self._aliased:
            self.masters[k].copy_(second[0])
        else:
            self.masters[k], second[0] = second[0], self.masters[k]
        self.exp_avg[k], second[1] = second[1], self.exp_avg[k]
        self.exp_avg_sq[k], second[2] = second[2], self.exp_avg_sq[k]

    @property
    def keeps_speculated_master(self) -> bool:
        return True

    def spans(self, i: int) -> list[Span]:
        """Unit i is one piece, resident whole."""
        return [(i, 0, self.masters[i].numel())]

    @contextlib.contextmanager
    def open(
        self, k: int, write_back: bool = True
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        yield self.masters[k], self.exp_avg[k], self.exp_avg_sq[k]

    def read(self, i: int, kind: str) -> torch.Tensor:
        return (self.masters, self.exp_avg, self.exp_avg_sq)[KINDS.index(kind)][i]

    def write(self, i: int, kind: str, src: torch.Tensor) -> None:
        self.read(i, kind).copy_(src)

    def resident_bytes(self, shards: list[torch.Tensor]) -> int:
        masters = [m for m, s in zip(self.masters, shards) if m is not s]  # fp32 steps the shard in place
        second = [t for ts in self._second.values() for t in ts]
        return sum(t.numel() * t.element_size() for t in masters + self.exp_avg + self.exp_avg_sq + second)
