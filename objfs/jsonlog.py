"""``--log-format json``: one JSON object per line, for log collectors.

Each record is ``{"time", "level", "logger", "message"}`` plus ``"exception"`` when a
traceback is attached. Only the formatted message is written, never the record's arguments
or the environment: what objfs logs is already free of credentials (see errors.py).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": _dt.datetime.fromtimestamp(record.created, _dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)
