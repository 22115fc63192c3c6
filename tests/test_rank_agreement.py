"""resume.collective: every rank raises the same error, built from a record (never parsed from a
message). The exchange is scripted here, one rank at a time; the multi-process tests run the
same code over gloo."""

from __future__ import annotations

import pytest

from resume.collective import Collective, Failure, agreed_error, concat, rebuild
from resume.errors import (
    ContinuityError,
    CorruptCheckpointError,
    LeaseLostError,
    ResumeError,
    SaveFailedError,
    StorageError,
    UsageError,
)


class ScriptedComm:
    """Rank ``rank`` of ``world``; what the other ranks send is given up front."""

    def __init__(self, rank: int, world: int, *, others=None, from_rank0=None) -> None:
        self.rank, self.world_size = rank, world
        self.others = others or {}
        self.from_rank0 = from_rank0

    def all_gather_object(self, obj):
        return [obj if r == self.rank else self.others[r] for r in range(self.world_size)]

    def gather_object(self, obj, dst=0):
        self.gathered = True
        return self.all_gather_object(obj) if self.rank == dst else None

    def broadcast_object(self, obj, src=0):
        self.broadcast = obj if self.rank == 0 else self.from_rank0
        return self.broadcast


def failure_report(error: BaseException, rank: int) -> tuple:
    return ("error", Failure.of(error, rank))


def test_a_continuity_error_travels_with_its_fields_not_its_message():
    error = ContinuityError("lr_ahead[+1]", [0.1, 0.2], [0.1, 0.3], "a hint: with colons: here")
    again = rebuild(Failure.of(error, 3))
    assert type(again) is ContinuityError
    assert (again.item, again.expected, again.actual, again.hint) == (error.item, error.expected, error.actual,
                                                                       error.hint)
    assert str(again) == str(error)


@pytest.mark.parametrize("error, cls", [
    (CorruptCheckpointError("x: size: expected 1, actual 2"), CorruptCheckpointError),
    (LeaseLostError("lease.json: taken over"), LeaseLostError),
    (FileNotFoundError(2, "gone"), StorageError),        # an OSError of the standard library
    (ValueError("not ours"), ResumeError),               # anything else: ours, with its message
    (KeyError("k"), ResumeError),
])
def test_errors_are_built_again_as_their_class_or_the_nearest_of_ours(error, cls):
    again = rebuild(Failure.of(error, 1))
    assert type(again) is cls
    assert str(error) in str(again)


def test_a_name_that_is_not_one_of_our_classes_never_picks_another_class():
    # A record names a class; only resume.errors' classes and builtin names are honoured.
    assert type(rebuild(Failure(0, "Coordinator", {"message": "m"}))) is ResumeError
    assert type(rebuild(Failure(0, "SystemExit", {"message": "m"}))) is ResumeError


def test_each_raises_the_other_ranks_error_on_a_rank_that_succeeded():
    others = {1: failure_report(CorruptCheckpointError("rank-00001.json: bad"), 1)}
    coll = Collective(ScriptedComm(0, 2, others=others))
    with pytest.raises(CorruptCheckpointError, match=r"restore of step-1 failed on 1 of 2 ranks: rank 1: "
                                                     r"CorruptCheckpointError: rank-00001.json: bad"):
        coll.each(lambda: {"fine": True}, "restore of step-1")


def test_each_in_a_save_is_a_save_failure_naming_every_failed_rank():
    others = {1: failure_report(OSError(28, "No space left on device"), 1), 2: ("ok", {})}
    coll = Collective(ScriptedComm(0, 3, others=others))
    with pytest.raises(SaveFailedError) as raised:
        coll.each(dict, "/run/step-000000004", saving=True)
    assert "failed on 1 of 3 ranks, nothing committed: rank 1: OSError" in str(raised.value)


