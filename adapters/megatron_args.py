"""Transitional: ``resume.adapters.megatron_args`` moved to ``resume.adapters.megatron.args``.

Kept only while resume/cli.py and cluster/hook.py import the old path; delete it once they
import ``resume.adapters.megatron.args``.
"""

from .megatron.args import REFERENCE, check_with_megatron_parser

__all__ = ["REFERENCE", "check_with_megatron_parser"]
