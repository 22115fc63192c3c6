"""Megatron's own training loop on CPU with resume installed: ``megatron.training.training.train()``.

One run is one process (``python -m support.megatron_train_loop CONFIG.json``), so a
test can SIGKILL it and resume in a fresh one; ``start_ranks`` runs one on several ranks
(gloo, data parallel), one process each. The process does what ``pretrain()``
does around ``train()`` (arguments parsed by Megatron, model, optimizer and scheduler
built by Megatron-Core, then ``training.load_checkpoint`` as
``setup_model_and_optimizer`` calls it) and then runs Megatron's ``train()``
unchanged: its ``train_step`` (forward/backward through
``forward_backward_no_pipelining``, ``optimizer.step()``, the scheduler step),
``training_log``, ``checkpoint_and_decide_exit`` with ``--save-interval`` and
``--exit-signal-handler``, and ``save_checkpoint_and_time``. ``install()`` runs before
Megatron parses its arguments, as in a launch script, so every one of these goes
through the installed wrappers. The data comes through Megatron's
``build_pretraining_data_loader`` (``MegatronPretrainingSampler``), started at
``args.consumed_train_samples`` and wrapped in ``RerunDataIterator`` as ``pretrain()``
starts it.

What the test supplies, as a user's ``pretrain_gpt.py`` does: the dataset (tokens
that depend only on the sample index), ``forward_step`` and its loss function.

Test-only stand-ins, only when CUDA is absent (beyond ``support.megatron.cpu_patches``
and those of ``support.megatron_training_run``):
- ``train()`` runs inside ``cuda_factories_on_cpu()``: ``torch.tensor``/``torch.zeros``
  with ``device='cuda'`` build on CPU. Megatron makes them in
  core/pipeline_parallel/schedules.py (``forward_backward_no_pipelining``:
  ``total_num_tokens``), training/training.py (``training_log``: ``total_loss_dict``)
  and core/optimizer/clip_grads.py (the grad-norm tensors of ``optimizer.step()``).
- ``torch.cuda.current_stream()`` returns a stream whose ``wait_event``/``wait_stream``
  do nothing: DDP's gradient sync asks for it before reducing, to wait for CUDA-graph
  events no parameter has here (core/distributed/param_and_grad_buffer.py,
  ``_ParamAndGradBucketGroup.start_grad_sync``).
- ``optimizer.step`` is wrapped on the instance: at the iterations listed in
  ``overflow_at`` it returns ``(False, None, None)`` without touching the parameters,
  which is what Megatron's mixed-precision optimizer returns when the loss scaler
  finds an inf/NaN gradient (core/optimizer/optimizer.py, ``MixedPrecisionOptimizer.step``);
  fp16 with a dynamic loss scaler does not build on CPU. Megatron's ``train_step``
  then reports the iteration as skipped and does not step the scheduler.

``run_pretrain`` goes one level up: Megatron's ``pretrain()`` itself (initialize_megatron,
setup_model_and_optimizer with get_model and the load, the data iterators, train()). It
needs these further test-only stand-ins, only without CUDA:
- ``initialize_megatron`` called with ``allow_no_cuda=True`` (pretrain() does not pass it;
  training/initialize.py asserts ``torch.cuda.is_available()`` otherwise);
- torch.distributed (gloo) and the model-parallel groups set up before pretrain(), with
  the CUDA RNG tracker seeded: ``_initialize_distributed`` creates the groups and
  ``_set_random_seed`` seeds the tracker only when ``torch.cuda.device_count() > 0``;
- ``initialize._compile_dependencies`` a no-op (it builds the C++ dataset index helpers,
  which need pybind11 and are not used by this dataset);
- ``training.set_jit_fusion_options`` a no-op (it warms up fused kernels with
  ``torch.rand(..., device='cuda')``, training/initialize.py ``_warmup_jit_function``);
- ``torch.nn.Module.cuda`` returns the module (training.py ``get_model``:
  ``model_module.cuda(torch.cuda.current_device())``), and ``torch.cuda.Stream``/
  ``torch.cuda.stream`` a stream that waits for nothing and a null context (``get_model``
  builds DDP on a side stream);
- ``args.padded_vocab_size`` computed by the model provider's caller, as the tokenizer
  build (skipped, NullTokenizer) would.

Faults, at 0-based iterations of the config: ``request_at`` (a ``resume save`` request),
``sigterm_at``, ``hold_at`` (``hold``: blocks inside ``train_step``, on ``hold_rank`` only when
given), ``overflow_at``.

What the test observes: the loss of every iteration (from the loss function, per
``args.curr_iteration``), the final parameters' digest, the iteration ``train()``
returned or the code it exited with, and what the recorder loaded.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import torch

from support.megatron_training_run import GBS, SEQ, VOCAB, cuda_factories_on_cpu, fresh

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TokenDataset(torch.utils.data.Dataset):
    """Sample ``i`` is the same tokens in every process: a run and its resumed copy read the
    same stream, and only the sampler position (``consumed_train_samples``) picks where."""

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, index: int) -> dict:
        g = torch.Generator().manual_seed(10_007 + int(index))
        text = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
        return {"tokens": text[:-1], "labels": text[1:], "loss_mask": torch.ones(SEQ),
                "position_ids": torch.arange(SEQ)}


class Events:
    """What happens at given iterations (0-based ``args.curr_iteration``, as train() sets it),
    seen from the first micro-batch's forward step."""

    def __init__(self, config: dict, save_dir: str) -> None:
        self.config = config
        self.save_dir = save_dir
        self.seen: set[int] = set()

    def at(self, iteration: int) -> None:
        if iteration in self.seen:
            return
        self.seen.add(iteration)
        if iteration == self.config.get("request_at"):
            from resume.adapters.megatron import MEGATRON_LAYOUT

            from resume.control import post_save_request
            from resume.run import Run

            run = Run.open(self.save_dir, create=True, layout=MEGATRON_LAYOUT)
            request = post_save_request(run, stop=False, reason="test: resume save")
            _write_json(self.config["out"] + ".request", {"request_id": request.request_id})
        if iteration == self.config.get("sigterm_at"):
            os.kill(os.getpid(), signal.SIGTERM)  # Megatron's handler only sets a flag
        if iteration == self.config.get("hold_at") and self.config.get("hold_rank") in (None, _rank()):
            hold(self.config["out"], iteration)


