"""Gradient accumulation (``Coordinator(accumulation=N)``): one item of ``coord.batches()`` per
micro-batch, a save records the whole next update, a loop that takes another number of items is
refused at the save, and a changed global batch names what it is made of. One process, real DCP."""

from __future__ import annotations

import pytest
import torch
from resume.adapters.data import GlobalPositionSampler, StatefulLoader
from resume.adapters.torch_native import NativeTorchAdapter
from support.workloads import CFG, SyntheticTokens, TinyGPT, next_token_loss

from resume import ContinuityError, Coordinator, Run, UsageError

MICRO = 2


def job(run: str, *, accumulation: int, global_batch: int | None = None) -> tuple[Coordinator, dict]:
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dataset = SyntheticTokens(num_samples=64, cfg=CFG)
    loader = StatefulLoader(dataset, GlobalPositionSampler(len(dataset), MICRO, seed=3))
    coord = Coordinator(run, NativeTorchAdapter(model, opt, None, loader),
                        global_batch=global_batch or MICRO * accumulation, accumulation=accumulation, every=0,
                        seq_len=CFG.seq_len, handle_signals=False, lease_ttl_s=None)
    return coord, {"model": model, "opt": opt}


def update(coord: Coordinator, parts: dict, batches, items: int) -> list[int]:
    """One update over ``items`` items of ``batches``; the sample ids it read."""
    ids = []
    for _ in range(items):
        batch = next(batches)
        ids += batch["ids"].tolist()
        (next_token_loss(parts["model"], batch["tokens"]) / items).backward()
    parts["opt"].step()
    parts["opt"].zero_grad(set_to_none=True)
    coord.update(applied=True)
    return ids


def test_a_save_records_every_micro_batch_of_the_next_update_and_a_restart_takes_them(run_dir):
    coord, parts = job(run_dir, accumulation=3)
    coord.restore()
    batches = coord.batches()
    for _ in range(2):
        update(coord, parts, batches, 3)
    coord.save()
    uninterrupted = [update(coord, parts, batches, 3) for _ in range(2)]
    coord.close()
    recorded = Run.open(run_dir).read_manifest(2).expectation["next_batch"]
    assert recorded["samples"] == 3 * MICRO and recorded["ids"] == sorted(uninterrupted[0])

    again, parts = job(run_dir, accumulation=3)
    again.restore()
    assert again.restored_from == 2
    batches = again.batches()
    assert [update(again, parts, batches, 3) for _ in range(2)] == uninterrupted
    assert again.state.samples_read == 4 * 3 * MICRO


@pytest.mark.parametrize(("accumulation", "taken", "needle"), [
    (2, 3, r"accumulation: expected the loop to take 2 item\(s\).*actual 3.*Coordinator\(accumulation=3\)"),
    (1, 2, r"accumulation: expected the loop to take 1 item\(s\).*actual 2.*Coordinator\(accumulation=2\)"),
])
def test_a_loop_that_takes_another_number_of_items_per_update_is_refused_at_the_save(run_dir, accumulation,
                                                                                  taken, needle):
    coord, parts = job(run_dir, accumulation=accumulation)
    coord.restore()
    batches = coord.batches()
    update(coord, parts, batches, taken)
    with pytest.raises(UsageError, match=needle):
        coord.save()
    assert Run.open(run_dir).committed_steps() == []  # nothing written that records part of an update


def test_a_changed_accumulation_is_named_in_the_refusal(run_dir):
    coord, parts = job(run_dir, accumulation=4)
    coord.restore()
    update(coord, parts, coord.batches(), 4)
    coord.save()
    coord.close()
    fewer, _ = job(run_dir, accumulation=2)
    with pytest.raises(ContinuityError) as refused:
        fewer.restore()
    assert (refused.value.item, refused.value.expected, refused.value.actual) == ("config.global_batch", "8", "4")
    assert "saved 2 x 4 x 1 = 8, now 2 x 2 x 1 = 4" in refused.value.hint
    assert "the accumulation changed (4 -> 2)" in refused.value.hint


def test_accumulation_must_be_a_positive_integer(run_dir):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(UsageError, match="accumulation: expected a positive integer"):
            job(run_dir, accumulation=bad, global_batch=4)
