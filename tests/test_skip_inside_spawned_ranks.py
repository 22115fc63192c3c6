"""run_ranks: a pytest skip inside a spawned rank is a skip of the calling test; any other
failure of a rank still fails it (issue 11: a fresh machine without megatron-core)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from support.ranks import run_ranks

pytestmark = pytest.mark.multiprocess


def _skip(rank: int, world: int) -> None:
    pytest.skip("megatron-core not installed (as require_megatron says it)")


def _skip_on_rank_1_while_rank_0_waits(rank: int, world: int) -> None:
    if rank == 1:
        pytest.skip("only rank 1 lacks it")
    dist.barrier()  # never completed: rank 1 left; run_ranks must not hang here


def _raise(rank: int, world: int) -> None:
    raise ValueError("boom on purpose")


def _fail(rank: int, world: int) -> None:
    pytest.fail("an assertion of the rank itself")


def test_a_skip_in_a_spawned_rank_skips_the_test_with_the_same_reason():
    with pytest.raises(pytest.skip.Exception, match=r"^megatron-core not installed \(as require_megatron"):
        run_ranks(_skip, 1)


def test_a_skip_in_one_rank_skips_the_test_without_waiting_for_the_others():
    with pytest.raises(pytest.skip.Exception, match="^only rank 1 lacks it$"):
        run_ranks(_skip_on_rank_1_while_rank_0_waits, 2)


def test_an_error_in_a_spawned_rank_still_fails_the_test():
    with pytest.raises(mp.ProcessRaisedException, match="ValueError: boom on purpose"):
        run_ranks(_raise, 1)


def test_a_pytest_fail_in_a_spawned_rank_is_not_a_skip():
    with pytest.raises(mp.ProcessExitedException, match="exit code 1"):
        run_ranks(_fail, 1)
