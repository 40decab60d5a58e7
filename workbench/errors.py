"""The workbench's own exception types: errors a user can cause, each with a message that names the problem."""

from __future__ import annotations


class WorkbenchError(Exception):
    """Base class of every error the workbench raises on purpose."""


class ConfigError(WorkbenchError, ValueError):
    """A configuration (model, engine, pipeline, hardware) is invalid; the message names the field."""


class CheckpointError(WorkbenchError):
    """A checkpoint directory is unusable: missing file, unsupported architecture, missing or mis-shaped tensor."""


class RequestError(WorkbenchError, ValueError):
    """One request is invalid (empty prompt, too long, token id out of range, bad sampling parameters).

    The engine rejects that request with this reason and keeps serving the others.
    """


class TraceError(WorkbenchError, ValueError):
    """A workload trace file is malformed; the message names the file and the line."""
