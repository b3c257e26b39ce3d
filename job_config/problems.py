"""The config errors: one `ConfigError` per problem, collected by `Problems` so that one message
reports every independent problem (the config checks here and the world-size checks of
`parallelisms/`)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config problem, reported to the user as one message before any expensive work."""


class Problems:
    """Collects independent config errors, so that one message reports all of them."""

    def __init__(self, *catch: type[Exception]):
        self.catch = catch or (ConfigError,)
        self.errors: list[Exception] = []

    def add(self, error: Exception | str) -> None:
        """Records an error; a message becomes the first caught kind (ConfigError)."""
        self.errors.append(self.catch[0](error) if isinstance(error, str) else error)

    def run(self, check, *args, **kwargs):
        """`check(...)`'s result, or None after recording the error it raised."""
        try:
            return check(*args, **kwargs)
        except self.catch as e:
            self.errors.extend(getattr(e, "problems", [e]))
            return None

    def raise_any(self) -> None:
        """Raises a single error as it is, or one ConfigError numbering them all."""
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            lines = [f"{len(self.errors)} config errors:"]
            lines += [f"  {i}. {e}" for i, e in enumerate(self.errors, 1)]
            error = ConfigError("\n".join(lines))
            error.problems = list(self.errors)
            raise error
