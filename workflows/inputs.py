"""A workflow's messages, parsed by the workflow itself rather than by the data converter.

A decoding error (or a missing or extra argument) in the converter would fail the workflow
*task* and retry it forever; bad input must fail the workflow once, clearly, and a bad update
must be refused with the reason (``protocol/group.py``'s ``parse_message`` says what to fix).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel
from temporalio.exceptions import ApplicationError
from timeslice.protocol.group import MalformedMessage, parse_message

__all__ = ["fail_on_bad_input", "parse_input", "parses"]
M = TypeVar("M", bound=BaseModel)


def parse_input(
    model: type[M], raw: tuple[Any, ...], what: str, placeholder: Callable[[], M]
) -> tuple[M, str | None]:
    """A workflow's input, for its ``__init__`` (which must not raise).

    Args:
        model: the input's model.
        raw: the arguments the workflow was started with.
        what: the workflow, for the message.
        placeholder: a valid input to build the workflow from when ``raw`` is not one.

    Returns:
        The input and None, or the placeholder and why the input is bad (for
        :func:`fail_on_bad_input`, in ``run``).
    """
    try:
        return parse_message(model, raw, what), None
    except MalformedMessage as err:
        return placeholder(), str(err)


def fail_on_bad_input(error: str | None) -> None:
    """End the workflow, once, if its input was bad.

    Args:
        error: why, from :func:`parse_input`; None if the input was good.

    Raises:
        ApplicationError: ``InvalidInput``, non-retryable, saying what to fix.
    """
    if error is not None:
        raise ApplicationError(error, type="InvalidInput", non_retryable=True)


def parses(model: type[BaseModel], what: str) -> Callable[..., None]:
    """An update validator that refuses an argument that is not a valid ``model`` (the sender
    gets the reason), registered in the workflow class's body:
    ``handler.validator(parses(Model, "the handler update"))``.

    Args:
        model: the update's argument's model.
        what: the update, for the message.

    Returns:
        The validator (a method: it takes the workflow instance first).
    """

    # Its parameters must be the update method's, annotations included (Temporal checks).
    def validate(self, *raw: Any) -> None:
        parse_message(model, raw, what)

    return validate
