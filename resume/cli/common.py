"""What every command shares: an error as one line on stderr (with ``--json``, also as a JSON
object of its fields on stdout) and its exit code, the ``--json`` option, the terminal."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from ..errors import EXIT_OK, EXIT_PROBLEM, ResumeError, error_details

__all__ = ["command", "emit_json", "fail", "is_terminal", "json_option"]


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=1, sort_keys=False))


def is_terminal() -> bool:
    return sys.stderr.isatty()


def command(fn: Callable[..., int]) -> Callable[..., None]:
    """Map ResumeError (and stray OSError) to a one-line message and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        as_json = kwargs.get("as_json", False)
        try:
            code = fn(*args, **kwargs)
        except ResumeError as e:
            fail(str(e), e.exit_code, as_json, error_details(e))
        except BrokenPipeError:
            # `resume ... | head`: the reader left; say nothing more.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(EXIT_OK)
        except OSError as e:
            fail(f"{getattr(e, 'filename', '') or ''}: {type(e).__name__}: {e}".lstrip(": "),
                 EXIT_PROBLEM, as_json, error_details(e))
        else:
            sys.exit(code or EXIT_OK)

    return wrapper


def fail(message: str, code: int, as_json: bool, details: dict[str, Any] | None = None) -> None:
    """Exit ``code`` after ``resume: error: MESSAGE`` on stderr; with ``as_json`` first the JSON
    object ``ok``, ``error`` (the message), ``exit_code`` and the error's ``details``
    (``resume.errors.DETAILS``: what, where, field, expected, actual)."""
    if as_json:
        fields = {k: v for k, v in (details or {}).items() if k != "exit_code"}
        click.echo(json.dumps({"ok": False, "error": message, "exit_code": code, **fields}, indent=1,
                              default=str))
    click.echo(f"resume: error: {message}", err=True)
    sys.exit(code)


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object; no progress.")
