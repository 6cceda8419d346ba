"""A process-wide fork counter, bumped in every forked child.

Per-process state (a client's socket, a volume's threads and caches) must be
rebuilt after a fork. Comparing this counter with the value seen when the
state was built tells a child from its parent with an int compare, where a
getpid() would cost a system call on every request and every read.
"""

from __future__ import annotations

import os

generation = [0]
os.register_at_fork(after_in_child=lambda: generation.__setitem__(0, generation[0] + 1))
