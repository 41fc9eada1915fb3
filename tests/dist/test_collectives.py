"""tokenmill's own all-reduce algorithms sum exactly what the backend's sums, for 2-5
ranks and sizes that do not divide evenly, and its ring reduce-scatter leaves each rank
its chunk of the sum (gloo, spawned processes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenmill.dist.collectives import ALGORITHMS, all_reduce, reduce_scatter
from tokenmill.executor.multiprocess import free_port

SIZES = [1, 3, 7, 1001, 70_001]


def contribution(rank: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + size)
    return torch.randn(size, generator=generator).to(dtype)


def check_rank(rank: int, world: int, port: int, failures) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        for algorithm in ALGORITHMS:
            for size in SIZES:
                for dtype in (torch.float32, torch.float64)[:2 if size < 2000 else 1]:
                    tensor = contribution(rank, size, dtype).view(1, -1)  # 2-D, in place
                    expected = sum(contribution(r, size, torch.float64) for r in range(world))
                    result = all_reduce(tensor, algorithm)
                    assert result is tensor
                    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
                    error = (tensor.view(-1).double() - expected).abs().max().item()
                    if error > tolerance * world:
                        failures.put(f"{algorithm} rank {rank} size {size} {dtype}: {error}")
        for rows in (1, 3, 64):
            size = rows * world * 5
            expected = sum(contribution(r, size, torch.float64) for r in range(world))
            mine = reduce_scatter(contribution(rank, size, torch.float32).view(-1, 5))
            piece = expected.view(world, -1)[rank]
            error = (mine.double() - piece).abs().max().item()
            if mine.shape != piece.shape or error > 1e-5 * world:
                failures.put(f"reduce_scatter rank {rank} size {size}: {error}")
    except Exception as exc:  # noqa: BLE001 (reported to the test)
        failures.put(f"rank {rank}: {exc!r}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_every_algorithm_sums_like_the_backend(world):
    context = mp.get_context("spawn")
    failures = context.Queue()
    port = free_port()
    processes = [context.Process(target=check_rank, args=(rank, world, port, failures))
                 for rank in range(world)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
    assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]
    errors = []
    while not failures.empty():
        errors.append(failures.get())
    assert not errors, errors


def test_an_unknown_algorithm_is_a_clear_error():
    with pytest.raises(ValueError, match="all_reduce must be one of"):
        from tokenmill.dist.context import GroupCollectives

        GroupCollectives(0, 2, "butterfly")
