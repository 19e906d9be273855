import logging

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _dist import run_ranks

from pystronghold.parallel import init_parallel, validate_parallel_sizes


@pytest.mark.parametrize("world, tp, dp, heads, expected_dp", [
    (1, 1, None, None, 1), (4, 2, None, 8, 2), (4, 4, 1, 4, 1), (6, 3, 2, None, 2), (8, 1, None, 3, 8),
])
def test_valid_sizes_give_the_dp_size(world, tp, dp, heads, expected_dp):
    assert validate_parallel_sizes(world, tp, dp, heads) == expected_dp


@pytest.mark.parametrize("world, tp, dp, heads, match", [
    (4, 3, None, None, "tp_size=3 must divide the world size 4"),
    (4, 0, None, None, "tp_size must be a positive int"),
    (4, 2, 0, None, "dp_size must be a positive int"),
    (4, 2, 4, None, "world size is 4"),
    (4, 2, None, 3, "must divide the number of attention heads 3"),
])
def test_invalid_sizes_are_refused_naming_the_rule(world, tp, dp, heads, match):
    with pytest.raises(ValueError, match=match):
        validate_parallel_sizes(world, tp, dp, heads)


def test_single_process_has_no_groups_and_refuses_tp(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    groups = init_parallel()
    assert (groups.world_size, groups.tp_size, groups.dp_size, groups.tp_group) == (1, 1, 1, None)
    with pytest.raises(ValueError, match="tp_size=2"):
        init_parallel(tp_size=2)


def _grid(rank: int, world: int) -> None:
    g = init_parallel(tp_size=2)
    assert (g.tp_size, g.dp_size, g.tp_rank, g.dp_rank) == (2, 2, rank % 2, rank // 2)
    assert dist.get_world_size(g.tp_group) == 2 and dist.get_world_size(g.dp_group) == 2
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=g.tp_group)  # replica d holds ranks 2d, 2d+1
    assert x.item() == (rank // 2) * 4 + 1
    y = torch.tensor([float(rank)])
    dist.all_reduce(y, group=g.dp_group)  # tp rank i is ranks i, i+2
    assert y.item() == 2 * (rank % 2) + 2


def test_tp_dp_grid_on_four_ranks():
    run_ranks(_grid, 4)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _misconfigured(rank: int, world: int) -> None:
    records = _Records()
    logging.getLogger("pystronghold.parallel.groups").addHandler(records)
    with pytest.raises(ValueError, match="tp_size=4 must divide the world size 2"):
        init_parallel(tp_size=4)
    with pytest.raises(ValueError, match="attention heads 3"):
        init_parallel(tp_size=2, heads=3)
    # error logged on rank 0 only, and every rank is still in step: a collective completes
    assert len(records.messages) == (2 if rank == 0 else 0)
    g = init_parallel(tp_size=2, heads=4)
    x = torch.ones(1)
    dist.all_reduce(x, group=g.tp_group)
    assert x.item() == 2


def test_misconfiguration_raises_everywhere_without_hanging():
    run_ranks(_misconfigured, 2)


def _peer_goes_missing(rank: int, world: int, flag_path: str) -> None:
    import os
    import time
    g = init_parallel(tp_size=2, timeout_s=2)  # creates the default group from the environment
    if rank == 1:  # never joins the collective; waits until rank 0 has given up, then leaves
        deadline = time.monotonic() + 30
        while not os.path.exists(flag_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        return
    with pytest.raises(RuntimeError):  # gloo's timeout error (DistBackendError is a RuntimeError)
        dist.all_reduce(torch.ones(1), group=g.tp_group)
    open(flag_path, "w").close()


def test_collective_with_missing_peer_times_out(tmp_path):
    flag = tmp_path / "rank0-gave-up"
    run_ranks(_peer_goes_missing, 2, str(flag), init=False)
    assert flag.exists()


def _one_rank_raises(rank: int, world: int) -> None:
    g = init_parallel(tp_size=2)
    if rank == 1:
        raise ValueError("rank 1 failed on purpose")
    dist.all_reduce(torch.ones(1), group=g.tp_group)  # would wait forever for rank 1


def test_a_failing_rank_is_reported_and_the_others_stopped():
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 failed on purpose"):
        run_ranks(_one_rank_raises, 2)



def _torchrun_start_with_bad_tp(rank: int, world: int) -> None:
    # as under torchrun: init_parallel would create the default group from the environment itself
    records = _Records()
    logging.getLogger("pystronghold.parallel.groups").addHandler(records)
    with pytest.raises(ValueError, match="tp_size=3 must divide the world size 2"):
        init_parallel(tp_size=3, timeout_s=10)
    # checked against WORLD_SIZE before the rendezvous: creating the group is collective, and a rank
    # that raised after it would close its sockets under a slower peer still connecting
    assert not dist.is_initialized()
    assert len(records.messages) == (1 if rank == 0 else 0)


def test_bad_tp_at_start_fails_on_every_rank_without_hanging():
    """Every rank gets the ValueError at start and returns (a rank left waiting would time out)."""
    run_ranks(_torchrun_start_with_bad_tp, 2, init=False, timeout_s=60)


def _torchrun_start_with_good_tp(rank: int, world: int) -> None:
    g = init_parallel(tp_size=2, heads=4, timeout_s=30)  # checked against WORLD_SIZE, then created
    assert dist.is_initialized() and (g.world_size, g.rank, g.tp_size, g.tp_rank) == (2, rank, 2, rank)
    x = torch.ones(1)
    dist.all_reduce(x, group=g.tp_group)
    assert x.item() == 2


def test_good_tp_at_start_creates_the_default_group():
    run_ranks(_torchrun_start_with_good_tp, 2, init=False)
