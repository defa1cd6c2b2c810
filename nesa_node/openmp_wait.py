"""How torch's idle CPU threads wait: a short spin, then sleep. Set before torch loads (libgomp reads it once).

torch computes on the CPU with OpenMP (libgomp). After each parallel operation its worker threads spin waiting for the
next one, by default for about 3 ms (libgomp's GOMP_SPINCOUNT of 300,000, at its own estimate of 100,000 spins a
millisecond), before they sleep. Within a step operations follow each other within microseconds, so a spin keeps the
threads ready; between steps the spinning burns cores that another process needs. A node's steps come in a chain: the
client computes, then each node in turn, so several processes of a swarm on one machine (or a node beside its client)
each want every core while the others wait. With a spin of about 0.1 ms (SPIN_COUNT) a process that finished its
part leaves the cores to the next within that time and stays quick inside a step.

Measured on 2 cores (4 blocks of the bench model, one-token step, L3-warm weights): 1 thread 4.2-7.8 ms; 2 threads
spinning 2.9-3.9 ms; 2 threads with OMP_WAIT_POLICY=PASSIVE (no spin at all: every operation wakes its threads)
3.6-6.1 ms; 2 threads with spin counts of 2,000 and 20,000 2.9-3.6 ms. With both cores taken by two busy processes
(3 blocks, a step every 5 ms, 2 runs each): this spin 9.1 and 9.2 ms, PASSIVE 11.7 and 12.0 ms, 1 thread 10.8 and
11.1 ms, so the short spin is no worse on a loaded host either.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# about 0.1 ms of spinning before an idle OpenMP thread sleeps, by libgomp's estimate; more where the CPU's PAUSE
# is slow (recent Xeons), yet 0, 100, 1,000 and 10,000 gave the same node step within noise on the 2-core machine
SPIN_COUNT = 10_000

USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # what an operator may have chosen: left alone


def short_spin(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set GOMP_SPINCOUNT to SPIN_COUNT in `environ` (this process's environment by default) unless the operator set
    OMP_WAIT_POLICY or GOMP_SPINCOUNT. Takes effect only if torch has not been imported yet in this process (and
    in processes started after it with this environment). Whether it was set."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in USER_SETTINGS):
        return False
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return True
