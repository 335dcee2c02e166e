"""The error every bad setting raises: it names the setting by its full dotted config key."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem. `key` is the full dotted key ("sampling.temperature"), `reason` the rest."""

    def __init__(self, reason: str, key: str = ""):
        self.key, self.reason = key, reason
        super().__init__(f"{key}: {reason}" if key else reason)

    def under(self, prefix: str) -> ConfigError:
        return ConfigError(self.reason, _join(prefix, self.key))


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix and key else prefix or key


def require(ok: bool, key: str, reason: str) -> None:
    """A value check in a settings class's `__post_init__`; `key` is relative to its config section (the config
    loader adds the section's prefix)."""
    if not ok:
        raise ConfigError(reason, key)
