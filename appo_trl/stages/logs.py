"""Logging for the `appo` stages: INFO for appo-trl and the trainer, WARNING for libraries that log every HTTP
request, and no agent endpoint secret in any line.

`setup_logging()` is what `appo train` and `appo sft` call first. httpx (and httpx2), openai and uvicorn log each request
at INFO with its URL, and an agent run's base URL carries the endpoint's per-run secret; those loggers stay at WARNING,
and a filter on the root handlers replaces every endpoint secret (`agent_endpoint.redact`) in whatever else is logged
(an agent's error message quoting its URL, a traceback). In a log file (stderr not a terminal) the libraries'
progress bars (transformers' weight loading, datasets' `map`) are off: they would mix `\r` updates into the lines.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# httpx2 / httpcore2: the fork the openai SDK 3 uses
REQUEST_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2", "openai", "openai.agents", "urllib3", "uvicorn",
                   "uvicorn.access", "uvicorn.error")  # fmt: skip


class RedactSecrets(logging.Filter):
    """Replaces the agent endpoints' secrets in a record's message and traceback (a handler filter)."""

    def filter(self, record: logging.LogRecord) -> bool:
        endpoint = sys.modules.get("appo_trl.rollout.agent_endpoint")
        if endpoint is None or not endpoint.drawn_secrets():
            return True
        message = record.getMessage()
        clean = endpoint.redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = endpoint.redact(record.exc_text)
        return True


def setup_logging(level: int = logging.INFO) -> None:
    """Root logging at `level` (as `logging.basicConfig`), request loggers at WARNING, secrets redacted."""
    logging.basicConfig(level=level, format=FORMAT)
    for name in REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactSecrets) for f in handler.filters):
            handler.addFilter(RedactSecrets())
    if not sys.stderr.isatty():
        from appo_trl.reporting.console import quiet_progress_bars

        quiet_progress_bars()


__all__ = ["RedactSecrets", "setup_logging"]
