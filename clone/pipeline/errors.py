"""Every exception the pipeline raises on purpose.

All of them derive from :class:`PipelineError` (itself a
:class:`~clone.errors.CloneError`), so the CLI can turn any of them into a
one-line message and exit status 2 without a traceback.
"""

from __future__ import annotations

from clone.errors import CloneError

__all__ = [
    "PipelineError",
    "InputError",
    "ServersUnreachable",
    "SparkUnavailable",
    "WriteFailed",
    "HistoryIncomplete",
]


class PipelineError(CloneError):
    """Root of every pipeline exception; its text is shown to the user as is."""


class InputError(PipelineError):
    """The input is missing, unreadable or lacks a column the job needs."""


class ServersUnreachable(PipelineError):
    """No server of the pair answered (none is active, or none is running)."""


class SparkUnavailable(PipelineError):
    """A Spark session could not be started on the requested master."""


class WriteFailed(PipelineError):
    """Writes could not be confirmed by the servers, even after retries."""


class HistoryIncomplete(PipelineError):
    """The update history held does not reach back far enough for what was asked."""
