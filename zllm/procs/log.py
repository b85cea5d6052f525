"""The one logging set-up of every zllm process: `<process>[pid] logger: message` lines.

Under systemd (stderr connected to the journal, which $JOURNAL_STREAM tells) the timestamp is
left to journald and every line starts with a `<N>` syslog priority, which journald turns into
the entry's priority: `journalctl -u zllm -p warning` then shows exactly the warnings and errors,
and a traceback's lines stay together at the priority of the record that carried it.
"""

from __future__ import annotations

import logging
import os
import sys

from zllm import envs

_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class _JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{_PRIORITY.get(record.levelno, 6)}>"
        return "\n".join(prefix + line for line in super().format(record).splitlines())


def configure_logging(process_name: str, level: str | None = None) -> None:
    """Set up the root logger for this process (level: DEBUG... or $ZLLM_LOG_LEVEL or INFO)."""
    level = (level or envs.ZLLM_LOG_LEVEL or "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    if stderr_is_journal():
        handler.setFormatter(_JournalFormatter(f"{process_name}[%(process)d] %(name)s: %(message)s"))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {process_name}[%(process)d] %(name)s: %(message)s")
        )
    logging.basicConfig(level=level, handlers=[handler], force=True)


def stderr_is_journal() -> bool:
    """True when stderr is the journal stream systemd set up for this service."""
    expected = os.environ.get("JOURNAL_STREAM", "")
    if ":" not in expected:
        return False
    try:
        stat = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return expected == f"{stat.st_dev}:{stat.st_ino}"
