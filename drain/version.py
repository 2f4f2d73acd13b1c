"""drain's version, in one place (the build reads it here; ``drain.__version__`` is this)."""

__version__ = "0.2.0"
