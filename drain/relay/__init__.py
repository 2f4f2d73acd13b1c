"""The drain process: the loop (follow, or lead: select, forward, settle, commit, wait) and its parts.

The batch path:
    - loop: Relay, the loop in two states (follow, lead), a leader's term, its step, and the
      entry points (drain_step, drain_once, settle_in_flight, drain_due);
    - forward: Forwarder, every adapter call with its failures translated, which backends are
      open or paused, which queues refuse their jobs, the flights awaiting broker confirms;
    - settle: Settler, what the results mean for the rows (decide, pure), writing it, the rows
      the table refuses (parked or held), the rows this process holds (Held), and why this
      drain cannot settle, said once, and for how long;
    - reporting: what a step did, counted and logged.

Around it:
    - leadership: the advisory lock, and whether this drain can settle here (Blocker);
    - pacing: the loop's waits; backoff: the one formula of a growing wait;
    - wakeup: the idle leader woken by a producer's commit; watchdog: a loop that stopped;
    - schedules, cron: periodic jobs; failpoints: injected faults for the tests.

The words: docs/glossary.md.
"""
