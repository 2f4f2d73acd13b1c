"""Integrations with application frameworks (imported only by apps that use them)."""
