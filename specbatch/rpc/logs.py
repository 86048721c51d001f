"""Log set-up for the three servers: human-readable text, or one JSON object per line.

JSON lines are for log collectors (Loki, Elasticsearch, Cloud Logging …): each line carries
``time``, ``level``, ``logger`` and ``message``, plus every field a call passes with ``extra=``,
such as the request-scoped ones below::

    log.warning("draft replica failed", extra={"request_id": rid, "seq_id": sid, "replica": addr})
"""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter

# Fields a log call may pass through ``extra=`` to tie a line to a request, a sequence, a service
# or a replica. JSON lines carry any extra field; the text format shows these ones.
CONTEXT_FIELDS = ("request_id", "seq_id", "service", "replica", "code")
LOG_FORMATS = ("text", "json")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class TextFormatter(logging.Formatter):
    """The classic one-line format, with ``[request_id=… seq_id=…]`` appended when a call passed
    any of CONTEXT_FIELDS, so that text logs can be followed per request too."""

    def __init__(self):
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = " ".join(f"{name}={getattr(record, name)}" for name in CONTEXT_FIELDS
                           if getattr(record, name, None) is not None)
        if not context:
            return line
        # Keep a traceback, if any, below the line it belongs to.
        first, newline, rest = line.partition("\n")
        return f"{first} [{context}]{newline}{rest}"


def json_formatter() -> logging.Formatter:
    """python-json-logger's formatter: ISO 8601 UTC ``time``, ``level``, ``logger``, ``message``,
    then every extra field of the record (and ``exc_info`` for an exception, as text)."""
    return JsonFormatter(["levelname", "name", "message"], timestamp="time",
                         rename_fields={"levelname": "level", "name": "logger"})


def make_formatter(fmt: str = "text") -> logging.Formatter:
    if fmt == "json":
        return json_formatter()
    if fmt == "text":
        return TextFormatter()
    raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)} (got {fmt!r})")


def configure_logging(level: str = "INFO", fmt: str = "text", stream=None) -> None:
    """Send the root logger's records at ``level`` and above to ``stream`` (stderr) as ``fmt``.

    Replaces any handler already on the root logger, so that a second call (a test, ``specbatch
    up`` starting a service in-process) switches formats instead of printing every line twice."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(make_formatter(fmt))
    logging.basicConfig(level=level, handlers=[handler], force=True)
