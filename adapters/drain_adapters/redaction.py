"""The one redaction helper the adapters use: a URL with its password replaced by ``***``.

The single import of it is below (issue 24: ``drain.observability.redaction.redact_url`` once that
module exists; until then the config's own, the same function)."""

from drain.config.settings import redact_url

__all__ = ["redact_url"]