def hold(out: str, iteration: int) -> None:
    """Block here, inside Megatron's ``train_step`` (the first micro-batch's forward step): the
    parent SIGKILLs this process (mid-iteration, after the last save), or the watchdog reports
    this frame first."""
    _write_json(out + ".holding", {"iteration": iteration})
    while True:
        time.sleep(0.05)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class _NoStream:
    """What start_grad_sync needs of the current CUDA stream when there is none (docstring)."""

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


def cpu_stream_patch() -> None:
    """``torch.cuda.current_stream`` as a stream that waits for nothing, only without CUDA."""
    if not torch.cuda.is_available():
        torch.cuda.current_stream = lambda *a, **k: _NoStream()


def make_forward_step(args: Any, losses: dict, events: Events):
    """pretrain_gpt.py's forward_step in miniature: a batch, the model, a masked LM loss."""
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)  # the default one is on CUDA

    def loss_func(loss_mask, output_tensor):
        per_token = output_tensor.float().view(-1)
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(per_token * loss_mask)
        num_tokens = loss_mask.sum().to(torch.int)
        losses.setdefault(args.curr_iteration, []).append(float(loss.detach() / num_tokens))
        return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.float().view(1)])}

    def forward_step(data_iterator, model):
        events.at(args.curr_iteration)
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
        return output, functools.partial(loss_func, batch["loss_mask"])

    return forward_step


def skip_updates_at(args: Any, optimizer: Any, iterations: frozenset[int]) -> None:
    """The optimizer reports an overflow (update_successful False, nothing applied) at these
    1-based iterations (module docstring)."""
    step = optimizer.step

    def overflowing_step():
        if args.curr_iteration + 1 in iterations:
            return False, None, None
        return step()

    optimizer.step = overflowing_step


def params_digest(model: list) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model[0].module.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().float().numpy().tobytes())
    return h.hexdigest()