def test_the_same_error_on_every_rank_stays_what_it_is():
    error = UsageError("global_batch: expected 8, actual 4")
    others = {1: failure_report(UsageError(str(error)), 1)}
    coll = Collective(ScriptedComm(0, 2, others=others))
    with pytest.raises(UsageError) as raised:
        coll.each(lambda: (_ for _ in ()).throw(error), "config check")
    assert str(raised.value) == str(error)


def test_a_continuity_error_on_one_rank_is_that_continuity_error_on_all():
    error = ContinuityError("rng (rank 1)", "abc", "def", "re-seeded")
    coll = Collective(ScriptedComm(0, 2, others={1: failure_report(error, 1)}))
    with pytest.raises(ContinuityError) as raised:
        coll.each(lambda: None, "continuity check")
    assert raised.value.item == "rng (rank 1)" and raised.value.expected == "abc"


def test_on_rank0_gives_every_rank_the_value_or_the_error():
    assert Collective(ScriptedComm(0, 2)).on_rank0(lambda: [1, 2]) == [1, 2]
    assert Collective(ScriptedComm(1, 2, from_rank0=("ok", [1, 2]))).on_rank0(lambda: 1 / 0) == [1, 2]
    failed = ("error", Failure.of(ContinuityError("config.seed", 1, 2), 0))
    with pytest.raises(ContinuityError) as raised:
        Collective(ScriptedComm(1, 2, from_rank0=failed)).on_rank0(lambda: None)
    assert raised.value.item == "config.seed"
    original = OSError(5, "Input/output error")
    with pytest.raises(OSError) as on_rank0:  # rank 0 raises its own error, with its traceback
        Collective(ScriptedComm(0, 2)).on_rank0(lambda: (_ for _ in ()).throw(original))
    assert on_rank0.value is original


def test_agreed_error_keeps_the_first_failures_class_when_ranks_differ():
    failures = [Failure.of(StorageError("EIO"), 0), Failure.of(CorruptCheckpointError("bad"), 2)]
    error = agreed_error(failures, 4, "checksum verification")
    assert type(error) is StorageError and "failed on 2 of 4 ranks" in str(error)


def test_a_foreign_error_on_every_rank_keeps_its_class_name_the_phase_and_the_step():
    # A framework's AttributeError raised on every rank during a save: the user must see what
    # raised, in which phase of which step; the raising rank chains the original.
    original = AttributeError("'FusedQKVLinear' object has no attribute 'wq'")
    others = {1: failure_report(AttributeError(str(original)), 1)}
    coll = Collective(ScriptedComm(0, 2, others=others))
    with pytest.raises(ResumeError) as raised:
        coll.each(lambda: (_ for _ in ()).throw(original), "/run/step-000000003 (shards)", saving=True)
    # A bug, not storage trouble: never a SaveFailedError that a save-failure policy would tolerate.
    assert type(raised.value) is ResumeError
    message = str(raised.value)
    assert message.startswith("/run/step-000000003 (shards): save failed on every rank (2): ")
    assert "AttributeError: 'FusedQKVLinear' object has no attribute 'wq'" in message
    assert raised.value.__cause__ is original


def test_gather_gives_rank0_the_combined_values_and_the_others_none():
    comm = ScriptedComm(0, 3, others={1: ("ok", 10), 2: ("ok", 20)})
    assert Collective(comm).gather(lambda: 0, "parts", combine=sum) == 30
    assert comm.broadcast == ("ok", None)  # what the other ranks receive: no values
    other = ScriptedComm(2, 3, from_rank0=("ok", None))
    assert Collective(other).gather(lambda: 20, "parts", combine=sum) is None


