"""The workbench's own exception types: errors a user can cause, each with a message that names the problem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class WorkbenchError(Exception):
    """Base class of every error the workbench raises on purpose."""


class ConfigError(WorkbenchError, ValueError):
    """A configuration (model, engine, pipeline, hardware) is invalid; the message names the field."""


class CheckpointError(WorkbenchError):
    """A checkpoint directory is unusable: missing file, unsupported architecture, missing or mis-shaped tensor."""


class RequestError(WorkbenchError, ValueError):
    """One request is invalid (empty prompt, too long, token id out of range, bad sampling parameters).

    The engine rejects that request with this reason and keeps serving the others. ``param`` names the request
    field at fault where one is (``prompt``, ``max_tokens``, ...): the server returns it as OpenAI's ``param``.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class TraceError(WorkbenchError, ValueError):
    """A workload trace file is malformed; the message names the file and the line."""


def read_json_file(path: str | Path, what: str, hint: str = "") -> Any:
    """``path`` parsed as JSON, or a ConfigError that names the file: ``{what} not found: {path}{hint}`` when it
    is missing, ``{path}: not valid JSON (...)`` when it cannot be read or parsed."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}{hint}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
