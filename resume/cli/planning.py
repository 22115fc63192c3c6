"""``resume plan | simulate``: the parallel layout of a run, and its failures simulated."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from ..cluster.reference import DEFAULT_INPUTS
from ..errors import EXIT_OK
from .common import command, emit_json, json_option

if TYPE_CHECKING:
    from ..cluster.layout import Layout

__all__ = ["layout_options", "plan", "print_layout", "print_simulation", "simulate"]


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
@json_option
@command
def plan(nodes: int, gpus_per_node: int, tp: int, pp: int, cp: int, spares: int, global_batch: int,
         micro_batch: int, as_json: bool) -> int:
    """The parallel layout: replicas, spares, valid data-parallel sizes, checkpoint interval.

    Defaults are the reference run: 640 nodes x 8 GPUs, TP8 x PP8 x DP80,
    global batch 1,920. Exits 2 for a layout that does not fit.
    """
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