def run(config: dict) -> dict:
    """One process's run: install(), Megatron's setup, load, train(); what happened."""
    from resume.adapters.megatron import install

    from resume.errors import ContinuityError, ResumeError

    save_dir = config["save_dir"]
    cpu_stream_patch()
    # As a launch script does, before Megatron parses; "install": false is Megatron alone (a run
    # whose saves resume never recorded).
    recorder = install(control_poll_s=0.0) if config.get("install", True) else None
    args, model, optimizer, scheduler = fresh(save_dir, tuple(config.get("extra", ())))
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.core.utils import get_model_config
    from megatron.training import training
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader

    training.update_train_iters(args)
    # setup_model_and_optimizer's load, through the name training.py calls.
    args.consumed_train_samples = 0
    args.skipped_train_samples = 0
    out: dict = {"losses": {}, "exit_code": None}
    try:
        with contextlib.redirect_stdout(sys.stderr):
            args.iteration, args.num_floating_point_operations_so_far = training.load_checkpoint(
                model, optimizer, scheduler, checkpointing_context={})
    except ContinuityError as e:
        out["error"] = {"type": type(e).__name__, "item": e.item, "expected": e.expected,
                        "actual": e.actual, "message": str(e)}
        return out
    except ResumeError as e:
        out["error"] = {"type": type(e).__name__, "message": str(e)}
        return out
    out["loaded"] = recorder.loaded.manifest.step if recorder is not None and recorder.loaded is not None else None
    out["start_iteration"] = args.iteration
    out["start_consumed"] = args.consumed_train_samples

    losses: dict = {}
    events = Events(config, save_dir)
    skip_updates_at(args, optimizer, frozenset(config.get("overflow_at", ())))
    loader = build_pretraining_data_loader(TokenDataset(), args.consumed_train_samples)
    try:
        with cuda_factories_on_cpu(), contextlib.redirect_stdout(sys.stderr):
            iteration, _ = training.train(make_forward_step(args, losses, events), model, optimizer, scheduler,
                                          RerunDataIterator(iter(loader)), None, None, get_model_config(model[0]), {}, None)
        out["iteration"] = iteration
    except SystemExit as e:  # --exit-signal-handler: train() saves, then sys.exit()
        out["exit_code"] = e.code
        out["iteration"] = None
    out["losses"] = {str(k): sum(v) / len(v) for k, v in sorted(losses.items())}
    out["params"] = params_digest(model)
    out["consumed"] = args.consumed_train_samples
    out["scheduler_steps"] = scheduler.num_steps
    out["last_committed"] = recorder.last_committed if recorder is not None else None
    return out


def _pretrain_stand_ins() -> None:
    """The stand-ins pretrain() needs beyond train()'s (module docstring), only without CUDA."""
    if torch.cuda.is_available():
        return
    from megatron.training import initialize, training

    training.initialize_megatron = functools.partial(initialize.initialize_megatron, allow_no_cuda=True)
    initialize._compile_dependencies = lambda: None
    training.set_jit_fusion_options = lambda **k: None
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.cuda.Stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


def run_pretrain(config: dict) -> dict:
    """One process's run through Megatron's pretrain() with resume installed."""
    from resume.adapters.megatron import install

    from support.megatron import cpu_patches, require_megatron
    from support.megatron_training_run import argv

    require_megatron()
    cpu_patches()
    cpu_stream_patch()
    save_dir = config["save_dir"]
    recorder = install(control_poll_s=0.0)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import global_vars, training
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    _pretrain_stand_ins()
    sys.argv = argv(save_dir, tuple(config.get("extra", ())))
    args = parse_args()
    validate_args(args, {})
    global_vars.set_global_variables(args, build_tokenizer=False)
    args.padded_vocab_size = calculate_padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, 1,
                                                         logging_enabled=False)
    store = config["out"] + ".store"
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)

    def model_provider(pre_process=True, post_process=True, config=None, pg_collection=None, vp_stage=None):
        return GPTModel(config=core_transformer_config_from_args(args), transformer_layer_spec=get_gpt_layer_local_spec(),
                        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                        pre_process=pre_process, post_process=post_process)

    def datasets(num_samples):
        return TokenDataset(), None, None

    datasets.is_distributed = True
    losses: dict = {}
    forward_step = make_forward_step(args, losses, Events(config, save_dir))
    with cuda_factories_on_cpu(), contextlib.redirect_stdout(sys.stderr):
        training.pretrain(pretrain_cfg_container_from_args(args), datasets, ModelType.encoder_or_decoder,
                          forward_step, model_provider=model_provider)
    return {"losses": {str(k): sum(v) / len(v) for k, v in sorted(losses.items())},
            "loaded": recorder.loaded.manifest.step if recorder.loaded is not None else None,
            "last_committed": recorder.last_committed, "consumed": args.consumed_train_samples}


def _write_json(path: str, body: object) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(body, f)
    os.replace(path + ".tmp", path)


# -- the parent's side --------------------------------------------------------------------------


