"""The reference run's save and restart costs, each figure with where it came from.

The reference run (``layout.REFERENCE``: a 500B-parameter model, TP8 x PP8 x DP80, bf16 weights,
fp32 master weights and AdamW moments in a distributed optimizer) cannot run here. Every
``Figure`` names its kind in its ``source``: ``measured`` (the control plane, from
``benchmarks/scale.py``; ``MEASURED`` is the one place to update after a new run), ``assumed``
(what cannot be measured here, with its reasoning; ``Inputs`` are the ones ``resume simulate``
takes as options) or ``computed`` (arithmetic over both, the formula in the source).

The model must stay true to the code: the save modelled is the ``Coordinator``'s over DCP, rank 0
writing ``.metadata`` and the index (``index.resume``) before the commit; an asynchronous save
blocks the loop for rank 0's gather and the staging copy only, a synchronous one for all of it. A
restore reads the index on rank 0 and sends each rank its own entries; each rank plans its load
from them, and the load checks the shards' checksums from the bytes it reads, so every byte is
read once. The ``.metadata`` path (vetted by rank 0 and sent to every rank) is for checkpoints
written before the index and is shown apart.
``resume simulate --reference`` prints the table; docs/performance.md and runbooks/slurm.md
carry it, and tests/test_reference_figures.py checks that they match.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from resume.errors import UsageError
from resume.watchdog import BEAT_S, HANG_FACTOR, HANG_FLOOR_S, TICK_S

from .hangs import COLLECT_S, STOP_STAGES
from .layout import REFERENCE

__all__ = ["DEFAULT_INPUTS", "MEASURED", "Figure", "Inputs", "Measured", "figures", "markdown_table",
           "simulate_defaults"]

PARAMETERS = 500e9
"""The reference model's parameters."""
CHECKPOINT_BYTES_PER_PARAMETER = 2 + 4 + 4 + 4
"""bf16 weights (2) + fp32 master weights (4) + AdamW exp_avg (4) + exp_avg_sq (4)."""
MODEL_BYTES_PER_PARAMETER = 2
"""The bf16 weights: every data-parallel replica holds its TP x PP shard of them."""
OPTIMIZER_BYTES_PER_PARAMETER = CHECKPOINT_BYTES_PER_PARAMETER - MODEL_BYTES_PER_PARAMETER
"""fp32 master weights and both moments: the distributed optimizer shards them over DP too."""
SEQUENCE_TOKENS = 8192
"""Tokens per sequence of the reference run (its global batch is ``REFERENCE.global_batch`` sequences)."""
ASSUMED_GPU_TFLOPS = 400.0
"""Sustained bf16 TFLOP/s per GPU, assumed: only to show that an iteration is shorter than the
hang bound's floor divided by its factor, so that the floor is the bound."""
STOP_ESCALATION_S = sum(patience for _, patience in STOP_STAGES)
"""A hung step's stop, every stage's patience spent in full (cluster/hangs.py: ``STOP_STAGES``)."""
GB = 1e9
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Figure:
    """One number of the reference run and where it came from."""

    value: float
    unit: str
    source: str
    """Starts with ``measured:``, ``computed:`` or ``assumed:``, then what a reader can check."""

    def shown(self) -> str:
        return f"{_number(self.value)} {self.unit}"

    def to_dict(self) -> dict:
        return {"value": self.value, "unit": self.unit, "source": self.source}


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


# -- measured: update these after a new run of benchmarks/scale.py ------------------------------

MEASURED_BY = ("python benchmarks/scale.py --ranks 5120 --json (2-core VM, torch 2.13.0+cpu), "
               "at 5,120 ranks")


