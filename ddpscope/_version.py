"""The package version, in a leaf module: the rank side reads it without importing
``ddpscope`` itself, whose ``attach()`` imports the rank side (an import cycle)."""

__version__ = "0.1.0.dev0"
