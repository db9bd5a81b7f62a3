"""Errors every layer may raise or catch. Plain Python, importing nothing of dockrl, so the config (the bottom
layer), the recipes and the observers share one type."""


class ConfigError(ValueError):
    """A user error in a config: the message names the setting, the value and the fix."""
