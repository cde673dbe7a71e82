"""The bucketed overlap scheduler: gradient hooks -> buckets -> compress -> reduce -> grads."""

from __future__ import annotations

from overlap.scheduler.scheduler import BucketScheduler

__all__ = ["BucketScheduler"]
