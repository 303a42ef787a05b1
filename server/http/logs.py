"""Logging for the server and its engine process: structlog, human lines on a TTY, JSON otherwise.

Standard-library loggers (uvicorn, `corectl.engine`) go through the same renderer, so one stream
carries every line in one format.
"""
from __future__ import annotations

import logging
import sys

import structlog

LOG_FORMATS = ("auto", "human", "json")


def use_json(log_format: str) -> bool:
    return log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())


def configure_logging(log_format: str = "auto", level: str = "INFO") -> None:
    """Route structlog and stdlib logging to stderr in one format (idempotent)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.PositionalArgumentsFormatter(),
        structlog.processors.TimeStamper(fmt="iso", utc=False),
    ]
    if use_json(log_format):
        # JSON lines carry tracebacks as a string field; the console renderer formats its own.
        render = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        render = [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *render],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
    # uvicorn's loggers carry their own handlers when configured by uvicorn; ours replace them.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers = []
        logging.getLogger(name).propagate = True
