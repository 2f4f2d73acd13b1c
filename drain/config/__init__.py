"""Settings: what they are, where they come from (file, environment, flags) and how they are shown."""
