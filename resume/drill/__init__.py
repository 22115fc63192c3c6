"""The resume drill: train, kill with SIGKILL, resume, compare with an uninterrupted run.

Everything here imports torch; the CLI imports it only for ``resume drill``.
"""
