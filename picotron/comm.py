"""The collectives the course uses, each one counted.

Every parallel technique is a choice of which collective moves which tensor when. To put
a measured number next to a technique's cost formula, each wrapper here records the call
and the bytes of the real tensor this rank hands to it, into every `CommCounter` that a caller
has opened with `counting`:

    with comm.counting(mesh.counter):        # or `with comm.counting() as counter:`
        loss = model(x).sum(); loss.backward()
    print(mesh.counter.table())

The techniques never see the counter: their signatures are (tensor, group), and measuring is
something the caller switches on around them. Nothing is estimated: a tensor of 1 MiB passed to
`all_reduce` counts 1 MiB, whatever algorithm the backend then runs.

What "payload bytes" means for each operation (bytes of the data this rank contributes):

    all_reduce, reduce          the tensor
    broadcast, scatter          the tensor(s) on the source rank, 0 elsewhere
    all_gather                  this rank's input shard (the output is world times larger)
    reduce_scatter              this rank's full input (the output is world times smaller)
    gather                      this rank's tensor
    all_to_all                  this rank's whole input
    send / recv                 the tensor / 0

The wire traffic of an algorithm is a multiple of these: a ring all-reduce of S bytes
sends 2 (N-1)/N * S per rank (Playbook, "A quick focus on collective operations").
Chapter 00 measures that directly.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

# torch 2.13 renamed the *_tensor collectives to *_single; 2.11 (our GPU machine) only has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommCounter:
    """Calls and payload bytes per operation, for this rank. Owned by the caller, never global."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()

    def record(self, op: str, nbytes: int) -> None:
        self.calls[op] += 1
        self.bytes[op] += int(nbytes)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def snapshot(self) -> dict:
        """A plain dict ({op: (calls, bytes)}) that can be returned from a rank."""
        return {op: (self.calls[op], self.bytes[op]) for op in sorted(self.calls)}

    def table(self) -> str:
        rows = [f"{'operation':<16}{'calls':>8}{'payload MiB':>14}"]
        rows += [f"{op:<16}{calls:>8}{nbytes / 2**20:>14.3f}" for op, (calls, nbytes) in self.snapshot().items()]
        return "\n".join(rows)

    def __repr__(self) -> str:
        return f"CommCounter({self.snapshot()})"


# The counters open now, outermost first. One list for the whole process, not one per thread: the
# collectives of a backward pass (gradient hooks, the backward of an autograd Function) run on
# autograd's threads, and a rank is a process of its own, so process-wide is exactly "this rank".
_open_counters: list[CommCounter] = []


@contextmanager
def counting(counter: CommCounter | None = None) -> Iterator[CommCounter]:
    """Record every collective this rank issues inside the block into `counter` (a new one if None).

    Blocks nest: a collective is recorded once into each counter open at the time.
    """
    counter = CommCounter() if counter is None else counter
    _open_counters.append(counter)
    try:
        yield counter
    finally:
        _open_counters.pop(len(_open_counters) - 1 - _open_counters[::-1].index(counter))


def record(op: str, *tensors: torch.Tensor) -> None:
    """Count one call of `op` with these tensors' payload bytes into every open counter. The wrappers
    below call it; so does code that posts its own transfers (an isend of a pipeline or a ring).

    Inside code that torch.compile traces (picotron.train's --compile layers) nothing is recorded: the
    compiled graph runs its collectives without Python, so there is nothing to count them with. Count
    an eager run (the same collectives, the same bytes).
    """
    if torch.compiler.is_compiling():
        return
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    for counter in {id(c): c for c in _open_counters}.values():   # each counter once, however often it is open
        counter.record(op, nbytes)


def all_reduce(tensor, group=None, op=ReduceOp.SUM, *, async_op=False):
    """Every rank ends with the reduction (sum by default) of everyone's `tensor`, in place."""
    record("all_reduce", tensor)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor, src, group=None, *, async_op=False):
    """Every rank ends with global rank `src`'s `tensor`, in place."""
    record("broadcast", *([tensor] if dist.get_rank() == src else []))
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def reduce(tensor, dst, group=None, op=ReduceOp.SUM, *, async_op=False):
    """Global rank `dst` ends with the reduction of everyone's `tensor`; the others' are scratch."""
    record("reduce", tensor)
    return dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)


