"""The recorded parallel layout and the rules of a layout change (``resume.layout``), in one process:
what is let through, what is refused and with which words, a hostile record, and the moments'
layout-independent totals."""

from __future__ import annotations

import json

import pytest
import torch
from resume.adapters.torch.fingerprint import fingerprint_states

from resume import ManifestError
from resume.errors import ContinuityError
from resume.layout import (
    LayoutChange,
    ParallelLayout,
    Stage,
    assemble_layout,
    global_moments,
    layout_change,
    stage_digest,
)


def part(**degrees) -> dict:
    stage = degrees.pop("stage", "all")
    return {"degrees": degrees, "how": "read", "stage": {"digest": stage_digest([stage]), "names": 1,
                                                          "first": stage, "last": stage}}


def test_assembled_from_every_rank_the_real_data_parallel_degree():
    tp_only = assemble_layout([part(tensor=2), part(tensor=2)], world_size=2)
    assert (tp_only.data_parallel, tp_only.tensor, tp_only.pipeline) == (1, 2, 1)
    assert tp_only.describe() == "DP1 x TP2 on 2 ranks"
    # TP2 x PP2 on 8 ranks: the stages come from the names each rank holds, DP from what is left.
    ranks = [part(tensor=2, stage="a")] * 4 + [part(tensor=2, stage="b")] * 4
    layout = assemble_layout(ranks, world_size=8)
    assert (layout.pipeline, layout.data_parallel) == (2, 2)
    assert layout.rank_stage == ((0, 4), (1, 4)) and layout.stage_of_rank() == [0] * 4 + [1] * 4
    assert assemble_layout([None, None], world_size=2) is None


def test_round_trips_through_its_record():
    layout = assemble_layout([part(dp_shard=2, tensor=2, stage="a")] * 4, world_size=4)
    again = ParallelLayout.from_dict(json.loads(json.dumps(layout.to_dict())), source="m.json")
    assert again == layout and layout.to_dict()["data_parallel"] == 2


@pytest.mark.parametrize(("record", "field"), [
    ({"world_size": 2, "tensor": -1}, "tensor"),
    ({"world_size": 2**40}, "world_size"),
    ({"world_size": 2, "tensor": True}, "tensor"),
    ({"world_size": 2, "scheme": 7}, "scheme"),
    ({"world_size": 2, "placements": {"plain": -3}}, "placements"),
    ({"world_size": 2, "placements": {str(i): 1 for i in range(65)}}, "placements"),
    ({"world_size": 2, "fixed": {"tensor": ["why"]}}, "fixed"),
    ({"world_size": 2, "formats": {"ckpt_format": {"nested": 1}}}, "formats"),
    ({"world_size": 2, "stages": [{"digest": "a", "names": 1}], "rank_stage": [[0, 1]]}, "rank_stage"),
    ({"world_size": 2, "stages": [{"digest": "a", "names": 1}], "rank_stage": [[3, 2]]}, "rank_stage"),
    ({"world_size": 1, "stages": [{"digest": "a", "names": 1}, {"digest": "b", "names": 1}]}, "stages"),
    ("DP2", ""),
])
def test_a_hostile_record_is_refused_naming_the_field(record, field):
    with pytest.raises(ManifestError) as e:
        ParallelLayout.from_dict(record, source="RUN/step-000000008/manifest.json")
    assert str(e.value).startswith(f"RUN/step-000000008/manifest.json: topology.layout.{field}: expected ")
    assert "\n" not in str(e.value)


def fsdp(world: int) -> ParallelLayout:
    return ParallelLayout(world_size=world, dp_shard=world, placements={f"Shard(0) over dp={world}": 10})


def test_the_same_layout_is_no_change_and_an_old_checkpoint_is_not_compared():
    assert layout_change(fsdp(2), fsdp(2)) is None
    assert layout_change(None, fsdp(2)) is None


def test_an_exact_change_is_let_through_and_recorded():
    tp = ParallelLayout(world_size=2, tensor=2, placements={"Shard(0) over tp=2": 4, "plain": 6})
    change = layout_change(fsdp(2), tp)
    assert isinstance(change, LayoutChange) and set(change.changed) == {"dp_shard", "tensor", "placements"}
    assert change.describe() == "layout changed: DP2 (shard 2) on 2 ranks -> DP1 x TP2 on 2 ranks, resharded"
    assert change.record(8) == {"step": 8, "item": "layout", "from": "DP2 (shard 2) on 2 ranks",
                                "to": "DP1 x TP2 on 2 ranks"}


def test_a_fixed_degree_is_refused_with_what_would_make_it_possible():
    saved = ParallelLayout(world_size=4, tensor=2, dp_replicate=2,
                           fixed={"tensor": "saved with --ckpt-format torch: save with --ckpt-format torch_dist"})
    assert layout_change(saved, ParallelLayout(world_size=2, tensor=2)) is not None  # DP may change
    with pytest.raises(ContinuityError) as e:
        layout_change(saved, ParallelLayout(world_size=4, tensor=4))
    assert (e.value.item, e.value.expected, e.value.actual) == ("layout", "DP2 x TP2 on 4 ranks", "DP1 x TP4 on 4 ranks")
    assert "--ckpt-format torch_dist" in e.value.hint


