"""``resume plan | simulate``: the parallel layout of a run, and its failures simulated."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from ..cluster.reference import DEFAULT_INPUTS
from ..errors import EXIT_OK, EXIT_USAGE, UsageError
from .common import command, emit_json, json_option

if TYPE_CHECKING:
    from ..cluster.layout import Layout
    from ..layout import ParallelLayout
    from ..relayout import Candidate
    from ..run import Run

__all__ = ["layout_options", "plan", "plan_from_run", "print_layout", "print_restorable", "print_simulation",
           "simulate"]


def layout_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed([
        click.option("--nodes", type=int, default=640, show_default=True),
        click.option("--gpus-per-node", type=int, default=8, show_default=True),
        click.option("--tp", type=int, default=8, show_default=True, help="Tensor-parallel size."),
        click.option("--pp", type=int, default=8, show_default=True, help="Pipeline-parallel size."),
        click.option("--cp", type=int, default=1, show_default=True, help="Context-parallel size."),
        click.option("--spares", type=int, default=0, show_default=True,
                     help="Hot-spare nodes inside the allocation."),
        click.option("--global-batch", type=int, default=1920, show_default=True),
        click.option("--micro-batch", type=int, default=1, show_default=True),
    ]):
        fn = option(fn)
    return fn


@click.command()
@layout_options
@click.option("--from-run", "from_run", metavar="RUN", default=None,
              help="List the layouts the run's newest committed checkpoint can be restored on over "
                   "--nodes x --gpus-per-node ranks (--tp, --pp, --cp given: only those).")
@json_option
@command
def plan(nodes: int, gpus_per_node: int, tp: int, pp: int, cp: int, spares: int, global_batch: int,
         micro_batch: int, from_run: str | None, as_json: bool) -> int:
    """The parallel layout: replicas, spares, valid data-parallel sizes, checkpoint interval.

    Defaults are the reference run: 640 nodes x 8 GPUs, TP8 x PP8 x DP80,
    global batch 1,920. Exits 2 for a layout that does not fit.

    With --from-run RUN --nodes N: every TP x PP x CP x DP over the N x G ranks (spares left out)
    that splits the checkpoint's global batch, each marked as a restore would judge it: as
    saved, resharded (its shards load exactly there) or refused, with why. Exits 2 when none
    loads it (or for bad usage), 3 when RUN has no committed checkpoint or its newest records
    no layout, 1 when none of its step directories holds a valid one.
    """
    if from_run is not None:
        return plan_from_run(from_run, nodes=nodes, gpus_per_node=gpus_per_node, spares=spares,
                             micro_batch=micro_batch, global_batch=global_batch,
                             only={"tensor": tp, "pipeline": pp, "context": cp}, as_json=as_json)
    from ..cluster.layout import Layout
    from ..cluster.simulate import Assumptions, best_interval, plan_spares

    layout = Layout(nodes=nodes, gpus_per_node=gpus_per_node, tp=tp, pp=pp, cp=cp, spares=spares,
                    global_batch=global_batch, micro_batch=micro_batch)
    shrunk = layout.shrink_after(spares + 1)
    sim = Assumptions(nodes=layout.dp * layout.nodes_per_replica, gpus_per_node=gpus_per_node,
                      spares=spares, shrink_factor=max(shrunk, 1) / layout.dp)
    best, yd = best_interval(sim)
    recommended, _ = plan_spares(sim, best.interval_s)
    body = {**layout.to_dict(), "checkpoint_interval_s": round(best.interval_s),
            "young_daly_interval_s": round(yd), "recommended_spares": recommended,
            "simulation": "resume simulate (default assumptions)"}
    if as_json:
        emit_json(body)
        return EXIT_OK
    print_layout(layout, best.interval_s, yd, recommended)
    return EXIT_OK


def _given(name: str) -> bool:
    """Whether option ``name`` was given (on the command line or by its environment variable)."""
    source = click.get_current_context().get_parameter_source(name)
    return source not in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)


def plan_from_run(run_url: str, *, nodes: int, gpus_per_node: int, spares: int, micro_batch: int,
                  global_batch: int, only: dict[str, int], as_json: bool) -> int:
    """``plan --from-run``: the layouts the newest committed checkpoint of ``run_url`` can be
    restored on, over ``nodes - spares`` nodes of ``gpus_per_node`` ranks."""
    from ..relayout import batch_sizes, restorable_layouts, saved_layout
    from ..run import Run

    _check_counts(nodes, gpus_per_node, spares)
    run = Run.open(run_url)
    manifest, passed_over = run.find_latest()
    if manifest is None:
        manifest = run.latest_or_raise()  # raises: none committed (exit 3), none valid of those there (exit 1)
    source = run.storage.url(run.manifest_path(manifest.step))
    saved = saved_layout(manifest.topology, source=source)
    gb, mb = batch_sizes(manifest.config, source=source, micro_batch=micro_batch if _given("micro_batch") else None)
    if _given("global_batch") and global_batch != gb:
        raise UsageError(f"--global-batch: expected the checkpoint's global batch {gb} (a restore keeps it), "
                         f"actual {global_batch}")
    world = (nodes - spares) * gpus_per_node
    found = restorable_layouts(saved, world_size=world, gpus_per_node=gpus_per_node, global_batch=gb,
                               micro_batch=mb, only={k: v for k, v in only.items() if _given(_OPTION[k])})
    body = {"run": run.url, "step": manifest.step, "iteration": manifest.train_state.iteration,
            "saved": saved.to_dict(), "saved_description": saved.describe(), "nodes": nodes, "spares": spares,
            "gpus_per_node": gpus_per_node, "world_size": world, "global_batch": gb, "micro_batch": mb,
            "passed_over": [{"step": r.step, "reason": r.reason} for r in passed_over],
            "layouts": [c.to_dict() for c in found]}
    if as_json:
        emit_json(body)
    else:
        print_restorable(run, manifest.step, saved, body, found)
    if any(c.verdict != "refused" for c in found):
        return EXIT_OK
    click.echo(f"resume: error: {run.url}: {run.dirname(manifest.step)}: layouts over {world} ranks: expected "
               f"one that loads the checkpoint, actual none of {len(found)}", err=True)
    return EXIT_USAGE


_OPTION = {"tensor": "tp", "pipeline": "pp", "context": "cp"}


def _check_counts(nodes: int, gpus_per_node: int, spares: int) -> None:
    """``plan --from-run``'s node counts: --nodes given, every count positive, spares fewer than nodes."""
    if not _given("nodes"):
        raise UsageError("plan --from-run: --nodes: expected the number of nodes to restore on, actual none given")
    if nodes < 1 or gpus_per_node < 1:
        raise UsageError(f"plan --from-run: --nodes, --gpus-per-node: expected positive integers, actual "
                         f"{nodes}, {gpus_per_node}")
    if not 0 <= spares < nodes:
        raise UsageError(f"plan --from-run: --spares: expected 0..{nodes - 1}, actual {spares}")


