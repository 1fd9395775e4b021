"""Be your own torchrun: start N local CPU processes and run a function in each.

`launch_local` uses torch's elastic launcher API (what torchrun itself runs), so each worker sees
exactly the environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT ...) and `Mesh.from_environment` works unchanged. Workers are started with the
"spawn" method: `fn` must be a module-level function and the calling script must guard its entry
point with `if __name__ == "__main__":`.

Example (an example script a laptop user runs with plain `python train.py`)::

    def train(steps):
        mesh = Mesh.from_environment(("dp", "tp"), (2, 2), timeout=60.0)
        ...
        return final_loss

    if __name__ == "__main__":
        losses = launch_local(train, 4, 10)     # one value per rank, in rank order
"""

from __future__ import annotations

import signal
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (small race accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run fn(*args) in `nprocs` local processes wired as one torch.distributed world.

    Returns the per-rank return values in rank order. `timeout` bounds how long the workers may
    take to start and meet (the rendezvous); the collectives' own timeout is the Mesh's. If a
    worker fails, every worker is stopped and torch's ChildFailedError is raised with the failed
    rank and its traceback in the message.
    """
    if nprocs < 1:
        raise ValueError(f"launch_local needs at least one process, got nprocs={nprocs}")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"usc-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"join_timeout": timeout},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    # torch's launcher sets its own handlers for SIGINT, SIGTERM, SIGHUP and SIGQUIT in this process
    # (they raise its SignalException) and leaves them set: Ctrl-C after the launch would not be a
    # KeyboardInterrupt any more. The caller's handlers come back when the launch ends.
    saved = {}
    if threading.current_thread() is threading.main_thread():
        saved = {sig: signal.getsignal(sig) for sig in _LAUNCHER_SIGNALS}
    try:
        results = elastic_launch(config, fn)(*args)
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(sig, handler)
    return [results[rank] for rank in range(nprocs)]


_LAUNCHER_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
                          if hasattr(signal, name))
