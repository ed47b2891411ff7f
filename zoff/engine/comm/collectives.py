"""Collectives over flat buffers, with per-backend implementations and traffic accounting.

Traffic is counted in the ZeRO papers' unit: elements of the full buffer that a ring algorithm moves per
rank, i.e. all-reduce(n) = 2n, reduce-scatter(n) = n, all-gather(n) = n. That makes stage 1/2 (RS + AG) equal
to DDP's all-reduce (2 psi) and stage 3 equal to 3 psi, whatever the backend does underneath.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from zoff.engine.comm.not_answering import not_answering
from zoff.engine.pool import BufferPool


@dataclass
class CommStats:
    elements: dict[str, int] = field(default_factory=dict)  # logical elements per collective kind
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, n: int) -> None:
        self.elements[kind] = self.elements.get(kind, 0) + n
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def total(self) -> int:
        return sum(self.elements.values())

    def reset(self) -> None:
        self.elements.clear()
        self.calls.clear()


class Handle:
    """An in-flight collective; wait() blocks until done and runs the finishing step (if any) once.

    `after` chains a handle: the new one waits for `after` before its own finishing step.
    """

    def __init__(
        self,
        work=None,
        then: Callable[[], None] | None = None,
        after: Handle | None = None,
        explain: Callable[[BaseException], BaseException] | None = None,
    ):
        # `work` is one torch Work or a list of them (the sends and receives of a point-to-point exchange).
        self._works = list(work) if isinstance(work, list | tuple) else [] if work is None else [work]
        self._then, self._after, self._explain = then, after, explain

    def poll(self) -> bool:
        """Finish without blocking if the collective is done; True once finished."""
        if self._after is not None and not self._after.poll():
            return False
        if not all(w.is_completed() for w in self._works):
            return False
        self.wait()
        return True

    def wait(self, host_timeout_s: float | None = None) -> None:
        """Block until done. NCCL's wait() only orders the current CUDA stream after the collective; with
        `host_timeout_s` the host itself waits (at most that long), so a peer that never joins surfaces here
        as a CollectiveError instead of a hang at the next host read or the watchdog's abort."""
        if self._after is not None:
            self._after.wait()
            self._after = None
        timeout = {} if host_timeout_s is None else {"timeout": timedelta(seconds=host_timeout_s)}
        while self._works:
            try:
                self._works[0].wait(**timeout)
            except RuntimeError as e:
                raise (self._explain(e) if self._explain else e) from e
            self._works.pop(0)
        if self._then is not None:
            then, self._then = self._then, None
            then()


DONE = Handle()


