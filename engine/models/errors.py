"""The error every model-file problem raises (torch-free, so callers that only locate a
model — the router — can catch it without importing the loader)."""


class ModelFileError(ValueError):
    """A model file is missing, corrupt or of an unsupported kind."""
