"""The resume drill: train, kill with SIGKILL, resume, compare with an uninterrupted run.

Everything here imports torch, DDP and the native PyTorch adapter, so it is not part of the
framework-neutral core: it lives in the top-level ``drill/`` directory and is installed as
``resume.drill`` (pyproject's ``package-dir``), like ``adapters/`` and ``cluster/``. The CLI
imports it only for ``resume drill``.
"""
