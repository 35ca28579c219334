"""picotron.comm (counted collectives, ring all-reduce) and picotron.mesh (the rank grid), on 2-8 ranks."""

import pytest
import torch
import torch.distributed as dist

from picotron import comm
from picotron.launch import run
from picotron.mesh import Mesh
from picotron.tolerance import assert_close

F32 = 4  # bytes per float32 element


# ---- every wrapper: right result, right count ---------------------------------------------------

def every_wrapper():
    """Call each counted collective once with small float32 tensors; return results and counts."""
    rank, n = dist.get_rank(), dist.get_world_size()
    counter = comm.CommCounter()
    mine = torch.arange(4.0) + 10 * rank                         # rank r: [10r, 10r+1, 10r+2, 10r+3]
    out = {}
    comm.all_reduce(mine.clone())                                # no counter open: not counted
    with comm.counting(counter):
        x = mine.clone(); comm.all_reduce(x); out["all_reduce"] = x
        x = mine.clone(); comm.broadcast(x, src=1); out["broadcast"] = x
        x = mine.clone(); comm.reduce(x, dst=0); out["reduce"] = x
        x = torch.empty(4 * n); comm.all_gather(x, mine); out["all_gather"] = x
        big = torch.arange(2.0 * n) + rank                           # 2 elements per rank after the scatter
        x = torch.empty(2); comm.reduce_scatter(x, big); out["reduce_scatter"] = x
        pieces = [torch.empty(4) for _ in range(n)] if rank == 0 else None
        comm.gather(mine, pieces, dst=0); out["gather"] = pieces
        pieces = [torch.full((3,), float(i)) for i in range(n)] if rank == 0 else None
        x = torch.empty(3); comm.scatter(x, pieces, src=0); out["scatter"] = x
        x = torch.empty(n); comm.all_to_all(x, torch.arange(float(n)) + 10 * rank)
        out["all_to_all"] = x
        x = torch.empty(5)                                           # a ring pass: rank r -> r+1
        comm.send_recv(torch.full((5,), float(rank)), (rank + 1) % n, x, (rank - 1) % n)
        out["send_recv"] = x
    return out, counter.snapshot()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_wrapper_computes_and_counts(world):
    results = run(every_wrapper, world)
    inputs = [torch.arange(4.0) + 10 * r for r in range(world)]
    total = sum(inputs)
    for rank, (out, counts) in enumerate(results):
        torch.testing.assert_close(out["all_reduce"], total)
        torch.testing.assert_close(out["broadcast"], inputs[1])
        if rank == 0:
            torch.testing.assert_close(out["reduce"], total)
            torch.testing.assert_close(torch.stack(out["gather"]), torch.stack(inputs))
        torch.testing.assert_close(out["all_gather"], torch.cat(inputs))
        summed = sum(torch.arange(2.0 * world) + r for r in range(world))
        torch.testing.assert_close(out["reduce_scatter"], summed[2 * rank: 2 * rank + 2])
        torch.testing.assert_close(out["scatter"], torch.full((3,), float(rank)))
        torch.testing.assert_close(out["all_to_all"], torch.tensor([10.0 * j + rank for j in range(world)]))
        torch.testing.assert_close(out["send_recv"], torch.full((5,), float((rank - 1) % world)))

        expected = {  # op: (calls, payload bytes this rank handed over), as comm's docstring defines them
            "all_reduce": (1, 4 * F32), "reduce": (1, 4 * F32), "gather": (1, 4 * F32),
            "broadcast": (1, 4 * F32 if rank == 1 else 0),
            "all_gather": (1, 4 * F32),                          # the input shard, not the output
            "reduce_scatter": (1, 2 * world * F32),              # the full input, not the output
            "scatter": (1, 3 * world * F32 if rank == 0 else 0),
            "all_to_all": (1, world * F32),
            "send": (1, 5 * F32),
        }
        assert counts == expected, f"rank {rank}: {counts} != {expected}"


