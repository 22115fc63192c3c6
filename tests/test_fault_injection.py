"""Fault injection (resume.faults): the spec, where and when a fault fires, what each action does,
and arming a process from the environment."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest

from resume import faults
from resume.faults import ENV, Fault, InjectedFault

pytestmark = pytest.mark.usefixtures("faults_disarmed")


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != ENV}
    environ.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ, check=False,
                          capture_output=True, text=True, timeout=60)


# -- parse ----------------------------------------------------------------------------------


def test_parse_reads_several_faults_with_their_options():
    spec = " save.after_shards:kill rank=1 step=6 ;retention.mid_delete:eio hit=3;; save.mid_shards:enospc "
    assert faults.parse(spec) == [
        Fault("save.after_shards", "kill", rank=1, step=6),
        Fault("retention.mid_delete", "eio", hit=3),
        Fault("save.mid_shards", "enospc"),
    ]
    assert faults.parse("") == [] and faults.parse(" ; ") == []


@pytest.mark.parametrize("spec, bad", [
    ("save.nowhere:raise", "point: expected one of save.before_shards, .*actual 'save.nowhere'"),
    ("save.after_shards:explode",
     "save.after_shards: action: expected one of kill, raise, enospc, eio, hang, actual 'explode'"),
    ("save.after_shards", "save.after_shards: action: .*actual ''"),
    ("save.after_shards:raise color=red",
     "save.after_shards: expected rank=N, step=N or hit=N, actual 'color=red'"),
    ("save.after_shards:raise rank=one", "save.after_shards: .*actual 'rank=one'"),
    ("save.after_shards:raise step=-1", "save.after_shards: .*actual 'step=-1'"),
    ("save.after_shards:raise step=", "save.after_shards: .*actual 'step='"),
    ("save.after_shards:raise step=\u00b2", "save.after_shards: .*actual 'step=\u00b2'"),  # "²".isdigit()
    ("save.after_shards:raise hit=0", "save.after_shards: hit: expected >= 1, actual 0"),
    ("save.after_gather:raise; save.after_shards:kill rank=1 step=x", "save.after_shards: .*'step=x'"),
    # One rank raising at the edge of a collective would leave the others inside it.
    ("save.before_shards:raise rank=1",
     r"save.before_shards: expected kill with rank=, or raise on every rank \(no rank=\), actual raise on rank 1"),
    ("save.after_gather:enospc rank=0", "save.after_gather: expected kill with rank=.*actual enospc on rank 0"),
    ("save.before_manifest:kill rank=1", "save.before_manifest: rank: expected 0 .*actual 1"),
])
def test_parse_refuses_a_bad_spec_naming_the_variable_and_the_bad_part(spec, bad):
    with pytest.raises(ValueError, match=f"^{ENV}: {bad}"):
        faults.parse(spec)


# -- point ----------------------------------------------------------------------------------


def test_a_fault_fires_only_on_its_rank_and_step_and_only_at_its_hit():
    faults.arm("save.after_shards:raise rank=1 step=4 hit=2")
    for rank, step in ((0, 4), (1, 2), (1, None)):
        faults.set_context(rank=rank, step=step)
        faults.point("save.after_shards")
        faults.point("save.after_shards")
    faults.set_context(rank=1, step=4)
    faults.point("save.before_shards")  # another point: not a pass of this one
    faults.point("save.after_shards")  # first match
    with pytest.raises(InjectedFault, match=r"save.after_shards \(rank 1, step 4\)"):
        faults.point("save.after_shards")  # second: fires
    faults.point("save.after_shards")  # once only


def test_each_fault_counts_every_pass_even_one_where_another_fired():
    faults.arm("save.after_shards:enospc hit=1; save.after_shards:eio hit=2; save.after_shards:raise hit=3")
    fired = []
    for step in (2, 4, 6, 8):
        faults.set_context(rank=0, step=step)
        try:
            faults.point("save.after_shards")
        except (OSError, InjectedFault) as e:
            fired.append((step, getattr(e, "errno", None) or type(e).__name__))
    assert fired == [(2, errno.ENOSPC), (4, errno.EIO), (6, "InjectedFault")]


@pytest.mark.parametrize("action, kind, code", [
    ("enospc", OSError, errno.ENOSPC),
    ("eio", OSError, errno.EIO),
    ("raise", InjectedFault, None),
])
def test_actions_raise_what_a_full_disk_a_failing_disk_or_a_bug_would(action, kind, code):
    faults.arm(f"save.before_manifest:{action}")
    faults.set_context(rank=0, step=8)
    with pytest.raises(kind, match=r"injected (fault )?at save.before_manifest \(rank 0, step 8\)") as raised:
        faults.point("save.before_manifest")
    assert getattr(raised.value, "errno", None) == code
    if action == "raise":
        assert isinstance(raised.value, RuntimeError) and not isinstance(raised.value, OSError)


def test_disarm_and_arm_replace_what_was_armed():
    faults.arm("save.after_gather:raise")
    faults.arm("save.after_latest:raise")
    faults.point("save.after_gather")  # replaced: nothing fires
    faults.disarm()
    faults.point("save.after_latest")


def test_kill_really_kills_the_process_with_sigkill():
    killed = run_python("""
        from resume import faults
        faults.arm("save.after_gather:kill step=3")
        faults.set_context(rank=0, step=2)
        faults.point("save.after_gather")
        print("passed step 2", flush=True)
        faults.set_context(rank=0, step=3)
        faults.point("save.after_gather")
        print("survived")
    """)
    assert killed.returncode == -9, killed.stderr
    assert killed.stdout == "passed step 2\n"


def test_the_environment_variable_arms_a_process_that_never_called_arm():
    out = run_python("""
        from resume import faults
        faults.set_context(rank=0, step=2)
        faults.point("save.before_shards")
        faults.set_context(rank=0, step=3)
        try:
            faults.point("save.before_shards")
        except OSError as e:
            print(e.errno)
    """, **{ENV: "save.before_shards:eio step=3"})
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{errno.EIO}\n"


def test_a_bad_environment_variable_fails_at_the_first_point_naming_it():
    out = run_python("""
        from resume import faults
        faults.point("save.before_shards")
    """, **{ENV: "save.before_shards:eio rank=first"})
    assert out.returncode == 1
    assert f"ValueError: {ENV}: save.before_shards: expected rank=N, step=N or hit=N, actual 'rank=first'" \
        in out.stderr
