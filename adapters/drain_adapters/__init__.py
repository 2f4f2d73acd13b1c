"""Backends for drain, one module per broker, each imported only when configured."""
