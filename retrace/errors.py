"""Errors with messages meant for users (the CLIs print them as one line, no traceback)."""


class RetraceError(Exception):
    """A problem with the user's input, files or environment, explained in the message."""


class CheckpointError(RetraceError):
    """A model directory is missing files, has bad config keys, or does not fit its partner."""


class UnsupportedConfigError(CheckpointError):
    """The checkpoint uses a feature this implementation does not reproduce exactly."""


class MissingDependencyError(RetraceError):
    """An optional dependency (onnxruntime, tensorrt, ...) is needed for this path and is absent."""
