"""Errors that reach the user as one line and an exit code."""

from __future__ import annotations


class ExokvError(Exception):
    """A failure the user can act on: printed as one line, exit code 1."""

    exit_code = 1


class UsageError(ExokvError):
    """Bad flags or arguments: exit code 2."""

    exit_code = 2


class PromptTooLong(ExokvError):
    """A prompt longer than the model's context, refused before any of it is computed.

    Decided from the prompt's tokens and the model's config alone, so every rank
    refuses the same turn, before the turn's first collective. The numbers travel with
    it (a front end names both: exokv serve's 400).
    """

    def __init__(self, message: str, tokens: int = 0, context: int = 0) -> None:
        super().__init__(message)
        self.tokens = tokens  # the prompt's
        self.context = context  # the model's


def one_line(error: BaseException, *, named: bool = True) -> str:
    """`error` as one line of text for an ExokvError's message: its whitespace collapsed
    (a library's multi-line message would break the one-line contract), prefixed by its
    type's name unless `named` is False; the type's name alone when it says nothing."""
    text = " ".join(str(error).split())
    if not text:
        return type(error).__name__
    return f"{type(error).__name__}: {text}" if named else text
