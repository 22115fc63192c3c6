"""``python -m resume.cli``: the ``resume`` command."""

from resume.cli import main

main()
