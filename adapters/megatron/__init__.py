"""Megatron-LM: ``resume`` over Megatron's own ``torch_dist`` checkpoints.

Modules, each one job:

- ``savedir``: a save directory's names (iteration directories, the tracker, the format);
- ``schedule``: Megatron-Core's LR schedule computed without Megatron;
- ``common``: Megatron's common state read without running its code;
- ``check``: a save without a manifest checked from Megatron's own ``.metadata``;
- ``layout``: the save directory as a run (``MEGATRON_LAYOUT``, registered at import);
- ``record``: what a manifest records beyond the files; ``vet``: pickles vetted before a load;
- ``parallel``: the parallel layout read from Megatron's arguments, and which degrees its
  checkpoint format fixes (``resume.layout``);
- ``recorder``: ``MegatronRecorder``, the commit after each save and the checks around each
  load (``restart``); ``asyncsave``: the commit of ``--async-save`` at Megatron's finalize;
- ``updates``: rank 0's update journal (``resume.journal``), fed from ``train_step``;
- ``install``: ``install()``, the recorder wired into ``megatron.training``; ``watch``: the
  process watchdog (hang detection) driven from the same wrapped calls;
- ``adopt``: ``resume megatron adopt``; ``args``: the reference run's arguments.

Importing the package is cheap (no megatron-core, no torch) and registers the layout.
"""

from .args import check_supported
from .install import count_train_step, install
from .layout import MEGATRON_LAYOUT, MegatronLayout
from .record import lr_ahead_megatron, megatron_lr_numbering, next_batch_ids, rng_digest
from .recorder import MegatronRecorder
from .savedir import MEGATRON_TRACKER
from .vet import vet_byte_entries

__all__ = ["MEGATRON_LAYOUT", "MEGATRON_TRACKER", "MegatronLayout", "MegatronRecorder", "check_supported",
           "count_train_step", "install", "lr_ahead_megatron", "megatron_lr_numbering", "next_batch_ids",
           "rng_digest", "vet_byte_entries"]
