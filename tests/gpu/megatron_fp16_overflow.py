"""GPU check, for a machine with CUDA and megatron-core 0.19.2 (not collected by pytest; CPU CI
cannot run it): what tests/test_megatron_train_loop.py stands in for on CPU.

- A real fp16 loss-scale overflow: ``--fp16 --initial-loss-scale 4294967296`` makes
  Megatron's dynamic loss scaler find inf gradients in the first iterations, and
  ``optimizer.step()`` (Megatron-Core's mixed-precision optimizer, built by
  ``get_megatron_optimizer``, here the distributed optimizer) skips them. The manifest must
  count exactly the iterations Megatron's log reports as skipped.
- Dropout on: a run stopped at iteration 8 (``--exit-interval``) and restarted must give the
  same losses at iterations 9..12 as an uninterrupted run (dropout draws from the CUDA RNG
  tracker Megatron saves and resume checks).

Usage (2 GPUs by default; NPROC=1 works too):

    python tests/gpu/megatron_fp16_overflow.py /tmp/resume-gpu-check

Exits 0 when every check holds, 1 naming the first that does not. Written without a GPU
at hand: it has not been run yet (README: Megatron-LM).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
SEQ, VOCAB, GBS, MBS = 64, 512, 16, 2


def flags(save: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
            "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
            "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS), "--train-samples", str(12 * GBS),
            "--lr", "1e-3", "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--lr-warmup-samples", str(2 * GBS),
            "--lr-decay-samples", str(10 * GBS), "--weight-decay", "0.1", "--clip-grad", "1.0",
            "--fp16", "--initial-loss-scale", "4294967296", "--use-distributed-optimizer",
            "--save", save, "--load", save, "--ckpt-format", "torch_dist", "--save-interval", "4",
            "--log-interval", "1", "--eval-iters", "0", "--seed", "1234", "--num-workers", "0"]


# -- one training process (under torchrun) ------------------------------------------------------


def train_process(save: str, out: str, extra: list[str]) -> None:
    import functools

    import torch

    sys.path.insert(0, TESTS)
    from support.megatron import alias_typing_override

    alias_typing_override()
    from resume.adapters.megatron import install

    recorder = install()
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
    from megatron.training.global_vars import set_global_variables
    from megatron.training.training import pretrain

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 100_000

        def __getitem__(self, i: int) -> dict:
            g = torch.Generator().manual_seed(10_007 + int(i))
            text = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            return {"tokens": text[:-1], "labels": text[1:], "loss_mask": torch.ones(SEQ)}

    def model_provider(pre_process=True, post_process=True, config=None, pg_collection=None, vp_stage=None):
        args = get_args()
        return GPTModel(config=core_transformer_config_from_args(args),
                        transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
                        max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                        post_process=post_process)

    def datasets(num_samples):
        return Tokens(), None, None

    datasets.is_distributed = True

    def loss_func(loss_mask, output):
        loss = torch.sum(output.float().view(-1) * loss_mask.view(-1))
        n = loss_mask.sum().to(torch.int)
        return loss, n, {"lm loss": torch.cat([loss.detach().view(1), n.float().view(1)])}

    def forward_step(data_iterator, model):
        batch = {k: v.cuda(non_blocking=True) for k, v in next(data_iterator).items()}
        position = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(batch["tokens"].shape[0], SEQ)
        output = model(batch["tokens"], position, None, labels=batch["labels"])
        return output, functools.partial(loss_func, batch["loss_mask"])

    # As Megatron-LM's pretrain_gpt.py of 0.19.2 does: the arguments parsed and set before
    # pretrain(), which takes their config container.
    sys.argv = [sys.argv[0], *flags(save), *extra]
    args = parse_args()
    validate_args(args, {})
    set_global_variables(args)
    try:
        pretrain(pretrain_cfg_container_from_args(args), datasets, ModelType.encoder_or_decoder, forward_step,
                 model_provider=model_provider)
    except SystemExit:
        pass
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"loaded": recorder.loaded.manifest.step if recorder.loaded else None,
                       "last_committed": recorder.last_committed}, f)


# -- the driver ---------------------------------------------------------------------------------


def run(root: str, name: str, save: str, extra: list[str]) -> tuple[dict, str]:
    out = os.path.join(root, f"{name}.json")
    log = os.path.join(root, f"{name}.log")
    cmd = ["torchrun", "--standalone", "--nproc_per_node", os.environ.get("NPROC", "2"), os.path.abspath(__file__),
           "--process", save, out, json.dumps(extra)]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    with open(log) as f:
        text = f.read()
    if rc != 0 or not os.path.exists(out):
        sys.exit(f"{name}: exit code {rc}; see {log}")
    with open(out) as f:
        return json.load(f), text


def logged(log: str) -> dict[int, dict]:
    """Per iteration: Megatron's lm loss and its count of skipped iterations (log interval 1)."""
    rows = {}
    for line in log.splitlines():
        m = re.search(r"iteration\s+(\d+)/", line)
        if not m:
            continue
        loss = re.search(r"lm loss: (\S+) \|", line)
        skipped = re.search(r"number of skipped iterations:\s+(\d+)", line)
        rows[int(m.group(1))] = {"loss": loss.group(1) if loss else None,
                                 "skipped": int(skipped.group(1)) if skipped else 0}
    return rows


def main(root: str) -> int:
    os.makedirs(root, exist_ok=True)
    reference, ref_log = run(root, "reference", os.path.join(root, "reference"), [])
    _, first_log = run(root, "first", os.path.join(root, "resumed"), ["--exit-interval", "8"])
    resumed, resumed_log = run(root, "resumed", os.path.join(root, "resumed"), [])
    with open(os.path.join(root, "resumed", "iter_0000008", "resume-manifest.json")) as f:
        state = json.load(f)["train_state"]
    skipped_logged = sum(row["skipped"] for it, row in logged(first_log).items() if it <= 8)
    checks = [
        ("an overflow happened (the check tests something)", skipped_logged > 0, skipped_logged),
        ("manifest updates_skipped == Megatron's skipped iterations", state["updates_skipped"] == skipped_logged,
         (state["updates_skipped"], skipped_logged)),
        ("successful + skipped == iteration", state["updates_successful"] + state["updates_skipped"] == 8, state),
        ("the restart loaded iteration 8 with the continuity check", resumed["loaded"] == 8, resumed),
        ("losses at 9..12 equal an uninterrupted run (dropout on)",
         [logged(resumed_log).get(i, {}).get("loss") for i in range(9, 13)]
         == [logged(ref_log).get(i, {}).get("loss") for i in range(9, 13)], None),
        ("the uninterrupted run committed 12", reference["last_committed"] == 12, reference),
    ]
    for what, ok, detail in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {what}" + ("" if ok else f": {detail}"))
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--process":
        train_process(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
    else:
        sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/resume-gpu-check"))