def all_gather(output, input, group=None, *, async_op=False):
    """`output` (world x input's numel, rank-major) gets every rank's `input`."""
    record("all_gather", input)
    return _all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter(output, input, group=None, op=ReduceOp.SUM, *, async_op=False):
    """Reduce everyone's `input` and give rank i the i-th 1/world slice of it in `output`."""
    record("reduce_scatter", input)
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def gather(tensor, gather_list=None, dst=0, group=None, *, async_op=False):
    """Global rank `dst` gets every rank's `tensor` in `gather_list` (None on other ranks)."""
    record("gather", tensor)
    return dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor, scatter_list=None, src=0, group=None, *, async_op=False):
    """Rank i gets `scatter_list[i]` from global rank `src` in `tensor`."""
    record("scatter", *(scatter_list or []))
    return dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


def all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, *,
               async_op=False):
    """Rank i sends the j-th chunk of `input` to rank j and receives rank j's i-th chunk."""
    record("all_to_all", input)
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                  group=group, async_op=async_op)


def send(tensor, dst, group=None):
    record("send", tensor)
    dist.send(tensor, dst=dst, group=group)


def recv(tensor, src, group=None):
    record("recv")
    dist.recv(tensor, src=src, group=group)


def send_recv(send_tensor, dst, recv_tensor, src, group=None):
    """Send to `dst` and receive from `src` at the same time (a ring step); both block until done.

    Posting both before waiting is what keeps a ring from deadlocking: if every rank first
    sent and only then received, every rank would wait for a receiver that is itself sending.
    """
    record("send", send_tensor)
    ops = [dist.P2POp(dist.isend, send_tensor, dst, group), dist.P2POp(dist.irecv, recv_tensor, src, group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()


def wait_all(requests: Iterable) -> None:
    for request in requests:
        if request is not None:
            request.wait()


def ring_all_reduce(tensor, group=None):
    """Sum `tensor` over the ranks of `group`, in place, with a ring built from `send_recv`.

    The tensor is cut into N chunks (N = ranks in the group; when N does not divide the size,
    the first size % N chunks are one element longer). Rank r sends to r+1 and receives from r-1.

    - reduce-scatter, N-1 steps: at step s rank r sends its running sum of chunk (r - s) % N
      and adds the incoming partial sum of chunk (r - s - 1) % N to its own. Afterwards rank r
      holds the complete sum of chunk (r + 1) % N.
    - all-gather, N-1 steps: the finished chunks go once more round the ring, each rank
      overwriting its stale copy with the one it receives.

    Each rank sends 2 (N-1) chunks, 2 (N-1)/N of the tensor's bytes, whatever N is: the least any
    all-reduce can send (Patarasuk and Yuan 2009; Playbook appendix A0, "A quick focus on Ring
    AllReduce"). The price is 2 (N-1) latencies in a row. The counter records the sends ("send").
    """
    world = dist.get_world_size(group)
    if world == 1:
        return tensor
    group = group if group is not None else dist.group.WORLD
    me = dist.get_rank(group)
    right = dist.get_global_rank(group, (me + 1) % world)
    left = dist.get_global_rank(group, (me - 1) % world)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)  # a copy if strided
    chunks = torch.tensor_split(flat, world)  # views into flat, sizes differ by at most one
    incoming = torch.empty_like(chunks[0])     # chunk 0 is the longest
    for step in range(world - 1):              # reduce-scatter
        send, recv = chunks[(me - step) % world], chunks[(me - step - 1) % world]
        send_recv(send, right, incoming[: recv.numel()], left, group)
        recv += incoming[: recv.numel()]
    for step in range(world - 1):              # all-gather
        send, recv = chunks[(me + 1 - step) % world], chunks[(me - step) % world]
        send_recv(send, right, recv, left, group)
    if not tensor.is_contiguous():             # the sum was made in a copy
        tensor.copy_(flat.view(tensor.shape))
    return tensor
