"""Transitional: ``resume.adapters.megatron_adopt`` moved to ``resume.adapters.megatron.adopt``.

Kept only while resume/cli.py and cluster/hook.py import the old path; delete it once they
import ``resume.adapters.megatron.adopt``.
"""

from .megatron.adopt import adopt, describe

__all__ = ["adopt", "describe"]
