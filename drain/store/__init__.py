"""Every database call the drain makes, with every SQL statement named in ``sql/``."""