def argv_for(save_dir: str, iterations: int, save_interval: int, extra: tuple[str, ...] = ()) -> list[str]:
    """Flags on top of support.megatron_training_run.argv: the loop's length and saves."""
    return ["--train-samples", str(iterations * GBS), "--save-interval", str(save_interval),
            "--num-workers", "0", "--log-interval", "1", "--eval-iters", "0", *extra]


def start(tmp_dir: str, name: str, env: dict[str, str] | None = None,
          **config: Any) -> tuple[subprocess.Popen, str]:
    """Start a run in a fresh process (``env``: added to this one's); (process, path of its result JSON)."""
    out = os.path.join(tmp_dir, f"{name}.json")
    config["out"] = out
    config_path = os.path.join(tmp_dir, f"{name}.config.json")
    _write_json(config_path, config)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", **(env or {}))
    with open(os.path.join(tmp_dir, f"{name}.log"), "w") as log:  # the child keeps its own copy
        proc = subprocess.Popen([sys.executable, "-m", "support.megatron_train_loop", config_path],
                                cwd=TESTS_DIR, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, out


def log_tail(tmp_dir: str, name: str, n: int = 40) -> str:
    with open(os.path.join(tmp_dir, f"{name}.log")) as f:
        return "".join(f.readlines()[-n:])


def run_to_end(tmp_dir: str, name: str, timeout_s: float = 120, **config: Any) -> dict:
    proc, out = start(tmp_dir, name, **config)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"{name}: still running after {timeout_s}s\n{log_tail(tmp_dir, name)}") from None
    if rc != 0 or not os.path.exists(out):
        raise AssertionError(f"{name}: exit code {rc}\n{log_tail(tmp_dir, name)}")
    with open(out) as f:
        return json.load(f)


def kill_when_holding(tmp_dir: str, name: str, timeout_s: float = 120, **config: Any) -> int:
    """Start a run with ``hold_at``; SIGKILL it once it holds there. The signal's return code."""
    proc, out = start(tmp_dir, name, **config)
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(out + ".holding"):
        if proc.poll() is not None:
            raise AssertionError(f"{name}: exited ({proc.returncode}) before holding\n{log_tail(tmp_dir, name)}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{name}: did not reach iteration {config['hold_at']}\n{log_tail(tmp_dir, name)}")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    return proc.wait(timeout=30)


def start_ranks(tmp_dir: str, name: str, world_size: int, env: dict[str, str] | None = None,
                **config: Any) -> list[tuple[subprocess.Popen, str]]:
    """Start one run on ``world_size`` ranks (gloo, a file store), one process each, as torchrun
    would (``RANK``, ``WORLD_SIZE``); rank R is named ``NAME-rankR``."""
    store = os.path.join(tmp_dir, f"{name}.store")
    return [start(tmp_dir, f"{name}-rank{rank}", env=dict(env or {}, RANK=str(rank), WORLD_SIZE=str(world_size)),
                  rank=rank, world_size=world_size, store=store, **config)
            for rank in range(world_size)]


def wait_ranks(tmp_dir: str, name: str, procs: list[tuple[subprocess.Popen, str]], timeout_s: float = 180) -> list[dict]:
    """Each rank's result once every rank exited 0 (all killed when one fails or time runs out)."""
    deadline = time.monotonic() + timeout_s
    for rank, (proc, _) in enumerate(procs):
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        if rc != 0:
            kill(procs)
            raise AssertionError(f"{name} rank {rank}: exit code {rc} (None: still running after {timeout_s}s)\n"
                                 f"{log_tail(tmp_dir, f'{name}-rank{rank}')}")
    results = []
    for _, out in procs:
        with open(out) as f:
            results.append(json.load(f))
    return results


def kill(procs: list[tuple[subprocess.Popen, str]]) -> list[int]:
    """SIGKILL every rank still running; their return codes."""
    for proc, _ in procs:
        if proc.poll() is None:
            proc.kill()
    return [proc.wait(timeout=30) for proc, _ in procs]


def main(config_path: str) -> None:
    with open(config_path) as f:
        config = json.load(f)
    if config.get("world_size", 1) > 1:  # before Megatron's setup, which then finds it initialised
        torch.distributed.init_process_group("gloo", init_method=f"file://{config['store']}",
                                             rank=config["rank"], world_size=config["world_size"])
    result = run_pretrain(config) if config.get("entry") == "pretrain" else run(config)
    _write_json(config["out"], result)
    torch.distributed.destroy_process_group()
    # A normal exit: the recorder's atexit handler releases the save directory's lease.


if __name__ == "__main__":
    main(sys.argv[1])