def test_another_split_at_the_same_pipeline_degree_is_a_pipeline_change():
    def split(*stages: str) -> ParallelLayout:
        return ParallelLayout(world_size=2, pipeline=2, stages=tuple(Stage(stage_digest([s]), 1, s, s) for s in stages),
                              rank_stage=((0, 1), (1, 1)), fixed={"pipeline": "per-stage state"})
    with pytest.raises(ContinuityError) as e:
        layout_change(split("a", "b"), split("a", "c"))
    assert e.value.hint.startswith("per-stage state (saved stages: a .. a (1 names); b .. b (1 names); now: ")
    assert layout_change(split("a", "b"), split("b", "a")) is None  # the same stages, other ranks


def test_a_program_scheme_loads_on_its_own_layout_only():
    saved = ParallelLayout(world_size=2, dp_replicate=2, scheme="flat-zero1")
    assert layout_change(saved, ParallelLayout(world_size=2, dp_replicate=2, scheme="flat-zero1")) is None
    for live in (ParallelLayout(world_size=1, scheme="flat-zero1"), ParallelLayout(world_size=2, dp_replicate=2)):
        with pytest.raises(ContinuityError, match="its own scheme 'flat-zero1'"):
            layout_change(saved, live)


def test_global_moments_count_each_element_once_on_any_layout():
    def fp(sharded: int, replicated: int) -> dict:
        return {"sharded": {"bits": {"exp_avg": sharded} if sharded else {}, "numel": 1 if sharded else 0},
                "replicated": {"bits": {"exp_avg": replicated} if replicated else {}, "numel": 2 if replicated else 0}}
    # FSDP2 on 2 ranks: every element in a shard. TP 2: the sharded halves and the plain tensors on
    # both ranks of the one stage, counted once. PP 2: each stage's plain tensors counted.
    fsdp2 = global_moments([[fp(3, 0)], [fp(4, 0)]], [0, 0])
    assert fsdp2 == [{"bits": {"exp_avg": 7}, "numel": 2}]
    tp2 = global_moments([[fp(3, 5)], [fp(4, 5)]], [0, 0])
    assert tp2 == [{"bits": {"exp_avg": 12}, "numel": 4}]
    pp2 = global_moments([[fp(0, 5)], [fp(0, 6)]], [0, 1])
    assert pp2 == [{"bits": {"exp_avg": 11}, "numel": 4}]


def test_moments_under_the_wrong_names_change_the_named_sums_only():
    a, b = torch.arange(4, dtype=torch.float32), torch.arange(4, dtype=torch.float32) * 3
    right = fingerprint_states([{"exp_avg": a}, {"exp_avg": b}], ["layers.0.w", "layers.1.w"])
    swapped = fingerprint_states([{"exp_avg": b}, {"exp_avg": a}], ["layers.0.w", "layers.1.w"])
    assert right["replicated"]["bits"] == swapped["replicated"]["bits"]
    assert right["replicated"]["named"] != swapped["replicated"]["named"]
    assert "named" not in fingerprint_states([{"exp_avg": a}])["replicated"]  # no names: as before


def test_a_one_process_run_records_its_layout(tmp_path):
    from support.workloads import trained

    coord = trained(str(tmp_path / "run"), until=3, every=3)
    manifest = json.loads((tmp_path / "run" / "step-000000003" / "manifest.json").read_text())
    layout = ParallelLayout.from_dict(manifest["topology"]["layout"], source="manifest")
    assert manifest["topology"]["data_parallel"] == 1 and layout.how == "assumed"
    assert layout.describe() == "DP1 on 1 rank" and layout.placements == {"plain": len(list(
        coord.adapter.model.parameters()))}
    assert layout.fixed["pipeline"].startswith("the optimizers' param groups")


def test_a_statement_of_the_layout_is_checked(tmp_path):
    from resume.adapters.torch_native import NativeTorchAdapter

    from resume import UsageError

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for stated, words in (({"tensr": 2}, "expected keys among"), ({"tensor": 0}, "parallel.tensor"),
                          ({"scheme": ""}, "parallel.scheme")):
        with pytest.raises(UsageError, match=words):
            NativeTorchAdapter(model, opt, parallel=stated)
    adapter = NativeTorchAdapter(model, opt, parallel={"tensor": 2, "scheme": "mine"})
    assert adapter.layout_part()["degrees"] == {"tensor": 2} and adapter.layout_part()["how"] == "stated"
    # A tensor degree no DTensor shows is the program's own split: the checkpoint keeps it.
    saved = assemble_layout([NativeTorchAdapter(model, opt, parallel={"tensor": 2}).layout_part()], world_size=2)
    assert "stated by the program" in saved.fixed["tensor"]
    assert layout_change(saved, ParallelLayout(world_size=1, tensor=2)) is not None  # DP may change
    with pytest.raises(ContinuityError, match="restart with the same tensor degree"):
        layout_change(saved, ParallelLayout(world_size=2, dp_replicate=2))
