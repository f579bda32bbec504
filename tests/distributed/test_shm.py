"""The shared-memory path of CPU collectives on one host gives gloo's results, bit for bit the
same on every rank (in place, out of place and asynchronous), and fails with an error instead
of hanging when a rank does not come: at once when its process has exited, after
parallel.timeout_s when it lives on elsewhere."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from megatronish.distributed import comm
from megatronish.distributed.shm import SharedMemoryBackend
from megatronish.errors import PeerLost
from tests.ranks import run_on_ranks
from tests.tolerances import FP32_FEW_OPS_REL, FP32_REORDER


def _values(rank: int, call: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * call + rank)
    return (torch.randn(numel, generator=gen) * 10).to(dtype)


def _all_reduce_into(rank, world, group, call, numel):
    """all_reduce_into: what the in-place all_reduce gives (through shared memory the sum in
    rank order), in the output, the input left as it was."""
    mine = _values(rank, call, numel, torch.float32)
    in_place, out = mine.clone(), torch.empty(numel)
    comm.all_reduce_into(out, mine, group)
    comm.all_reduce(in_place, group)
    assert torch.equal(out, in_place)
    assert torch.equal(mine, _values(rank, call, numel, torch.float32))
    if isinstance(comm.backend(group), SharedMemoryBackend):
        assert torch.equal(out, sum(_values(r, call, numel, torch.float32) for r in range(world)))
    return out


def _collectives(rank, world):
    group = dist.new_group(list(range(world)))
    through_gloo = _all_reduce_into(rank, world, group, call=98, numel=1000)
    assert comm.enable_shared_memory(group, timeout_s=60)
    slot_elems = comm.backend(group).memory.slot_bytes // 4
    sizes = [1, 7, 1000, 513]
    results = []
    for call in range(40):  # many calls: both sets of slots are reused many times
        # Twice (summed, then maxed) a tensor that goes through in two pieces.
        numel = slot_elems + 3 if call in (3, 10) else sizes[call % len(sizes)]
        dtype = [torch.float32, torch.bfloat16, torch.float64, torch.int64][call % 4]
        op = dist.ReduceOp.MAX if call % 5 == 0 else dist.ReduceOp.SUM
        if call % 8 in (5, 7):  # fp32 sums out of place, the larger in two pieces
            results.append(_all_reduce_into(rank, world, group, call, numel))
            continue
        mine = _values(rank, call, numel, dtype)
        got = mine.clone()
        comm.all_reduce(got, group, op=op)
        parts = [_values(r, call, numel, dtype) for r in range(world)]
        expected = parts[0].clone()
        for part in parts[1:]:
            expected = torch.maximum(expected, part) if op == dist.ReduceOp.MAX else expected + part
        assert torch.equal(got, expected), (call, numel, dtype, op)
        results.append(got)
    local = _values(rank, 99, 12, torch.float32).view(3, 4)
    gathered = torch.empty(3 * world, 4)
    comm.all_gather_into(gathered, local, group)
    expected = torch.cat([_values(r, 99, 12, torch.float32).view(3, 4) for r in range(world)])
    assert torch.equal(gathered, expected)
    through_shared_memory = _all_reduce_into(rank, world, group, call=98, numel=1000)
    assert torch.allclose(
        through_shared_memory, through_gloo, rtol=FP32_FEW_OPS_REL, atol=FP32_REORDER
    )
    handle = comm.all_reduce(torch.ones(3), group, async_op=True)
    assert handle.wait()
    # Asynchronous all-reduces: the next collective on the group completes a pending one first,
    # so waiting after it, or never, gives the same results.
    first, second = _values(rank, 96, 1000, torch.float32), _values(rank, 97, 7, torch.float32)
    handle = comm.all_reduce(first, group, async_op=True)
    comm.all_reduce(second, group)
    assert handle.wait()
    never_waited = _values(rank, 95, 5, torch.float32)
    comm.all_reduce(never_waited, group, async_op=True)
    gathered = torch.empty(3 * world, 4)
    comm.all_gather_into(gathered, local, group)
    for call, got in ((96, first), (97, second), (95, never_waited)):
        expected = sum(_values(r, call, got.numel(), torch.float32) for r in range(world))
        assert torch.equal(got, expected), call
    assert torch.equal(
        gathered, torch.cat([_values(r, 99, 12, torch.float32).view(3, 4) for r in range(world)])
    )
    comm.disable_shared_memory()
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_shared_memory_collectives_equal_the_exact_result_on_every_rank(world):
    per_rank = run_on_ranks(_collectives, world, timeout=120)
    for results in per_rank[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results, per_rank[0]))


def _block_collectives(rank, world, numel):
    """reduce_scatter_in_place leaves in this rank's block the bits all_reduce gives there;
    all_gather_in_place fills every block with its rank's (ZeRO-1's two collectives); reduce
    leaves the all-reduce's bits on its destination (the Muon matrices' under ZeRO)."""
    out = {}
    group = dist.new_group(list(range(world)))
    for path in ("gloo", "shared memory"):
        if path == "shared memory":
            assert comm.enable_shared_memory(group, timeout_s=60)
            comm.backend(group).memory.slot_bytes = 4 * 1000  # blocks larger than a slot: in pieces
        block = slice(rank * numel // world, (rank + 1) * numel // world)
        for async_op in (False, True):
            whole = _values(rank, 7, numel, torch.float32)
            scattered = whole.clone()
            comm.all_reduce(whole, group)
            handle = comm.reduce_scatter_in_place(scattered, group, async_op=async_op)
            if handle is not None:
                handle.wait()
            assert torch.equal(scattered[block], whole[block]), (path, async_op)
            mine = torch.full((numel,), -1.0)
            mine[block] = rank
            handle = comm.all_gather_in_place(mine, group, async_op=async_op)
            if handle is not None:
                handle.wait()
            want = torch.arange(world, dtype=torch.float32).repeat_interleave(numel // world)
            assert torch.equal(mine, want), (path, async_op)
            out[(path, async_op)] = scattered[block]
            reduced = _values(rank, 7, numel, torch.float32)
            handle = comm.reduce(reduced, world - 1, group, async_op=async_op)
            if handle is not None:
                handle.wait()
            # in rank order through shared memory, and a + b however two gloo ranks add
            if rank == world - 1 and (path == "shared memory" or world == 2):
                assert torch.equal(reduced, whole), (path, async_op)
    comm.disable_shared_memory()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_block_reduce_scatter_all_gather_and_reduce_equal_the_all_reduce_on_gloo_and_shm(
    world,
):
    numel = 2400 * world  # 2400 elements a block: three 1000-element slots
    per_rank = run_on_ranks(_block_collectives, world, numel, timeout=120)
    for results in per_rank:
        assert len(results) == 4


def _absent_rank(rank, world):
    group = dist.new_group([0, 1])
    assert comm.enable_shared_memory(group, timeout_s=1.0)
    if rank == 1:
        time.sleep(2)  # alive, but never in the collective
        return "stayed away"
    try:
        comm.all_reduce(torch.ones(4), group)
    except TimeoutError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow  # waits out a timeout
def test_a_rank_that_never_comes_is_a_timeout_error_not_a_hang():
    message = run_on_ranks(_absent_rank, 2, timeout=60)[0]
    assert "did not reach collective 1 within 1 s" in message


def _exited_rank(rank, world):
    group = dist.new_group([0, 1])
    assert comm.enable_shared_memory(group, timeout_s=60.0)
    if rank == 1:
        return "left"  # and its process exits
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4), group)
    except PeerLost as exc:
        return str(exc), time.monotonic() - start
    return "no error"


def test_a_rank_whose_process_exited_is_peer_lost_at_once_not_at_the_timeout():
    message, waited = run_on_ranks(_exited_rank, 2, timeout=60)[0]
    assert "rank 1 of a process group on this host" in message and "exited" in message
    assert waited < 30, "well before the 60 s timeout"


def _switched_off(rank, world):
    return comm.enable_shared_memory(dist.new_group([0, 1]), timeout_s=10)


def test_megatronish_shm_0_keeps_gloo(monkeypatch):
    monkeypatch.setenv("MEGATRONISH_SHM", "0")
    assert run_on_ranks(_switched_off, 2, timeout=60) == [False, False]
