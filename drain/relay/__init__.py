"""The drain process: the loop (lead, select, forward, settle, wait) and its parts.

- loop: Relay, the follower/leader loop, and its entry points (drain_step, drain_once, drain_due)
- step: one step, the one place that orders store and adapter calls
- dispatch: every adapter call, with its failures translated; availability: which backends are
  open or paused, which queues refuse their jobs; pipeline: batches awaiting broker confirms
- settlement: what the per-job results mean for the rows (pure); writing: writing it;
  refusals: the rows the table refuses; settling: whether this drain can settle, and what it
  could not write yet; blockage: why it cannot settle, and for how long
- reporting: what a step did, counted and logged
- leadership: the advisory lock; term: a leader's term, begun, stepped down, released
- pacing: the loop's waits; backoff: the one formula of a growing wait
- wakeup: the idle leader woken by a producer's commit; watchdog: a loop that stopped progressing
- schedules, cron: periodic jobs; failpoints: injected faults for the tests
"""
