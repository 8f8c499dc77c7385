"""The project's own error types: each says which key, file, record or field is wrong."""


class HfScaleError(Exception):
    """Base class: an error hf_scale raises on purpose, with a message meant for the user."""


class ConfigError(HfScaleError, ValueError):
    """A configuration value (YAML key, command-line flag, argument) is wrong; raised before any work starts."""


class DataError(HfScaleError, ValueError):
    """An input record or data file is wrong; the message names the file, the record index and the field."""


class DistributedSetupError(HfScaleError, RuntimeError):
    """The processes are not training together as they should (for example DDP silently off on CPU)."""


class SaveError(HfScaleError, OSError):
    """Writing a checkpoint or the model failed (disk full, folder not writable); the message names the folder."""