def point_to_point():
    with comm.counting() as counter:
        if dist.get_rank() == 0:
            comm.send(torch.ones(6), dst=1)
            return None, counter.snapshot()
        x = torch.zeros(6)
        comm.recv(x, src=0)
    return x, counter.snapshot()


def test_send_counts_bytes_and_recv_counts_a_call():
    (_, sent), (received, got) = run(point_to_point, 2)
    torch.testing.assert_close(received, torch.ones(6))
    assert sent == {"send": (1, 6 * F32)}
    assert got == {"recv": (1, 0)}


def test_counter_totals_reset_and_table():
    counter = comm.CommCounter()
    counter.record("all_reduce", 100)
    counter.record("all_reduce", 28)
    counter.record("send", 8)
    assert (counter.total_calls, counter.total_bytes) == (3, 136)
    assert counter.snapshot() == {"all_reduce": (2, 128), "send": (1, 8)}
    assert "all_reduce" in counter.table()
    counter.reset()
    assert (counter.total_calls, counter.total_bytes) == (0, 0)


# ---- ring all-reduce ----------------------------------------------------------------------------

SIZES = [1, 5, 12, 1001]  # smaller than the world, odd, divisible, large and odd


def ring_vs_torch(sizes):
    rank = dist.get_rank()
    torch.manual_seed(rank)                                      # different data on every rank
    pairs = []
    for numel in sizes:
        x = torch.randn(numel, dtype=torch.float64)
        expected = x.clone()
        dist.all_reduce(expected)
        returned = comm.ring_all_reduce(x)
        pairs.append((x, expected, returned is x))
    strided = torch.randn(6, 5, dtype=torch.float64).t()         # not contiguous: summed in a copy
    expected = strided.clone()
    dist.all_reduce(expected)
    comm.ring_all_reduce(strided)
    pairs.append((strided, expected, True))
    return pairs


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_all_reduce_equals_dist_all_reduce(world):
    for pairs in run(ring_vs_torch, world, args=(SIZES,)):
        for ours, theirs, in_place in pairs:
            assert_close(ours, theirs, n=world)      # a sum of `world` float64 terms, in another order
            assert in_place


def ring_counts(numel):
    with comm.counting() as counter:
        comm.ring_all_reduce(torch.ones(numel))
    return counter.snapshot()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_bytes(world):
    numel = 120                                                  # divisible by 2, 3 and 4
    for counts in run(ring_counts, world, args=(numel,)):
        calls, sent = counts["send"]
        assert calls == 2 * (world - 1)                          # N-1 reduce-scatter + N-1 all-gather steps
        assert sent == 2 * (world - 1) / world * numel * F32


def ring_in_subgroups():
    rank = dist.get_rank()
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    group = evens if rank % 2 == 0 else odds
    x = torch.full((7,), float(rank))
    comm.ring_all_reduce(x, group=group)
    return x


def test_ring_all_reduce_in_a_subgroup():
    results = run(ring_in_subgroups, 4)
    for rank, x in enumerate(results):
        torch.testing.assert_close(x, torch.full((7,), 0.0 + 2 if rank % 2 == 0 else 1.0 + 3))  # 0+2 or 1+3


# ---- mesh ---------------------------------------------------------------------------------------

def ranks_in_each_group(sizes):
    """Each axis group's members, found by all-gathering the global rank inside the group."""
    mesh = Mesh(**sizes)
    members = {}
    for axis in ("pp", "dp", "cp", "tp", "dp_cp"):
        group = mesh.groups[axis]
        ranks = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(ranks, torch.tensor([mesh.rank]), group=group)
        members[axis] = [int(r) for r in ranks]
    neighbours = {"pp_prev": mesh.pp_prev_rank, "pp_next": mesh.pp_next_rank,
                  "cp_prev": mesh.cp_prev_rank, "cp_next": mesh.cp_next_rank}
    return mesh.coords, members, neighbours, (mesh.dp_rank, mesh.tp_size, mesh.is_first_stage, mesh.is_last_stage)


