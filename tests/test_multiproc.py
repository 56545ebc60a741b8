"""The multi-process harness itself: what it does after a job that would poison the next one."""
import pytest
from multiproc import WorkerError, run_ranks


def _made_one_more_group_on_rank_0(rank, world_size):
    from torch.distributed import distributed_c10d

    if rank == 0:  # as a new_group that one rank called and the other did not
        distributed_c10d._world.group_count += 1
    return rank


def _new_group_sum(rank, world_size):
    import torch
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value, group=group)
    dist.destroy_process_group(group)
    return float(value)


def _both_fail(rank, world_size):
    raise ValueError(f"failed on rank {rank}")


def test_ranks_that_made_different_numbers_of_groups_fail_the_job_and_the_next_one_gets_a_new_pool():
    with pytest.raises(WorkerError, match=r"different numbers of process groups: \{.*\} \(rank: count\)"):
        run_ranks(_made_one_more_group_on_rank_0, 2, timeout=60)
    assert run_ranks(_new_group_sum, 2, timeout=60) == [3.0, 3.0]  # a new group meets under one name again


def test_every_failing_rank_is_reported():
    with pytest.raises(WorkerError, match=r"(?s)failed on rank \d.*rank \d failed too:.*failed on rank \d"):
        run_ranks(_both_fail, 2, timeout=60)