def print_restorable(run: Run, step: int, saved: ParallelLayout, body: dict[str, Any],
                     found: list[Candidate]) -> None:
    """``plan --from-run``'s lines: the checkpoint and its layout, each layout a restore may run
    on (as saved, resharded: what changes), then the refused ones by reason."""
    from .show import layout_lines

    for r in body["passed_over"]:
        click.echo(f"passed over {run.dirname(r['step'])}: {r['reason']}")
    click.echo(f"checkpoint    {run.dirname(step)} (iteration {body['iteration']}, global batch "
               f"{body['global_batch']}, micro-batch {body['micro_batch']}) of {run.url}")
    for line in layout_lines({"layout": body["saved"]}, source=run.url, indent="", label="saved on"):
        click.echo(line)
    nodes = body["nodes"] - body["spares"]
    click.echo(f"restore on    {nodes} node{'s' if nodes != 1 else ''} x {body['gpus_per_node']} GPUs = "
               f"{body['world_size']} ranks; DP divides {body['global_batch'] // body['micro_batch']} "
               f"micro-batches; {len(found)} layouts")
    shown = [c for c in found if c.verdict != "refused"]
    if shown:
        click.echo(f"  {'layout':<28}  {'replicate x shard':>17}  verdict")
    for c in shown:
        what = c.verdict + (f" ({c.change_text(saved)})" if c.changed else "")
        click.echo(f"  {c.degrees_text():<28}  {f'{c.layout.dp_replicate} x {c.layout.dp_shard}':>17}  {what}")
    if not shown:
        click.echo("  none: no layout over these ranks loads this checkpoint")
    refused: dict[str, list[Candidate]] = {}
    for c in found:
        if c.verdict == "refused":
            refused.setdefault(c.why, []).append(c)
    for why, cs in refused.items():
        names = ", ".join(c.degrees_text() for c in cs[:4]) + (f", ... ({len(cs)} layouts)" if len(cs) > 4 else "")
        click.echo(f"  refused     {names}: {why}")