def test_gather_in_a_save_raises_one_ranks_failure_on_every_rank():
    error = StorageError("shard-2: write: No space left on device")
    comm = ScriptedComm(0, 3, others={1: ("ok", 1), 2: failure_report(error, 2)})
    with pytest.raises(SaveFailedError, match="1 of 3 ranks.*rank 2: StorageError: shard-2"):
        Collective(comm).gather(lambda: 0, "step-7 (writing the shards)", saving=True)
    failures = comm.broadcast[1]
    other = ScriptedComm(1, 3, from_rank0=("failed", failures, 3))
    with pytest.raises(SaveFailedError, match="rank 2: StorageError"):
        Collective(other).gather(lambda: 1, "step-7 (writing the shards)", saving=True)


def test_an_error_in_rank0s_combine_is_raised_on_every_rank():
    comm = ScriptedComm(0, 2, others={1: ("ok", {"batch": None})})
    with pytest.raises(SaveFailedError, match="rank 0: KeyError"):
        Collective(comm).gather(dict, "counters", saving=True, combine=lambda parts: parts[0]["batch"])
    other = ScriptedComm(1, 2, from_rank0=comm.broadcast)
    with pytest.raises(SaveFailedError, match="rank 0: KeyError"):
        Collective(other).gather(dict, "counters", saving=True, combine=lambda parts: parts[0]["batch"])


def test_gather_everywhere_and_agree():
    comm = ScriptedComm(0, 2, others={1: ("ok", ["b"])})
    assert Collective(comm).gather(lambda: ["a"], "problems", combine=concat, everywhere=True) == ["a", "b"]
    assert Collective(ScriptedComm(1, 2, from_rank0=comm.broadcast)).gather(
        lambda: ["b"], "problems", combine=concat, everywhere=True) == ["a", "b"]
    # agree: each rank keeps its own value; rank 0 receives outcomes only.
    comm = ScriptedComm(0, 2, others={1: ("ok", None)})
    assert Collective(comm).agree(lambda: {"mine": 0}, "rank state") == {"mine": 0}
    error = CorruptCheckpointError("rank-1.json: rng: expected a state, actual 7")
    comm = ScriptedComm(0, 2, others={1: failure_report(error, 1)})
    with pytest.raises(CorruptCheckpointError, match="rank-1.json"):
        Collective(comm).agree(lambda: {"mine": 0}, "rank state")


class ScatteringComm(ScriptedComm):
    """ScriptedComm with a scatter: rank 0 keeps what it would send to each rank."""

    def scatter_object(self, objs, src=0):
        self.scattered = objs
        return objs[self.rank] if self.rank == src else self.from_rank0


def test_scatter_gives_each_rank_its_own_share_and_no_one_the_list():
    comm = ScatteringComm(0, 3)
    shares = [["a", "d"], ["b"], ["c"]]
    assert Collective(comm).scatter(lambda: shares, "manifest of iter_0000010") == ["a", "d"]
    assert [s[1] for s in comm.scattered] == shares and not hasattr(comm, "broadcast")
    other = ScatteringComm(2, 3, from_rank0=comm.scattered[2])
    assert Collective(other).scatter(lambda: 1 / 0, "manifest of iter_0000010") == ["c"]
    # A Comm of a program's own without scatter_object: the whole list, each takes its own.
    plain = ScriptedComm(1, 3, from_rank0=comm.scattered)
    assert Collective(plain).scatter(lambda: None, "manifest") == ["b"]


def test_an_error_in_rank0s_scatter_is_raised_on_every_rank():
    comm = ScatteringComm(0, 2)
    with pytest.raises(SaveFailedError, match=r"rank 0: OSError: .*Input/output error"):
        Collective(comm).scatter(lambda: (_ for _ in ()).throw(OSError(5, "Input/output error")),
                                 "manifest of iter_0000010", saving=True)
    other = ScatteringComm(1, 2, from_rank0=comm.scattered[1])
    with pytest.raises(SaveFailedError, match="rank 0: OSError"):
        Collective(other).scatter(list, "manifest of iter_0000010", saving=True)
    with pytest.raises(SaveFailedError, match="expected one value per rank"):
        Collective(ScatteringComm(0, 2)).scatter(lambda: [[]], "manifest", saving=True)