@dataclass(frozen=True, kw_only=True, slots=True)
class Measured:
    """The control plane's figures at 5,120 ranks (the keys of scale.py's JSON in brackets)."""

    save_control_plane_s: float
    """Rank 0's time per save: gather and assembly, manifest write, retention (rank0_save_s,
    the mean over the saves once retention deletes)."""
    save_gather_s: float
    """Of it, the gathers and the assembly of every rank's part, and the rest that is neither
    the manifest write nor retention (rank0_save_parts_s.gather_and_rest)."""
    save_received_bytes: float
    """Bytes each rank receives per save, ours and DCP's with the cached plan
    (bytes_per_rank_per_save + dcp_bytes_per_rank_per_save_cached)."""
    manifest_parse_s: float
    """One manifest read and parsed (manifest_parse_s)."""
    discovery_s: float
    """``Run.find_latest``: the commit check of every listed file (find_latest_s)."""
    restore_control_plane_s: float
    """Rank 0's restore without the shard I/O and without the index: discovery, manifest,
    checksums of its share, rank state, the load of tiny shards, the continuity check
    (rank0_restore_s)."""
    metadata_mib: float
    """DCP's ``.metadata`` for the reference layout (metadata_bytes)."""
    results_gather_s: float
    """Rank 0 unpickling every rank's write results at the end of a save, packed as the adapter's
    writer sends them (results_gather_s)."""
    metadata_write_s: float
    """Rank 0 writing ``.metadata`` at a save of the same plan as the save before, laid out from
    those results' columns and the plan's tables (metadata_write_s)."""
    metadata_write_first_s: float
    """The same at a process's first save, which makes the plan's tables
    (metadata_write_first_s)."""
    index_mib: float
    """The index, ``index.resume``, for the reference layout (index_bytes)."""
    index_write_s: float
    """Rank 0 encoding and writing the index at a save of the same plan as the save before (what
    the plan alone decides is kept from it; index_write_s)."""
    index_write_first_s: float
    """The same at a process's first save (index_write_first_s)."""
    finish_s: float
    """Rank 0's end of a save of the same plan as the save before, every rank's results the same
    as then: the results gathered and read into columns, ``.metadata`` and the index written;
    every rank waits for it (finish_s)."""
    finish_first_s: float
    """The same at a process's first save (finish_first_s)."""
    finish_changed_s: float
    """The same at a later save where one rank's entry changed size, so nothing of the last
    save's layout is kept (finish_changed_s)."""
    index_rank0_s: float
    """Rank 0 at restore: the index read, checked and each of the 5,120 ranks' entries selected
    (index_rank0_s), and the requests unpickled and answers pickled (index_rank0_comm_s)."""
    index_other_rank_s: float
    """Every rank at restore, after rank 0: its DCP Metadata built from its answer, the largest
    (index_other_rank_s)."""
    dcp_plan_s: float
    """DCP's global save plan, no plan cache (dcp_plan_s)."""
    dcp_plan_cached_s: float
    """The same with DCP's plan cache, unchanged plans (dcp_plan_cached_s)."""
    load_plan_s: float
    """One rank's DCP load planning from its own entries, as ``dcp.load(no_dist=True)`` plans
    (load_plan_s)."""
    load_plan_full_metadata_s: float
    """The same from the whole Metadata, as plain ``dcp.load`` plans on every rank
    (load_plan_full_metadata_s)."""
    restore_received_kib: float
    """Bytes each rank receives at restore: the collectives and its index answer
    (restore_bytes_received_per_rank)."""
    metadata_restricted_s: float
    """Before the index: our allow-list unpickler on ``.metadata`` (metadata_unpickle_s of a run
    at 640 ranks, ``--ranks 640 --unpickle-cap-mb 80``, extrapolated to 5,120's size at its
    seconds per byte): rank 0 at the restore of a checkpoint written before the index."""
    metadata_pickle_s: float
    """Before the index: ``pickle.dumps`` of the loaded ``.metadata`` (metadata_pickle_s): rank 0,
    to send it."""
    metadata_unpickle_s: float
    """Before the index: plain ``pickle.loads`` of that ``.metadata`` (metadata_plain_unpickle_s):
    every other rank, of the object rank 0 sends."""


MEASURED = Measured(save_control_plane_s=0.706, save_gather_s=0.294, save_received_bytes=290,
                    manifest_parse_s=0.051, discovery_s=0.104, restore_control_plane_s=1.58,
                    metadata_mib=553.3, results_gather_s=0.937, metadata_write_s=1.99, metadata_write_first_s=10.8,
                    index_mib=207.3, index_write_s=0.177, index_write_first_s=2.33, finish_s=3.40,
                    finish_first_s=14.7, finish_changed_s=5.39, index_rank0_s=2.67, index_other_rank_s=0.016,
                    dcp_plan_s=79.3, dcp_plan_cached_s=0.0004, load_plan_s=0.013, load_plan_full_metadata_s=0.240,
                    restore_received_kib=1372.8, metadata_restricted_s=226.3, metadata_pickle_s=57.8,
                    metadata_unpickle_s=97.8)