def print_layout(layout: Layout, interval_s: float, yd: float, recommended: int) -> None:
    """``plan``'s lines for ``layout``, its checkpoint interval, Young/Daly's and the
    recommended spares."""
    nodes, gpus_per_node, spares = layout.nodes, layout.gpus_per_node, layout.spares
    tp, pp, cp = layout.tp, layout.pp, layout.cp
    global_batch, micro_batch = layout.global_batch, layout.micro_batch
    d, npr = layout.dp, layout.nodes_per_replica
    click.echo(f"layout     {nodes} nodes x {gpus_per_node} GPUs; TP{tp} x PP{pp} x CP{cp} x DP{d} "
               f"= {layout.world_size} ranks (Megatron order tp-cp-dp-pp)")
    example = layout.replica_nodes(0)
    shown = ", ".join(map(str, example[:4])) + (", ..." if len(example) > 4 else "")
    click.echo(f"replicas   {d} of {npr} nodes each (replica 0: nodes {shown}); one failed node "
               f"takes its replica out")
    click.echo(f"spares     {spares} (nodes {layout.spare_nodes[:1] + layout.spare_nodes[-1:]})"
               if spares else "spares     0")
    if layout.idle_nodes:
        click.echo(f"idle       {layout.idle_nodes} nodes fit no whole valid replica count")
    click.echo(f"one node lost without a free spare: DP {d} -> {layout.shrink_after(spares + 1)} "
               "(global batch kept)")
    click.echo(f"global batch {global_batch} = micro-batch {micro_batch} x "
               f"{layout.micro_batches_per_rank(d)} micro-batches x DP{d}")
    click.echo(f"{'dp':>5}  {'nodes':>6}  {'micro-batches/rank':>18}  {'global batch if micro-batches/rank kept':>40}")
    for v in layout.valid_dp:
        click.echo(f"{v:>5}  {v * npr:>6}  {layout.micro_batches_per_rank(v):>18}  "
                   f"{layout.global_batch_at_constant_micro_batches(v):>40}")
    click.echo(f"checkpoint every ~{interval_s / 60:.0f} min (Young/Daly {yd / 60:.0f} min); "
               f"recommended spares {recommended} (resume simulate for the assumptions)")


@click.command()
@click.option("--nodes", type=int, default=640, show_default=True, help="Nodes that train.")
@click.option("--spares", type=int, default=0, show_default=True)
@click.option("--node-mtbf-hours", type=float, default=None,
              help="Mean time between failures of one node [default: Llama 3's 419 interruptions "
                   "in 54 days on 16,384 GPUs, 8 GPUs per node].")
@click.option("--distribution", type=click.Choice(["exponential", "weibull"]), default="exponential",
              show_default=True)
@click.option("--weibull-shape", type=float, default=0.7, show_default=True)
@click.option("--stall-s", type=float, default=None,
              help="Training time lost to each checkpoint [default: the reference run's save stall, "
                   "computed (--reference)].")
@click.option("--restart-spare-s", type=float, default=None,
              help="Detect, relaunch on a spare, restore [default: the reference run's, computed].")
@click.option("--restart-requeue-s", type=float, default=None,
              help="Requeue, wait in the queue, start, restore [default: the reference run's, computed].")
@click.option("--hang-rate-per-node-day", type=float, default=None,
              help="Hangs per node per day (a rank stops making progress without dying), on top of the "
                   "failures [default: assumed, a tenth of Llama 3's interruption rate per node].")
@click.option("--hang-detect-s", type=float, default=None,
              help="Nothing trains from a hang until its step is gone: the watchdog's bound, the stack "
                   "reports, the stop; the restart follows [default: the reference run's, computed].")
@click.option("--fs-bandwidth-gbs", type=float, default=DEFAULT_INPUTS.fs_bandwidth_gbs, show_default=True,
              help="Shared file system bandwidth, aggregate, GB/s (assumed): the reference run's bulk "
                   "write and read times.")
@click.option("--d2h-gbs", type=float, default=DEFAULT_INPUTS.d2h_gbs, show_default=True,
              help="Device-to-host copy bandwidth per GPU, GB/s (assumed): the asynchronous save's "
                   "staging copy.")
@click.option("--queue-wait-s", type=float, default=DEFAULT_INPUTS.queue_wait_s, show_default=True,
              help="Wait in the queue after a requeue (assumed): the restart after a requeue.")
@click.option("--save", "save_mode", type=click.Choice(["async", "sync"]), default=DEFAULT_INPUTS.save,
              show_default=True, help="Whose stall is the default --stall-s: an asynchronous or a "
                                      "synchronous save's.")
@click.option("--reference", is_flag=True,
              help="Print the reference run's figures (measured, assumed, computed, each with its "
                   "source) at these inputs, and simulate nothing.")
@click.option("--repair-hours", type=float, default=72.0, show_default=True)
@click.option("--no-spare", type=click.Choice(["shrink", "requeue"]), default="shrink",
              show_default=True, help="With no spare free: run on fewer replicas until the next "
                                      "requeue (the hook's policy), or requeue at once.")
