"""Errors that reach the user as one line and an exit code."""

from __future__ import annotations


class ExokvError(Exception):
    """A failure the user can act on: printed as one line, exit code 1."""

    exit_code = 1


class UsageError(ExokvError):
    """Bad flags or arguments: exit code 2."""

    exit_code = 2