# -- assumed: the inputs -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Inputs:
    """What cannot be measured here and moves the figures most; ``resume simulate`` options."""

    fs_bandwidth_gbs: float = 100.0
    """Shared file system bandwidth, aggregate over the job, GB/s (``--fs-bandwidth-gbs``)."""
    d2h_gbs: float = 10.0
    """Device-to-host copy bandwidth per GPU into pageable host memory, GB/s (``--d2h-gbs``)."""
    queue_wait_s: float = 600.0
    """After a requeue, until Slurm has 640 healthy nodes for the job again (``--queue-wait-s``)."""
    save: str = "async"
    """Which save's stall ``resume simulate`` uses: 'async' or 'sync' (``--save``)."""

    def __post_init__(self) -> None:
        if self.save not in ("async", "sync"):
            raise UsageError(f"simulate: save: expected 'async' or 'sync', actual {self.save!r}")
        for name in ("fs_bandwidth_gbs", "d2h_gbs"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise UsageError(f"simulate: {name}: expected a finite number > 0, actual {value}")
        if not (math.isfinite(self.queue_wait_s) and self.queue_wait_s >= 0):
            raise UsageError(f"simulate: queue_wait_s: expected a finite number >= 0, actual {self.queue_wait_s}")


DEFAULT_INPUTS = Inputs()


def _input_sources(i: Inputs) -> dict[str, Figure]:
    default = DEFAULT_INPUTS

    def given_or(name: str, reason: str) -> str:
        if getattr(i, name) == getattr(default, name):
            return f"assumed: {reason}"
        return f"given: --{name.replace('_', '-')}"

    return {
        "fs_bandwidth": Figure(i.fs_bandwidth_gbs, "GB/s", given_or(
            "fs_bandwidth_gbs", "a parallel file system's aggregate bandwidth for one 640-node job, "
            "not measured (this VM's disk writes about 0.6 GB/s); set --fs-bandwidth-gbs")),
        "d2h": Figure(i.d2h_gbs, "GB/s", given_or(
            "d2h_gbs", "per GPU, into pageable host memory as the staging copy makes it (PCIe Gen5 "
            "x16 carries 64 GB/s; pageable copies reach a fraction of it); no GPU here to measure; "
            "set --d2h-gbs")),
        "queue_wait": Figure(i.queue_wait_s, "s", given_or(
            "queue_wait_s", "until 640 healthy nodes are free for the requeued job: none on a "
            "reservation with nodes to spare, hours on a busy shared cluster; set --queue-wait-s")),
    }


# -- the table -----------------------------------------------------------------------------------

LABELS = {
    "fs_bandwidth": "input: shared file system bandwidth (aggregate)",
    "d2h": "input: device-to-host copy bandwidth per GPU",
    "queue_wait": "input: queue wait after a requeue",
    "checkpoint": "checkpoint size",
    "staged_per_rank": "bytes each rank stages (asynchronous save)",
    "save_control_plane": "rank 0 control plane per save",
    "save_gather": "rank 0 gather and assembly per save",
    "save_received": "bytes each rank receives per save (ours and DCP's, cached plan)",
    "discovery": "discovery (`Run.find_latest`)",
    "manifest_parse": "manifest parse",
    "restore_control_plane": "rank 0 restore without shard I/O and the index",
    "metadata": "DCP `.metadata` size",
    "results_gather": "write results gathered to rank 0 at each save",
    "metadata_write": "`.metadata` written by rank 0 at each save",
    "index": "index (`index.resume`) size",
    "index_write": "index written by rank 0 at each save",
    "index_rank0": "index read, checked and answered by rank 0 at restore",
    "index_other_rank": "each rank's own load Metadata built from its answer",
    "restore_received": "bytes each rank receives at restore",
    "dcp_plan": "DCP global save plan, no cache",
    "dcp_plan_cached": "DCP global save plan, cached",
    "bulk_write": "bulk write of the shards",
    "staging": "staging copy (asynchronous save)",
    "stall_sync": "save stall, synchronous",
    "stall_async": "save stall, asynchronous",
    "async_background": "asynchronous save's background work",
    "bulk_read": "bulk read at restore (checksums from the bytes the load reads)",
    "dcp_load_plan": "DCP load planning, each rank",
    "metadata_legacy": "`.metadata` at the restore of a checkpoint written before the index",
    "detect": "failure detected, step ended",
    "process_start": "processes started, model and optimizer built",
    "dist_init": "`torch.distributed` initialized",
    "requeue_hold": "requeue hold",
    "scheduling": "Slurm scheduling pass",
    "restart_spare": "restart on a spare, to first iteration",
    "restart_requeue": "restart after a requeue, to first iteration",
    "hang_detect": "hang detected, stack reports collected (during iterations)",
    "hang_stop": "hung step stopped (TERM, KILL to the step, KILL)",
    "hang_recovery": "hang: last progress to first iteration, on a spare or the same nodes",
}
"""Every figure's row in the table, in order."""


def figures(inputs: Inputs = DEFAULT_INPUTS, measured: Measured = MEASURED) -> dict[str, Figure]:
    """Every figure of the reference run at these inputs, in the table's order (``LABELS``)."""
    m, i, ref = measured, inputs, REFERENCE
    f = _input_sources(i)
    by = f"measured: {MEASURED_BY},"

    # Phase 1, sizes: the whole checkpoint, and what one rank holds and stages.
    checkpoint_b = PARAMETERS * CHECKPOINT_BYTES_PER_PARAMETER
    f["checkpoint"] = Figure(checkpoint_b / 1e12, "TB", (
        f"computed: {PARAMETERS / 1e9:.0f}e9 parameters x (2 bf16 weights + 4 fp32 master + "
        f"4 exp_avg + 4 exp_avg_sq) bytes"))
    model_shard = PARAMETERS * MODEL_BYTES_PER_PARAMETER / (ref.tp * ref.pp)
    optimizer_shard = PARAMETERS * OPTIMIZER_BYTES_PER_PARAMETER / ref.world_size
    f["staged_per_rank"] = Figure((model_shard + optimizer_shard) / GB, "GB", (
        f"computed: its TP{ref.tp} x PP{ref.pp} shard of the bf16 weights ({model_shard / GB:.3g} GB, "
        f"held by every replica) + its 1/{ref.world_size:,} of the optimizer state "
        f"({optimizer_shard / GB:.3g} GB); the staging copy takes the rank's whole state"))

    # Phase 2, measured control plane.
    f["save_control_plane"] = Figure(m.save_control_plane_s, "s", (
        f"{by} rank0_save_s (the mean of the saves once retention deletes)"))
    f["save_gather"] = Figure(m.save_gather_s, "s", (
        f"{by} rank0_save_parts_s.gather_and_rest (of the above: every rank's part received and "
        f"assembled, neither the manifest write nor retention)"))
    f["save_received"] = Figure(m.save_received_bytes, "B", (
        f"{by} bytes_per_rank_per_save + dcp_bytes_per_rank_per_save_cached (our gather's verdict; "
        f"DCP's empty cached plan and its end-of-save broadcast, a summary of the Metadata; the same "
        f"at 640 ranks)"))
    f["discovery"] = Figure(m.discovery_s, "s", f"{by} find_latest_s (part of the restore below)")
    f["manifest_parse"] = Figure(m.manifest_parse_s, "s", f"{by} manifest_parse_s (part of the restore below)")
    f["restore_control_plane"] = Figure(m.restore_control_plane_s, "s", (
        f"{by} rank0_restore_s (discovery, manifest, rank state, checksums and load of tiny "
        f"shards, continuity check; the index exchange apart, below)"))
    f["metadata"] = Figure(m.metadata_mib, "MiB", (
        f"{by} metadata_bytes (still written at every save, for dcp.load and other tools; a "
        f"restore reads the index instead)"))
    f["results_gather"] = Figure(m.results_gather_s, "s", (
        f"{by} results_gather_s (every rank's write results, packed as arrays, unpickled on rank 0 "
        f"at the end of the save, before the commit)"))
    f["metadata_write"] = Figure(m.metadata_write_s, "s", (
        f"{by} metadata_write_s (.metadata, laid out by metadata_parts from the results' columns and "
        f"the plan's tables, at a later save of the same plan; in the save, before the commit; a "
        f"process's first save {_number(m.metadata_write_first_s)} s, metadata_write_first_s)"))
    f["index"] = Figure(m.index_mib, "MiB", f"{by} index_bytes")
    f["index_write"] = Figure(m.index_write_s, "s", (
        f"{by} index_write_s (encode_index of the finished Metadata and its write, at a later save "
        f"of the same plan; in the save, before the commit; a process's first save "
        f"{_number(m.index_write_first_s)} s, index_write_first_s)"))
    f["index_rank0"] = Figure(m.index_rank0_s, "s", (
        f"{by} index_rank0_s + index_rank0_comm_s (read, CheckpointIndex.parse against the "
        f"manifest's file sizes, select of each rank's entries for all {ref.world_size:,} ranks' "
        f"requests; the requests unpickled and the answers pickled for the scatter)"))
    f["index_other_rank"] = Figure(m.index_other_rank_s, "s", (
        f"{by} index_other_rank_s (partial_metadata of the largest answer: every rank at once, "
        f"after rank 0)"))
    f["restore_received"] = Figure(m.restore_received_kib, "KiB", (
        f"{by} restore_bytes_received_per_rank (the control plane's collectives and the rank's "
        f"own index answer; DCP's load makes no collective; its transfer time is not counted)"))
    f["dcp_plan"] = Figure(m.dcp_plan_s, "s", (
        f"{by} dcp_plan_s (a process's first save; the adapter caches the plan for the next)"))
    f["dcp_plan_cached"] = Figure(m.dcp_plan_cached_s, "s", (
        f"{by} dcp_plan_cached_s (every later save of an unchanged state)"))

    # Phase 3, the save: what the loop waits for, synchronous and asynchronous.
    write_s = checkpoint_b / (i.fs_bandwidth_gbs * GB)
    f["bulk_write"] = Figure(write_s, "s", (
        f"computed: {_number(checkpoint_b / 1e12)} TB / {_number(i.fs_bandwidth_gbs)} GB/s, "
        f"each byte written once (DCP deduplicates the replicas' weights)"))
    staging_s = (model_shard + optimizer_shard) / (i.d2h_gbs * GB)
    f["staging"] = Figure(staging_s, "s", (
        f"computed: {f['staged_per_rank'].shown()} / {_number(i.d2h_gbs)} GB/s, every GPU at once"))
    finish_s = m.finish_s  # rank 0; every rank waits
    sync_s = m.save_control_plane_s + m.dcp_plan_cached_s + write_s + finish_s
    f["stall_sync"] = Figure(sync_s, "s", (
        f"computed: control plane {_number(m.save_control_plane_s)} + DCP plan, cached "
        f"{_number(m.dcp_plan_cached_s)} + bulk write {_number(write_s)} + rank 0's end of the save "
        f"{_number(finish_s)} s (finish_s: the write results gathered and read, .metadata "
        f"{_number(m.metadata_write_s)} and the index {_number(m.index_write_s)} s written; DCP's "
        f"end-of-save broadcast carries a summary, not the Metadata); a save where one rank's entry "
        f"changed size lays them out anew: + {_number(m.finish_changed_s - finish_s)} s "
        f"(finish_changed_s); a process's first save plans uncached and makes the plan's tables: + "
        f"{_number(m.dcp_plan_s - m.dcp_plan_cached_s)} + {_number(m.finish_first_s - finish_s)} s"))
    async_s = m.save_gather_s + staging_s
    f["stall_async"] = Figure(async_s, "s", (
        f"computed: gather and assembly {_number(m.save_gather_s)} + staging copy {_number(staging_s)} s "
        f"(an upper bound: only the expectation's gather is in the loop's way; the manifest write "
        f"and retention run in the background; Megatron-LM's own --async-save is not modelled)"))
    background_s = m.dcp_plan_cached_s + write_s + finish_s + m.save_control_plane_s
    f["async_background"] = Figure(background_s, "s", (
        f"computed: DCP plan, cached {_number(m.dcp_plan_cached_s)} + bulk write {_number(write_s)} + "
        f"rank 0's end of the save (results, .metadata, index) {_number(finish_s)} + control plane "
        f"{_number(m.save_control_plane_s)} s; the asynchronous stall holds while the checkpoint "
        f"interval is longer than this"))

    # Phase 4, a restart: detection, a fresh job's start, the restore.
    read_s = checkpoint_b / (i.fs_bandwidth_gbs * GB)
    f["bulk_read"] = Figure(read_s, "s", (
        f"computed: {_number(checkpoint_b / 1e12)} TB / {_number(i.fs_bandwidth_gbs)} GB/s, each "
        f"byte read once: the load checks each shard file's checksum from the bytes it reads (one "
        f"rank per file, the one reading most of it), the checksum pass reads only the other files; "
        f"each byte loaded once, as Megatron's --ckpt-fully-parallel-load does, not once per replica"))
    f["dcp_load_plan"] = Figure(m.load_plan_s, "s", (
        f"{by} load_plan_s (one rank's load plan from its own entries, dcp.load(no_dist=True); from "
        f"the whole Metadata, as plain dcp.load plans, load_plan_full_metadata_s "
        f"{_number(m.load_plan_full_metadata_s)} s)"))
    legacy_s = m.metadata_restricted_s + m.metadata_pickle_s + m.metadata_unpickle_s
    f["metadata_legacy"] = Figure(legacy_s, "s", (
        f"{by} metadata_unpickle_s + metadata_pickle_s + metadata_plain_unpickle_s (vetted by rank 0 "
        f"with our allow-list unpickler {_number(m.metadata_restricted_s)}, extrapolated from its "
        f"seconds per byte at 640 ranks; pickled to send {_number(m.metadata_pickle_s)}; "
        f"unpickled by every other rank {_number(m.metadata_unpickle_s)} s); not in the restart below"))
    f["detect"] = Figure(60.0, "s", (
        "assumed: a crashed process ends the step at once (srun --kill-on-bad-exit=1), a silent "
        "node after Slurm's SlurmdTimeout (300 s by default) or the collective timeout; not "
        "measured at scale"))
    f["process_start"] = Figure(60.0, "s", (
        "assumed: srun starts 5,120 processes that import torch and Megatron-Core from the shared "
        "file system and build the model and optimizer; not measured at scale"))
    f["dist_init"] = Figure(60.0, "s", (
        "assumed: the TCPStore rendezvous of 5,120 ranks and the NCCL communicators of the TP, "
        "PP and DP groups; not measured at scale"))
    f["requeue_hold"] = Figure(120.0, "s", (
        "assumed: Slurm's default cred_expire (120 s) holds a requeued job; the loopback Slurm "
        "of tests/support/slurm_cluster.sh (cred_expire=5, the minimum) took about 6-7 s per "
        "requeue cycle"))
    f["scheduling"] = Figure(60.0, "s", (
        "assumed: the top of the 30-60 s a requeued, eligible job waited on the loopback Slurm "
        "with the default scheduler intervals (tests/support/slurm_cluster.sh sets "
        "sched_interval=2 to avoid it)"))
    index_s = m.index_rank0_s + m.index_other_rank_s
    restore_s = m.restore_control_plane_s + index_s + m.load_plan_s + read_s
    start_s = f["detect"].value + f["process_start"].value + f["dist_init"].value
    spare_s = start_s + restore_s
    f["restart_spare"] = Figure(spare_s, "s", (
        f"computed: detection {_number(f['detect'].value)} + process start "
        f"{_number(f['process_start'].value)} + torch.distributed init {_number(f['dist_init'].value)} "
        f"+ restore control plane {_number(m.restore_control_plane_s)} + the index answered by rank 0 "
        f"{_number(m.index_rank0_s)}, each rank's Metadata built {_number(m.index_other_rank_s)} + DCP "
        f"load planning {_number(m.load_plan_s)} + bulk read {_number(read_s)} s (the hook relaunches "
        f"inside the allocation: no requeue)"))
    slurm_s = f["requeue_hold"].value + f["scheduling"].value + i.queue_wait_s
    f["restart_requeue"] = Figure(spare_s + slurm_s, "s", (
        f"computed: requeue hold {_number(f['requeue_hold'].value)} + scheduling pass "
        f"{_number(f['scheduling'].value)} + queue wait {_number(i.queue_wait_s)} + the restart on a "
        f"spare {_number(spare_s)} s"))

    # Phase 5, a hang: the watchdog's bound, the stack reports, the stop, then a restart.
    tokens = ref.global_batch * SEQUENCE_TOKENS
    iteration_s = 6 * PARAMETERS * tokens / (ref.world_size * ASSUMED_GPU_TFLOPS * 1e12)
    detect_s = HANG_FLOOR_S + BEAT_S + TICK_S + COLLECT_S
    f["hang_detect"] = Figure(detect_s, "s", (
        f"computed: the iteration bound {_number(HANG_FLOOR_S)} (max(floor {_number(HANG_FLOOR_S)}, "
        f"{_number(HANG_FACTOR)} x the slowest iteration): the floor, as iterations take under "
        f"{_number(HANG_FLOOR_S / HANG_FACTOR)} s; assumed: about {_number(iteration_s)} s, 6 x "
        f"{PARAMETERS / 1e9:.0f}e9 parameters x {tokens:,} tokens over {ref.world_size:,} GPUs at "
        f"{_number(ASSUMED_GPU_TFLOPS)} TFLOP/s) + rank 0's progress beat {_number(BEAT_S)} + the "
        f"watchdog's tick {_number(TICK_S)} + the hook's wait for the ranks' stack reports "
        f"{_number(COLLECT_S)} s; not measured at scale"))
    f["hang_stop"] = Figure(STOP_ESCALATION_S, "s", (
        "computed: the hook's patience at each stage, spent in full when a hung rank ignores "
        "signals (stuck in a driver call): "
        + " + ".join(f"{stage} {_number(patience)}" for stage, patience in STOP_STAGES)
        + " s; a step that leaves at SIGTERM takes less"))
    f["hang_recovery"] = Figure(detect_s + STOP_ESCALATION_S + spare_s, "s", (
        f"computed: hang detected {_number(detect_s)} + step stopped {_number(STOP_ESCALATION_S)} + "
        f"the restart on a spare {_number(spare_s)} s (the same on the hung nodes when no spare is "
        f"free; the restart's own failure detection {_number(f['detect'].value)} s is counted too: "
        f"an upper bound)"))
    return {key: f[key] for key in LABELS}


def simulate_defaults(inputs: Inputs = DEFAULT_INPUTS) -> dict[str, Figure]:
    """``resume simulate``'s stall, restart and hang defaults: ``stall_s``, ``restart_spare_s``,
    ``restart_requeue_s``, ``hang_detect_s`` (a hang's last progress until its step is gone)."""
    f = figures(inputs)
    detect, stop = f["hang_detect"].value, f["hang_stop"].value
    hang = Figure(detect + stop, "s", (
        f"computed: hang detected {_number(detect)} + step stopped {_number(stop)} s "
        f"(resume simulate --reference)"))
    return {"stall_s": f["stall_async" if inputs.save == "async" else "stall_sync"],
            "restart_spare_s": f["restart_spare"], "restart_requeue_s": f["restart_requeue"],
            "hang_detect_s": hang}


def markdown_table(figs: dict[str, Figure]) -> str:
    """The table docs/performance.md and runbooks/slurm.md carry (``resume simulate --reference``); the
    benchmark run behind every measured row is named once, under it."""
    rows = ["| figure | value | source |", "|---|---:|---|"]
    rows += [f"| {LABELS[key]} | {fig.shown()} | {fig.source.replace(MEASURED_BY, 'scale run')} |"
             for key, fig in figs.items()]
    rows += ["", f"scale run: `{MEASURED_BY}`; keys of its JSON output."]
    return "\n".join(rows)