def test_mesh_dp2_tp2_layout_and_groups():
    results = run(ranks_in_each_group, 4, args=({"dp": 2, "tp": 2},))
    for rank, (coords, members, neighbours, (dp_rank, tp_size, first, last)) in enumerate(results):
        assert coords == {"tp": rank % 2, "cp": 0, "dp": rank // 2, "pp": 0}   # tp innermost
        assert members["tp"] == [rank - rank % 2, rank - rank % 2 + 1]         # {0,1} and {2,3}
        assert members["dp"] == [rank % 2, rank % 2 + 2]                       # {0,2} and {1,3}
        assert members["pp"] == members["cp"] == [rank]
        assert members["dp_cp"] == members["dp"]
        assert (dp_rank, tp_size, first, last) == (rank // 2, 2, True, True)
        assert neighbours == {"pp_prev": None, "pp_next": None, "cp_prev": rank, "cp_next": rank}


def test_mesh_pp2_dp2_cp2_on_8_ranks():
    results = run(ranks_in_each_group, 8, args=({"pp": 2, "dp": 2, "cp": 2},))
    for rank, (coords, members, neighbours, (_, _, first, last)) in enumerate(results):
        pp, dp, cp = rank // 4, rank // 2 % 2, rank % 2                # rank = (pp*2 + dp)*2 + cp
        assert coords == {"tp": 0, "cp": cp, "dp": dp, "pp": pp}
        assert members["cp"] == [rank - cp, rank - cp + 1]
        assert members["dp"] == [4 * pp + cp, 4 * pp + cp + 2]
        assert members["pp"] == [rank % 4, rank % 4 + 4]
        assert members["dp_cp"] == [4 * pp + i for i in range(4)]
        assert members["tp"] == [rank]
        assert (first, last) == (pp == 0, pp == 1)
        assert neighbours["pp_prev"] == (None if pp == 0 else rank - 4)
        assert neighbours["pp_next"] == (rank + 4 if pp == 0 else None)
        assert neighbours["cp_prev"] == neighbours["cp_next"] == rank - cp + (1 - cp)   # a ring of two


def bad_mesh(sizes):
    Mesh(**sizes)


@pytest.mark.parametrize("sizes, words", [
    ({"dp": 2, "tp": 3}, ["6", "4 ranks"]),           # product is not the world size
    ({"dp": 4, "tp": 0}, ["tp=0", "positive"]),       # a size below 1
])
def test_mesh_errors_speak_to_the_user(sizes, words):
    with pytest.raises(ValueError) as info:
        run(bad_mesh, 4, args=(sizes,))
    for word in words:
        assert word in str(info.value)


def test_mesh_outside_a_process_group_says_where_to_build_it():
    with pytest.raises(RuntimeError, match="inside the function"):
        Mesh(dp=1)


def counting_contexts():
    """Counters nest, a counter open twice records once, and a collective from another thread of the
    process (as autograd's threads issue them in backward) is counted too."""
    import threading
    outer, inner = comm.CommCounter(), comm.CommCounter()
    with comm.counting(outer):
        comm.all_reduce(torch.ones(2))
        with comm.counting(inner), comm.counting(outer):
            worker = threading.Thread(target=comm.all_reduce, args=(torch.ones(3),))
            worker.start()
            worker.join()
    comm.all_reduce(torch.ones(5))                               # after the blocks: nothing records it
    return outer.snapshot(), inner.snapshot(), len(comm._open_counters)


def test_counting_nests_and_counts_other_threads():
    for outer, inner, still_open in run(counting_contexts, 2):
        assert outer == {"all_reduce": (2, 20)} and inner == {"all_reduce": (1, 12)} and still_open == 0