@click.option("--shrink-factor", type=float, default=0.8, show_default=True,
              help="Speed on fewer replicas (DP 64 / 80 for the reference).")
@click.option("--time-limit-hours", type=float, default=24.0, show_default=True,
              help="The job's time limit: each requeue starts at full size again.")
@click.option("--days", type=float, default=90.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@json_option
@command
def simulate(nodes: int, spares: int, node_mtbf_hours: float | None, distribution: str,
             weibull_shape: float, stall_s: float | None, restart_spare_s: float | None,
             restart_requeue_s: float | None, hang_rate_per_node_day: float | None,
             hang_detect_s: float | None, fs_bandwidth_gbs: float, d2h_gbs: float,
             queue_wait_s: float, save_mode: str, reference: bool, repair_hours: float, no_spare: str,
             shrink_factor: float, time_limit_hours: float, days: float, seed: int, as_json: bool) -> int:
    """Simulate failures and hangs of a long run: goodput, work lost, best checkpoint interval, spares.

    The stall, restart and hang detection times default to the reference run's (640 nodes, 500B
    parameters): its measured control plane, the assumed inputs below, and their sums; the
    hang rate is assumed. The output says where each came from. --reference prints every
    figure with its source.
    """
    from ..cluster.reference import Inputs, figures, markdown_table, simulate_defaults
    from ..cluster.simulate import HANG_RATE_SOURCE, Assumptions, report

    inputs = Inputs(fs_bandwidth_gbs=fs_bandwidth_gbs, d2h_gbs=d2h_gbs, queue_wait_s=queue_wait_s,
                    save=save_mode)
    if reference:
        figs = figures(inputs)
        if as_json:
            emit_json({key: fig.to_dict() for key, fig in figs.items()})
        else:
            click.echo(markdown_table(figs))
        return EXIT_OK
    given = {"stall_s": stall_s, "restart_spare_s": restart_spare_s, "restart_requeue_s": restart_requeue_s,
             "hang_detect_s": hang_detect_s}
    computed = simulate_defaults(inputs)
    times = {name: computed[name].value if value is None else value for name, value in given.items()}
    sources = {name: computed[name].source if value is None else "given" for name, value in given.items()}
    sources["hang_rate_per_node_day"] = HANG_RATE_SOURCE if hang_rate_per_node_day is None else "given"
    kwargs = {} if node_mtbf_hours is None else {"node_mtbf_s": node_mtbf_hours * 3600}
    if hang_rate_per_node_day is not None:
        kwargs["hang_rate_per_node_day"] = hang_rate_per_node_day
    a = Assumptions(nodes=nodes, spares=spares, distribution=distribution, weibull_shape=weibull_shape,
                    repair_s=repair_hours * 3600, no_spare=no_spare, shrink_factor=shrink_factor,
                    requeue_every_s=time_limit_hours * 3600, days=days, seed=seed, **times, **kwargs)
    r = {**report(a), "sources": sources}
    if as_json:
        emit_json(r)
        return EXIT_OK
    print_simulation(r, sources, nodes=nodes, days=days)
    return EXIT_OK


def print_simulation(r: dict[str, Any], sources: dict[str, str], *, nodes: int, days: float) -> None:
    """``simulate``'s lines for its report ``r`` and where its times came from."""
    click.echo("assumptions:")
    for key, value in r["assumptions"].items():
        click.echo(f"  {key:<18} {value:.6g}" if isinstance(value, float) else f"  {key:<18} {value}")
    click.echo("where the stall, restart and hang figures came from (resume simulate --reference):")
    for key, source in sources.items():
        click.echo(f"  {key:<18} {source}")
    click.echo(f"  {'job MTBF':<18} {r['system_mtbf_s'] / 3600:.2f} h ({nodes} nodes); with hangs "
               f"{r['interruption_mtbf_s'] / 3600:.2f} h (Young/Daly's MTBF)")
    click.echo(f"result over {days:g} days ({r['failures']} failures, {r['hangs']} hangs on average):")
    click.echo(f"  goodput            {r['goodput']:.4f}")
    click.echo(f"  best interval      {r['best_interval_s']:.0f} s  (Young/Daly sqrt(2*C*MTBF) = "
               f"{r['young_daly_interval_s']:.0f} s, ratio {r['interval_ratio']:.2f})")
    click.echo(f"  work lost          {r['work_lost_hours']:.1f} h; restarts {r['restart_hours']:.1f} h; "
               f"checkpoint stalls {r['stall_hours']:.1f} h")
    click.echo(f"  hangs              {r['hangs']}; hang detection {r['hang_detect_hours']:.1f} h lost "
               f"(nothing trains until the hung step is gone, then a restart)")
    click.echo(f"  recommended spares {r['recommended_spares']} (best goodput per allocated node)")
