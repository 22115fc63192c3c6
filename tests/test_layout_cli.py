"""``resume inspect`` shows a checkpoint's parallel layout and ``resume plan --from-run`` lists the
layouts its newest checkpoint can be restored on, each judged as a restore would judge it."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
from support.cli import assert_one_line_error, invoke, resume
from support.workloads import trained

from resume.cli.show import layout_lines, layout_text
from resume.layout import ParallelLayout, Stage, assemble_layout, layout_topology
from resume.relayout import REFUSED, RESHARDED, judge, restorable_layouts, split_data_parallel
from resume.run import Run

PER_STAGE = "cannot follow another split"
"""Part of why the native adapter's checkpoint loads on its own pipeline split only."""


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """One process, no process group: a tiny GPT trained to iteration 6 (steps 3 and 6)."""
    run = str(tmp_path_factory.mktemp("layout-cli") / "run")
    trained(run, until=6)
    return run


@pytest.fixture
def run_copy(trained_run, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(trained_run, run)
    return run


def with_topology(run_url: str, step: int, topology: dict) -> None:
    """Record ``topology`` in ``step``'s manifest, as a job on another layout would have (the
    manifest lists the files' checksums, not its own: nothing else to re-checksum)."""
    run = Run.open(run_url)
    run.write_manifest(dataclasses.replace(run.read_manifest(step), topology=topology))


def tensor_parallel_parts(world: int, tensor: int) -> list[dict]:
    """Every rank's ``layout_part()`` of a hand-written tensor-parallel program stating its degree."""
    stage = {"digest": "s0", "names": 4, "first": "a.weight", "last": "d.weight"}
    return [{"degrees": {"tensor": tensor}, "how": "stated", "placements": {"plain": 4}, "stage": stage,
             "fixed": {"pipeline": f"per-stage state {PER_STAGE}"}} for _ in range(world)]


def pipeline_parts(world: int, stages: int) -> list[dict]:
    """Every rank's part of a DDP x pipeline program: rank r holds stage r // (world // stages)."""
    per = world // stages
    return [{"degrees": {"dp_replicate": per}, "how": "read", "placements": {"plain": 2},
             "stage": {"digest": f"s{r // per}", "names": 2, "first": f"layers.{2 * (r // per)}.w",
                       "last": f"layers.{2 * (r // per) + 1}.w"},
             "fixed": {"pipeline": f"per-stage state {PER_STAGE}"}} for r in range(world)]


def plan_json(run: str, *args: str) -> tuple[int, dict]:
    result = invoke("plan", "--from-run", run, *args, "--json")
    return result.exit_code, json.loads(result.stdout)


def verdicts(body: dict) -> dict[tuple[int, int, int, int], str]:
    return {(c["tensor"], c["pipeline"], c["context"], c["data_parallel"]): c["verdict"] for c in body["layouts"]}


# -- inspect -------------------------------------------------------------------------------------------


def test_inspect_shows_the_layout_line_and_its_json_the_recorded_layout(run_copy):
    result = invoke("inspect", run_copy)
    assert result.exit_code == 0, result.output
    [line] = [x for x in result.stdout.splitlines() if x.startswith("  layout ")]
    assert line == "  layout        DP1 on 1 rank (assumed); placements: plain x 13; pipeline: 1 stage"
    assert any(x.startswith("    fixed       pipeline: ") and PER_STAGE in x for x in result.stdout.splitlines())
    body = json.loads(invoke("inspect", run_copy, "--json").stdout)
    layout = body["topology"]["layout"]
    assert (layout["world_size"], layout["data_parallel"], layout["how"]) == (1, 1, "assumed")
    assert body["topology"]["data_parallel"] == 1


def test_a_tensor_parallel_run_shows_a_data_parallel_degree_of_one(run_copy):
    with_topology(run_copy, 6, {"world_size": 2, **layout_topology(tensor_parallel_parts(2, 2), world_size=2)})
    result = invoke("inspect", run_copy)
    assert result.exit_code == 0, result.output
    assert "  layout        DP1 x TP2 on 2 ranks (stated); placements: plain x 4; pipeline: 1 stage" \
        in result.stdout.splitlines()
    assert json.loads(invoke("inspect", run_copy, "--json").stdout)["topology"]["data_parallel"] == 1


def test_inspect_of_a_manifest_without_a_layout_says_it_was_not_recorded(run_copy):
    with_topology(run_copy, 6, {"world_size": 1})
    result = invoke("inspect", run_copy)
    assert result.exit_code == 0, result.output
    assert "  layout        not recorded (written before layouts were recorded)" in result.stdout.splitlines()


def test_the_layout_lines_name_each_pipeline_stage_and_what_is_fixed():
    layout = assemble_layout(pipeline_parts(4, 2), world_size=4)
    lines = layout_lines({"layout": layout.to_dict()}, source="m.json")
    assert lines[0] == "  layout        DP2 x PP2 on 4 ranks (read); placements: plain x 2; pipeline: 2 stages"
    assert lines[1:3] == ["    stage 0     layers.0.w .. layers.1.w (2 names) on 2 ranks",
                          "    stage 1     layers.2.w .. layers.3.w (2 names) on 2 ranks"]
    assert lines[3].startswith("    fixed       pipeline: per-stage state")


def test_the_layout_text_of_fsdp_and_of_unprintable_names():
    fsdp = ParallelLayout(world_size=2, dp_shard=2, placements={"Shard(0) over dp=2": 12})
    assert layout_text(fsdp) == ("DP2 (shard 2) on 2 ranks (read); placements: Shard(0) over dp=2 x 12; "
                                 "pipeline: 0 stages")
    hostile = ParallelLayout(world_size=1, placements={"x\x1b[2J": 1}, stages=(Stage("d", 1, "a\nb", "c"),))
    assert "\x1b" not in layout_text(hostile) and '"x\\u001b[2J" x 1' in layout_text(hostile)


# -- plan --from-run -----------------------------------------------------------------------------------


def test_plan_lists_the_saved_layout_as_saved_another_dp_or_tp_resharded_another_pipeline_refused(run_copy):
    code, body = plan_json(run_copy, "--nodes", "1", "--gpus-per-node", "1")
    assert code == 0 and body["step"] == 6 and body["world_size"] == 1
    assert verdicts(body) == {(1, 1, 1, 1): "as saved"}
    code, body = plan_json(run_copy, "--nodes", "1", "--gpus-per-node", "2")
    assert code == 0
    assert verdicts(body) == {(1, 1, 1, 2): RESHARDED, (1, 1, 2, 1): RESHARDED, (2, 1, 1, 1): RESHARDED,
                              (1, 2, 1, 1): REFUSED}
    [refused] = [c for c in body["layouts"] if c["verdict"] == REFUSED]
    assert PER_STAGE in refused["why"] and "now: )" not in refused["why"]
    text = invoke("plan", "--from-run", run_copy, "--nodes", "1", "--gpus-per-node", "2").stdout
    assert "  TP1 x PP1 x CP1 x DP2                     2 x 1  resharded (dp_replicate 1->2)" in text
    assert any(x.startswith("  refused     TP1 x PP2 x CP1 x DP1: ") and PER_STAGE in x for x in text.splitlines())


def test_plan_of_a_tensor_parallel_run_keeps_it_as_saved_and_only_dp_that_splits_the_batch(run_copy):
    with_topology(run_copy, 6, {"world_size": 2, **layout_topology(tensor_parallel_parts(2, 2), world_size=2)})
    code, body = plan_json(run_copy, "--nodes", "2", "--gpus-per-node", "1")
    assert code == 0 and verdicts(body)[(2, 1, 1, 1)] == "as saved"  # TP stays within the saved degree
    code, body = plan_json(run_copy, "--nodes", "3", "--gpus-per-node", "2")  # 6 ranks: DP 3 splits no batch of 4
    assert all(c["data_parallel"] in (1, 2) for c in body["layouts"])
    code, body = plan_json(run_copy, "--nodes", "2", "--gpus-per-node", "4", "--tp", "2")
    assert {c["tensor"] for c in body["layouts"]} == {2}
    assert verdicts(body)[(2, 1, 1, 4)] == RESHARDED


def test_plan_keeps_the_saved_stages_for_the_saved_pipeline_degree():
    saved = assemble_layout(pipeline_parts(4, 2), world_size=4)
    found = {(c.layout.pipeline, c.layout.data_parallel, c.layout.tensor, c.layout.context): c
             for c in restorable_layouts(saved, world_size=8, gpus_per_node=8, global_batch=8)}
    kept = found[(2, 4, 1, 1)]
    assert kept.verdict == RESHARDED and kept.layout.stages == saved.stages
    assert kept.changed == ("world_size", "dp_replicate")
    assert found[(4, 2, 1, 1)].verdict == REFUSED and PER_STAGE in found[(4, 2, 1, 1)].why
    assert found[(1, 8, 1, 1)].verdict == REFUSED


def test_plan_refuses_every_change_of_a_programs_own_scheme_or_of_a_fixed_format():
    scheme = ParallelLayout(world_size=2, dp_replicate=2, scheme="flat-zero1")
    assert judge(scheme, dataclasses.replace(scheme, world_size=4, dp_replicate=4)).verdict == REFUSED
    megatron = ParallelLayout(world_size=2, tensor=2, fixed={"*": "saved with a fixed format"})
    [c] = [c for c in restorable_layouts(megatron, world_size=4, gpus_per_node=4, global_batch=4)
           if (c.layout.tensor, c.layout.data_parallel) == (2, 2)]
    assert c.verdict == REFUSED and c.why == "saved with a fixed format"


def test_the_data_parallel_split_follows_the_saved_one():
    assert split_data_parallel(ParallelLayout(world_size=4, dp_replicate=4), 8) == (8, 1)
    assert split_data_parallel(ParallelLayout(world_size=4, dp_shard=4), 8) == (1, 8)
    assert split_data_parallel(ParallelLayout(world_size=8, dp_replicate=2, dp_shard=4), 16) == (4, 4)
    assert split_data_parallel(ParallelLayout(world_size=8, dp_replicate=2, dp_shard=4), 6) == (3, 2)


def test_plan_without_nodes_or_with_another_global_batch_is_a_usage_error(run_copy):
    assert_one_line_error(resume("plan", "--from-run", run_copy), 2, "--nodes: expected the number of nodes")
    assert_one_line_error(resume("plan", "--from-run", run_copy, "--nodes", "1", "--global-batch", "8"), 2,
                          "--global-batch: expected the checkpoint's global batch 4")


def test_plan_where_no_layout_loads_the_checkpoint_exits_2(run_copy):
    with_topology(run_copy, 6, {"world_size": 2, **layout_topology(pipeline_parts(2, 2), world_size=2)})
    # 3 ranks: PP3 (refused) or DP/TP/CP 3, which split no global batch of 4.
    proc = resume("plan", "--from-run", run_copy, "--nodes", "1", "--gpus-per-node", "3", "--pp", "3")
    assert_one_line_error(proc, 2, "layouts over 3 ranks: expected one that loads the checkpoint, actual none")


def test_plan_of_a_manifest_without_a_layout_exits_3(run_copy):
    with_topology(run_copy, 6, {"world_size": 1})
    proc = resume("plan", "--from-run", run_copy, "--nodes", "1")
    assert_one_line_error(proc, 3, "step-000000006/manifest.json: topology.layout: expected a recorded "
                                   "parallel layout, actual none (written before layouts were recorded")


def hostile(run_url: str, step: int) -> str:
    path = os.path.join(run_url, f"step-{step:09d}", "manifest.json")
    with open(path) as f:
        body = json.load(f)
    body["topology"]["layout"]["tensor"] = -1
    with open(path, "w") as f:
        json.dump(body, f)
    return path


def test_a_hostile_layout_is_passed_over_and_named(run_copy):
    path = hostile(run_copy, 6)
    needle = f"{path}: topology.layout.tensor: expected an integer from 1 to 2**24, actual -1"
    code, body = plan_json(run_copy, "--nodes", "1", "--gpus-per-node", "1")
    assert code == 0 and body["step"] == 3  # as a restore does: the previous committed checkpoint
    assert body["passed_over"] == [{"step": 6, "reason": needle}]
    text = invoke("plan", "--from-run", run_copy, "--nodes", "1").stdout
    assert f"passed over step-000000006: {needle}" in text.splitlines()
    assert_one_line_error(resume("inspect", run_copy, "--step", "6"), 1, needle)
    shutil.rmtree(os.path.join(run_copy, "step-000000003"))
    assert_one_line_error(resume("plan", "--from-run", run_copy, "--nodes", "1"), 1, needle)
