"""Transitional: ``resume.adapters.megatron_ckpt`` moved to ``resume.adapters.megatron.layout``.

Kept only while resume/cli.py and cluster/hook.py import the old path; delete it once they
import ``resume.adapters.megatron.layout``.
"""

from .megatron.layout import MEGATRON_LAYOUT

__all__ = ["MEGATRON_LAYOUT"]
