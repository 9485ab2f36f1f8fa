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
    "is_spark_error",
    "one_line",
]

# Exception classes (by name: pyspark and py4j are imported lazily) that carry
# an error of Spark's or the JVM's, not a bug of ours.
_SPARK_ERRORS = frozenset(
    {"PySparkException", "CapturedException", "Py4JJavaError", "Py4JError", "AnalysisException"}
)


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


def is_spark_error(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by Spark or its JVM (an input it could not read...)."""
    return any(cls.__name__ in _SPARK_ERRORS for cls in type(exc).__mro__)


def one_line(exc: BaseException) -> str:
    """What went wrong, in one line.

    A ``Py4JJavaError`` says only "An error occurred while calling o41.load";
    the reason is the message of the innermost Java cause (e.g. "... is not a
    Parquet file"), which is what we show.  Anything else: the first line of
    its text, or its class name.
    """
    java = getattr(exc, "java_exception", None)
    text = ""
    if java is not None:
        try:
            seen = 0
            while java.getCause() is not None and seen < 20:
                java, seen = java.getCause(), seen + 1
            text = f"{java.getClass().getSimpleName()}: {java.getMessage() or ''}"
        except Exception:  # the gateway is gone: fall back to the Python text
            text = ""
    text = (text or str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__
