"""The contract between the relay and a backend, and how backends are found by name.

Backends live outside the core (``drain_adapters``, or any package exposing an entry point in
the ``drain.backends`` group) and are imported lazily: running RQ never imports pika.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from drain import errors, models

BUILTIN_BACKENDS: Mapping[str, str] = {
    "memory": "drain.testing:MemoryAdapter",
    "rq": "drain_adapters.rq:RQAdapter",
    "rabbitmq": "drain_adapters.rabbitmq:RabbitMQAdapter",
    "celery": "drain_adapters.celery:CeleryAdapter",
    "dramatiq": "drain_adapters.dramatiq:DramatiqAdapter",
    "nats": "drain_adapters.nats:NatsAdapter",
}
ENTRY_POINT_GROUP = "drain.backends"
MAX_REASON_CHARS = 500

Message = TypeVar("Message")


class Adapter(Protocol):
    """Forward staged jobs to one backend.

    - ``publish_batch`` returns exactly one PublishResult per job, in any order.
    - PUBLISHED only after the backend acknowledged durably (publisher confirm, pipeline reply).
    - A failure of one job is a result (RETRY or REJECTED), not an exception.
    - A failure of the whole backend raises BackendUnavailable; the relay leaves the rows alone
      and backs off.
    - Every network call has a timeout from the adapter's settings, well below the database's
      ``idle_in_transaction_session_timeout``, and a whole call (``open`` and the call right
      after it count as one) ends within the publish timeout however many waits it makes
      (``drain.backend.deadline``).
    - Construction does no I/O; ``open`` connects, ``close`` is idempotent.
    """

    def open(self) -> None: ...

    def publish_batch(self, jobs: Sequence[models.StagedJob], /) -> Sequence[models.PublishResult]: ...

    def ping(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class PipelinedAdapter(Protocol):
    """An adapter that can have a batch in flight while the relay works on the next one.

    ``submit`` hands the batch to the broker and returns a ticket at once (or raises
    BackendUnavailable when it cannot even send); ``collect`` waits, within the adapter's publish timeout, for
    that ticket's acknowledgements and returns one PublishResult per job, or raises
    BackendUnavailable, exactly as ``publish_batch`` would. Tickets are collected in the order
    they were submitted. ``publish_batch(jobs)`` is ``collect(submit(jobs))``.

    After ``close`` (the relay closes a backend it found unavailable), ``collect`` of a ticket
    still outstanding returns at once, without I/O: what was settled before the close (confirmed
    jobs PUBLISHED, the rest RETRY), or BackendUnavailable when nothing of it was.

    An adapter whose class sets ``full_batches_only = True`` is submitted only full batches and
    published a partial one at once: its reply comes within a round trip, so at a trickle a
    flight would only cost the next step.
    """

    def submit(self, jobs: Sequence[models.StagedJob], /) -> Any: ...

    def collect(self, ticket: Any, /) -> Sequence[models.PublishResult]: ...


@runtime_checkable
class CheckedAdapter(Protocol):
    """An adapter that can tell what the drain needs from its backend and does not find there.

    ``problems`` runs on an open adapter (``drain check``): it returns one line per problem (a
    missing queue, a key the drain may not write), all at once, without secrets, and changes
    nothing a worker could see. It raises BackendUnavailable as ``ping`` does.
    """

    def problems(self) -> list[str]: ...


def build_each(
    jobs: Sequence[models.StagedJob], build: Callable[[models.StagedJob], Message], backend_name: str
) -> tuple[list[tuple[models.StagedJob, Message]], list[models.PublishResult]]:
    """Turn each job into its backend message with ``build``; return (built, rejected).

    The rule every adapter follows: an exception raised while turning one row into a message is
    that row's rejection (retried with backoff, then dead-lettered with the reason), never a
    crash and never "backend unavailable". ``build`` raises JobRefused with a reason for what
    validation catches; any other exception is the net behind validation and becomes the
    reason as ``<Type>: <first line>``. ``build`` must do no I/O.
    """
    built: list[tuple[models.StagedJob, Message]] = []
    rejected: list[models.PublishResult] = []
    for job in jobs:
        try:
            built.append((job, build(job)))
        except errors.JobRefused as exc:
            rejected.append(models.PublishResult.rejected(job, refusal_text(backend_name, exc)))
        except Exception as exc:  # noqa: BLE001 - the net behind validation: this row's rejection
            rejected.append(
                models.PublishResult.rejected(job, refusal_text(backend_name, exc, with_type=True))
            )
    return built, rejected


def refusal_text(backend_name: str, exc: BaseException, *, with_type: bool = False) -> str:
    """The one-line reason a job was refused, bounded in length (it goes to ``last_error``)."""
    text = errors.first_line(exc)
    if with_type:
        text = f"{type(exc).__name__}: {text}"
    return f"{backend_name}: {text}"[:MAX_REASON_CHARS]


class AdapterType(Protocol):
    """What a backend module exports: a class built from its config section."""

    @classmethod
    def from_options(cls, name: str, options: Mapping[str, Any], *, publish_timeout_s: float) -> Adapter:
        """Build an adapter from ``[backends.<name>]`` (without ``type``); raise ConfigError
        naming every bad key at once. No I/O."""
        ...


def load_adapter_type(type_name: str) -> AdapterType:
    """Import the adapter class registered for ``type_name``.

    Raises ConfigError when no such backend type exists or its extra is not installed.
    """
    target = BUILTIN_BACKENDS.get(type_name)
    if target is None:
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if entry_point.name == type_name:
                target = entry_point.value
                break
    if target is None:
        known = ", ".join(sorted(BUILTIN_BACKENDS))
        raise errors.ConfigError(f"unknown backend type {type_name!r} (known: {known})")
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise errors.ConfigError(
            f"backend type {type_name!r} needs a package that is not installed ({exc.name}); "
            f"install jobdrain[{type_name}]"
        ) from None
    adapter_type: AdapterType = getattr(module, attribute)
    return adapter_type


def build_adapters(backends: Mapping[str, Any], publish_timeout_s: float) -> dict[str, Adapter]:
    """Build one adapter per configured backend (``config.BackendSettings`` by name), no I/O.

    Raises ConfigError naming every problem in every section at once.
    """
    adapters: dict[str, Adapter] = {}
    problems: list[str] = []
    for name, backend in backends.items():
        try:
            adapter_type = load_adapter_type(backend.type)
            adapters[name] = adapter_type.from_options(
                name, backend.options, publish_timeout_s=publish_timeout_s
            )
        except errors.ConfigError as exc:
            problems.extend(
                problem if problem.startswith("backends.") else f"backends.{name}: {problem}"
                for problem in exc.problems
            )
    if problems:
        raise errors.ConfigError(problems)
    return adapters
