"""The engine's error type."""


class EngineError(ValueError):
    """Bad input to the engine (the message names the argument, the value and what is allowed)."""
