"""The Django app: it only carries the migration that creates the staged-jobs table."""

from __future__ import annotations

from django.apps import AppConfig


class DrainConfig(AppConfig):
    name = "drain.contrib.django"
    label = "drain"
    verbose_name = "drain (transactionally staged jobs)"
