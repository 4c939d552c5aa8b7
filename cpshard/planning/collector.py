"""Python's cyclic garbage collector paused while a step is planned.

Planning makes many small objects that it keeps (a span per run of a rank's tokens: one per
token under ``stripe``) and no reference cycles; each time enough survive, the collector walks
every object of the process (a training process holds millions), a pause of a tenth of a second
or more in the middle of the step's planning. Reference counting still frees everything.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Run the block with the cyclic collector off; it is switched back on after the block only
    if it was on before (nested blocks and a caller's own ``gc.disable()`` are respected)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
