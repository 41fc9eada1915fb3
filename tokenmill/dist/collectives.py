"""All-reduce written by tokenmill over point-to-point send/recv, beside the backend's own.

With p ranks and n bytes, in the alpha-beta model (a message costs alpha + size / beta):

    ring   reduce-scatter then all-gather around a ring: 2 (p - 1) steps of n / p bytes:
           2 (p - 1) alpha + 2 (p - 1) / p n / beta. Bandwidth-optimal; latency grows
           linearly with p.
    tree   reduce up a binary tree to rank 0, then broadcast down it, the message cut
           into segments that pipeline through the levels: about 2 (log2 p + s - 1)
           (alpha + n / (s beta)) for s segments. Logarithmic latency.
    rhd    recursive halving (reduce-scatter) then recursive doubling (all-gather),
           Rabenseifner's: 2 log2 p alpha + 2 (p - 1) / p n / beta; non-powers of two
           fold the extra ranks into partners first.

Each gives the same sum as the backend's up to float reassociation (tests/dist). They
take and return a tensor in place, like torch.distributed.all_reduce.

`reduce_scatter` (sequence parallelism) is the ring's first half: (p - 1) steps of
n / p bytes, after which rank r holds the sum of chunk r. NCCL has its own; gloo has
none, so there tokenmill's ring is the only one.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

ALGORITHMS = ("backend", "ring", "tree", "rhd")
# The tree pipelines messages in segments of about this many bytes.
TREE_SEGMENT_BYTES = 256 * 1024


def all_reduce(tensor: torch.Tensor, algorithm: str = "backend",
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum `tensor` over the ranks of `group`, in place; returns it."""
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    if algorithm == "backend":
        dist.all_reduce(tensor, group=group)
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
    rank = dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    if algorithm == "ring":
        _ring(flat, rank, size, ranks)
    elif algorithm == "tree":
        _tree(flat, rank, size, ranks)
    elif algorithm == "rhd":
        _rhd(flat, rank, size, ranks)
    else:
        raise ValueError(f"all_reduce: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | None = None
                   ) -> torch.Tensor:
    """Sum `tensor` over the ranks of `group` and return this rank's 1/p of the sum
    (chunk `rank` of its flattened elements; the size must divide evenly). `tensor` is
    used as scratch."""
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    if tensor.numel() % size:
        raise ValueError(f"reduce_scatter: {tensor.numel()} elements do not split over "
                         f"{size} ranks")
    rank = dist.get_rank(group)
    if dist.get_backend(group) == "nccl":
        out = tensor.new_empty(tensor.numel() // size)
        dist.reduce_scatter_tensor(out, tensor.contiguous().view(-1), group=group)
        return out
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    chunks = _chunks(tensor.contiguous().view(-1), size)
    right, left = ranks[(rank + 1) % size], ranks[(rank - 1) % size]
    # After step s, chunk (rank - s - 2) holds s + 2 ranks' sum; the last step ends on
    # chunk rank.
    for step in range(size - 1):
        send = chunks[(rank - step - 1) % size]
        target = chunks[(rank - step - 2) % size]
        incoming = torch.empty_like(target)
        _exchange(send, right, incoming, left)
        target.add_(incoming)
    return chunks[rank]


def _exchange(send: torch.Tensor, to: int, recv: torch.Tensor, frm: int) -> None:
    """Send to one rank and receive from another at once (no deadlock in a ring).
    Empty messages are skipped: both ends compute the same piece, so they agree."""
    requests = []
    if send.numel():
        requests.append(dist.isend(send.contiguous(), to))
    if recv.numel():
        requests.append(dist.irecv(recv, frm))
    for request in requests:
        request.wait()


def _chunks(flat: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """`parts` contiguous views covering flat (some may be empty)."""
    bounds = [len(flat) * i // parts for i in range(parts + 1)]
    return [flat[bounds[i]:bounds[i + 1]] for i in range(parts)]


def _ring(flat: torch.Tensor, rank: int, size: int, ranks: list[int]) -> None:
    chunks = _chunks(flat, size)
    right, left = ranks[(rank + 1) % size], ranks[(rank - 1) % size]
    # Reduce-scatter: after step s, chunk (rank - s - 1) holds s + 2 ranks' sum.
    for step in range(size - 1):
        send = chunks[(rank - step) % size]
        target = chunks[(rank - step - 1) % size]
        incoming = torch.empty_like(target)
        _exchange(send, right, incoming, left)
        target.add_(incoming)
    # All-gather: pass the fully reduced chunks around.
    for step in range(size - 1):
        send = chunks[(rank - step + 1) % size]
        target = chunks[(rank - step) % size]
        _exchange(send, right, target, left)


def _tree(flat: torch.Tensor, rank: int, size: int, ranks: list[int]) -> None:
    """Binary tree rooted at rank 0 (children 2i + 1, 2i + 2), segment by segment."""
    parent = (rank - 1) // 2 if rank else None
    children = [c for c in (2 * rank + 1, 2 * rank + 2) if c < size]
    element_bytes = flat.element_size()
    segments = max(1, min(len(flat), math.ceil(len(flat) * element_bytes / TREE_SEGMENT_BYTES)))
    for segment in _chunks(flat, segments):
        if not len(segment):
            continue
        for child in children:  # reduce up
            incoming = torch.empty_like(segment)
            dist.recv(incoming, ranks[child])
            segment.add_(incoming)
        if parent is not None:
            dist.send(segment, ranks[parent])
            dist.recv(segment, ranks[parent])  # the total, broadcast down
        for child in children:
            dist.send(segment, ranks[child])


def _rhd(flat: torch.Tensor, rank: int, size: int, ranks: list[int]) -> None:
    """Rabenseifner: fold to a power of two, halve (reduce-scatter), double (gather)."""
    power = 1 << (size.bit_length() - 1)
    extra = size - power
    # Ranks [0, 2 extra) pair up: odd ones hand their data to the even neighbour and
    # sit out; the rest are renumbered 0 .. power - 1.
    if rank < 2 * extra:
        if rank % 2:
            dist.send(flat, ranks[rank - 1])
            dist.recv(flat, ranks[rank - 1])
            return
        incoming = torch.empty_like(flat)
        dist.recv(incoming, ranks[rank + 1])
        flat.add_(incoming)
        virtual = rank // 2
    else:
        virtual = rank - extra

    def real(v: int) -> int:
        return ranks[2 * v if v < extra else v + extra]

    low, high = 0, len(flat)
    steps = []
    distance = power // 2
    while distance:  # recursive halving: keep one half, send the other
        partner = virtual ^ distance
        middle = (low + high) // 2
        keep_low = virtual < partner
        keep, give = ((low, middle), (middle, high)) if keep_low else ((middle, high),
                                                                        (low, middle))
        incoming = flat.new_empty(keep[1] - keep[0])
        _exchange(flat[give[0]:give[1]], real(partner), incoming, real(partner))
        flat[keep[0]:keep[1]].add_(incoming)
        steps.append((partner, keep, give))
        low, high = keep
        distance //= 2
    for partner, keep, give in reversed(steps):  # recursive doubling: gather back
        _exchange(flat[keep[0]:keep[1]], real(partner), flat[give[0]:give[1]], real(partner))
    if rank < 2 * extra:
        dist.send(flat, ranks[rank + 1])