class Comm:
    """The data-parallel group as the engine sees it: rank, size and the three ZeRO collectives."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        timeout_s: float | None = None,
        side_checks: bool | None = None,
    ):
        self.timeout_s = timeout_s
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.backend = dist.get_backend(group) if self.distributed else "none"
        # NCCL reduces only device tensors (also the few scalars of sum_scalars); gloo takes host ones.
        nccl = self.backend == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.stats = CommStats()
        self.scratch = BufferPool()  # gloo reduce-scatter's receive slices, reused across steps
        # Point-to-point tags per stream: stage 3's gathers run on their own, so a reduction one rank starts
        # earlier than another (its data completed the unit sooner) can never pair with a gather.
        self._tags = dict.fromkeys(STREAMS, 0)
        # NCCL has no tags: one communicator runs its collectives in issue order, and stage 3's gathers and the
        # reductions may be issued in different interleavings on different ranks (a rank whose unit completed
        # sooner). The gathers get a communicator of their own, as the "gather" tag stream does on gloo.
        # Cost: a second NCCL communicator (its buffers, ~100s of MB of GPU memory at large scale).
        self.gather_group = self.group
        ranks = None
        if self.world > 1:
            ranks = (
                list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
            )
        if nccl and self.world > 1:
            self.gather_group = dist.new_group(ranks, backend="nccl")
        # Stage 3's same-gathers check (exchange_codes) sends tagged host integers, which NCCL cannot: there it
        # runs over a gloo group of the same ranks, and the names are checked before the NCCL gather is issued
        # (an NCCL collective cannot be taken back: one a peer never joins holds the group until the watchdog).
        # Cost: one gloo round trip (8 bytes per peer) on the host before each stage-3 gather, ahead of the
        # GPU's work. `side_checks` forces that path on gloo too, so the CPU tests run the NCCL code.
        self.side_checks = nccl if side_checks is None else side_checks
        self.check_group = self.group
        if self.side_checks and self.world > 1:
            timeout = timedelta(seconds=timeout_s) if timeout_s else None
            self.check_group = dist.new_group(
                ranks, backend="gloo", **({"timeout": timeout} if timeout else {})
            )

    def all_reduce(self, t: torch.Tensor, async_op: bool = False) -> Handle:
        self.stats.add("all_reduce", 2 * t.numel())
        if self.world == 1:
            return DONE
        return self._run("all_reduce", lambda: dist.all_reduce(t, group=self.group, async_op=async_op))

    def reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, async_op: bool = False) -> Handle:
        """Sum `full` across ranks and leave this rank's slice (len(full) / world) in `out`.

        `full` must stay untouched until the handle completes; `out` may alias this rank's slice of it. gloo
        has no native reduce-scatter (torch emulates it with an all-reduce-sized exchange): see _exchange.
        """
        self.stats.add("reduce_scatter", full.numel())
        n = out.numel()
        if self.world == 1:
            if out.data_ptr() != full.data_ptr():
                out.copy_(full[:n])
            return DONE
        if self.backend == "nccl":
            return self._run(
                "reduce_scatter",
                lambda: dist.reduce_scatter_tensor(out, full, group=self.group, async_op=async_op),
            )
        mine = full[self.rank * n : (self.rank + 1) * n]
        aliased = out.data_ptr() == mine.data_ptr()
        peers = [q for q in range(self.world) if q != self.rank]
        # The first peer's slice lands straight in `out` when it is a separate buffer: one scratch fewer.
        scratch = [self.scratch.take(n, out.dtype) for _ in peers[0 if aliased else 1 :]]
        recv = scratch if aliased else [out, *scratch]

        def finish() -> None:
            acc = mine if aliased else out.add_(mine)
            for buf in scratch:
                acc.add_(buf)
                self.scratch.give(buf)

        sends = [(full[q * n : (q + 1) * n], q, 0) for q in peers]
        return self._exchange(
            "reduce_scatter", sends, [(t, q, 0) for t, q in zip(recv, peers)], finish, async_op
        )

    def reduce_scatter_chunks(
        self, chunks: list[tuple[int, torch.Tensor]], out: torch.Tensor, async_op: bool = False
    ) -> Handle:
        """reduce_scatter of a buffer given as separate 1-D chunks (start, tensor), zeros wherever none lies.

        Every rank must pass the same starts and lengths; the logical buffer is world * len(out) long. On
        gloo each piece of a chunk goes straight to the rank that owns it, so a caller with per-parameter
        gradients sends them as they are: no bucket to copy them into and keep (one pass and a bucket of
        memory fewer per reduction). Cost: one message per piece instead of one per peer (~tens of us each,
        a few dozen per unit of a transformer block). Pieces are numbered in chunk order, the same on every
        rank, and each travels under its own tag.
        """
        if self.backend == "nccl":
            raise NotImplementedError("reduce_scatter_chunks is for gloo; NCCL reduce-scatters flat buckets")
        n = out.numel()
        self.stats.add("reduce_scatter", n * self.world)
        if n == 0:
            return DONE
        pieces = []  # (owner, start in the owner's slice, piece), in chunk order
        for start, t in chunks:
            at = 0
            while at < t.numel():
                owner, lo = divmod(start + at, n)
                length = min(t.numel() - at, n - lo)
                pieces.append((owner, lo, t[at : at + length]))
                at += length
        mine = [(k, lo, t) for k, (q, lo, t) in enumerate(pieces) if q == self.rank]
        covered = sorted((lo, lo + t.numel()) for _, lo, t in mine)
        edge = 0
        for lo, hi in [*covered, (n, n)]:  # nothing is received where no chunk lies: those sums are zero
            if lo > edge:
                out[edge:lo].zero_()
            edge = max(edge, hi)
        if self.world == 1:
            for _, lo, t in mine:
                out[lo : lo + t.numel()].copy_(t)
            return DONE
        peers = [q for q in range(self.world) if q != self.rank]
        # As in reduce_scatter: the first peer's pieces land in `out`, the others' in scratch slices.
        scratch = [self.scratch.take(n, out.dtype) for _ in peers[1:]]
        recvs = [(out[lo : lo + t.numel()], peers[0], k) for k, lo, t in mine]
        recvs += [(buf[lo : lo + t.numel()], q, k) for buf, q in zip(scratch, peers[1:]) for k, lo, t in mine]
        sends = [(t, q, k) for k, (q, _, t) in enumerate(pieces) if q != self.rank]

        def finish() -> None:
            for _, lo, t in mine:
                out[lo : lo + t.numel()].add_(t)
            for buf in scratch:
                for lo, hi in covered:
                    out[lo:hi].add_(buf[lo:hi])
                self.scratch.give(buf)

        return self._exchange("reduce_scatter", sends, recvs, finish, async_op, tags=len(pieces))

    def all_gather(
        self, shard: torch.Tensor, full: torch.Tensor, async_op: bool = False, stream: str = "main"
    ) -> Handle:
        """Concatenate every rank's `shard` into `full` (which may alias this rank's shard slot).

        `stream` "gather" is stage 3's: every rank issues those in one order and the others in another, but
        the two orders may interleave differently from rank to rank."""
        self.stats.add("all_gather", full.numel())
        if self.world == 1:
            if shard.data_ptr() != full.data_ptr():
                full[: shard.numel()].copy_(shard)
            return DONE
        n = shard.numel()
        if self.backend == "nccl":
            group = self.gather_group if stream == "gather" else self.group
            return self._run(
                "all_gather",
                lambda: dist.all_gather_into_tensor(full, shard, group=group, async_op=async_op),
            )
        mine = full[self.rank * n : (self.rank + 1) * n]
        if shard.data_ptr() != mine.data_ptr():
            mine.copy_(shard)
        peers = [q for q in range(self.world) if q != self.rank]
        recv = [(full[q * n : (q + 1) * n], q, 0) for q in peers]
        return self._exchange(
            "all_gather", [(mine, q, 0) for q in peers], recv, None, async_op, stream=stream
        )

    def exchange_codes(self, code: int, stream: str = "gather") -> tuple[Handle, torch.Tensor | None]:
        """Send `code` to every peer and receive theirs (stage 3 names each gather by its unit this way, so a
        rank that gathers another unit, or none, is found at once instead of pairing the wrong buffers or
        waiting for a partner that never comes): (handle, the codes by rank, own included), or (DONE, None)
        at world 1. Over `check_group`: the data group on gloo, a gloo group beside it on NCCL."""
        if self.world == 1:
            return DONE, None
        codes = torch.full((self.world,), code, dtype=torch.int64)
        peers = [q for q in range(self.world) if q != self.rank]
        sends = [(codes[self.rank : self.rank + 1], q, 0) for q in peers]
        recvs = [(codes[q : q + 1], q, 0) for q in peers]
        return self._exchange(
            "gather_check", sends, recvs, None, True, stream=stream, group=self.check_group
        ), codes

    def confirm(self) -> None:
        """Hold until every peer has reached this call too (or has left), at most the collective timeout.

        A rank that found an error its peers find from the same message (stage 3's gather checks) calls this
        before raising: leaving at once, it could tear down the connections (the launcher stops every rank
        when one fails; the store host takes the store with it) while a slower peer has not yet read the
        codes that name the error. Every rank calls it once per error, so the round pairs by its own tag
        stream whatever gathers were still in flight. A peer that died or left first does not hold this rank:
        its failure is ignored here (this rank's own error is what it raises next)."""
        if self.world == 1:
            return
        flag = torch.ones(self.world, dtype=torch.int64)
        peers = [q for q in range(self.world) if q != self.rank]
        sends = [(flag[self.rank : self.rank + 1], q, 0) for q in peers]
        recvs = [(flag[q : q + 1], q, 0) for q in peers]
        try:
            handle = self._exchange(
                "confirm", sends, recvs, None, True, stream="confirm", group=self.check_group, explained=False
            )
            handle.wait(self.timeout_s)
        except RuntimeError:  # a peer that is gone has nothing left to read
            pass

    def _exchange(
        self,
        kind: str,
        sends: list[tuple[torch.Tensor, int, int]],
        recvs: list[tuple[torch.Tensor, int, int]],
        then: Callable[[], None] | None,
        async_op: bool,
        tags: int = 1,
        stream: str = "main",
        group: dist.ProcessGroup | None = None,
        explained: bool = True,
    ) -> Handle:
        """gloo reduce-scatter / all-gather as direct sends of each rank's slice to its owner (over `group`,
        default the data group).

        Each rank sends and receives (N-1)/N of the buffer, like a ring, and reduces only its own slice. The
        alternatives measured on 2 ranks, 28M fp32 elements: all-reduce 114 ms (what a reduce-scatter or an
        all-gather cost here before), this reduce-scatter 76 ms, this all-gather 47 ms, gloo's
        all_gather_into_tensor 321 ms. Cost: N-1 scratch slices for a reduce-scatter into an aliased output,
        and N-1 concurrent connections per rank (fine for data-parallel widths, not for thousands of ranks).
        Items are (tensor, peer, k). Every rank issues its collectives in the same order, so a block of
        `tags` tags per call, k picking one, pairs each send with its receive. `explained` False: a failure
        raises as it is, without asking the store which ranks are not answering (see _run).
        """
        at = self._tags[stream]
        self._tags[stream] = (at + tags) % _TAGS_PER_STREAM
        base = STREAMS.index(stream) * _TAGS_PER_STREAM + at
        group = self.group if group is None else group
        peer = (lambda q: dist.get_global_rank(group, q)) if group is not None else (lambda q: q)

        def issue() -> list:
            works = [dist.irecv(t, peer(q), group=group, tag=base + k) for t, q, k in recvs]
            return works + [dist.isend(t, peer(q), group=group, tag=base + k) for t, q, k in sends]

        handle = self._run(kind, issue, then, explained)
        if not async_op:
            handle.wait()
            return DONE
        return handle

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        if self.world > 1:
            self._run("broadcast", lambda: dist.broadcast(t, src=src, group=self.group))

    def sum_scalars(self, values: list[float]) -> list[float]:
        """All-reduce a few float64 scalars (squared norms, overflow flags) in one call; not counted as traffic."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            handle = self._run("all_reduce", lambda: dist.all_reduce(t, group=self.group, async_op=True))
            handle.wait(self.timeout_s if self.backend == "nccl" else None)
        return t.tolist()

    def _run(
        self,
        kind: str,
        issue: Callable[[], object],
        then: Callable[[], None] | None = None,
        explained: bool = True,
    ) -> Handle:
        """Issue a collective; its failure is explained (_explain: which ranks are not answering) unless
        `explained` is False, for a round whose failure the caller expects and ignores."""
        explain = (lambda e: self._explain(kind, e)) if explained else (lambda e: e)  # noqa: E731
        try:
            work = issue()
        except RuntimeError as e:
            raise explain(e) from e
        if work is None or work == []:  # synchronous call already completed
            if then is not None:
                then()
            return DONE
        return Handle(work, then, explain=explain)

    def _explain(self, kind: str, error: BaseException) -> BaseException:
        """Turn a collective's failure into an error naming it and the ranks that did not answer."""
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        limit = f" within the {self.timeout_s:g}s timeout" if self.timeout_s else ""
        return CollectiveError(
            f"{kind} failed on rank {self.rank} of {self.world}{limit}; rank(s) not answering: "
            f"{not_answering(self.rank, self.world, kind)} ({first})"
        )


STREAMS = ("main", "gather", "confirm")
_TAGS_PER_STREAM = 1 << 23


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the collective and the suspect ranks."""
