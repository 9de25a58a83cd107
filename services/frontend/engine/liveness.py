"""When the frontend counts a component (scheduler, executor, tokenizer worker) as gone.

Slow is not dead. A process that is alive but starved of CPU (a loaded machine, a noisy
neighbour) sends its heartbeats late, so late heartbeats prove little. What proves a process
gone is its exit: `kvflow serve` sees it and tells the frontend (ComponentDown), and the kernel
closes a dead process's sockets at once, which the frontend's ROUTER reports (its socket
monitor). So a component counts as gone

- when the connection its heartbeats came on closed and it has not beaten again (on a new
  one) for `reconnect_grace` seconds: a live process whose connection broke reconnects and
  beats within a second;
- or, its connection still open, when it has sent no heartbeat for `silence_limit` seconds
  (--component-timeout, generous): a process so stuck that even its heartbeat thread stopped,
  or one cut off without its connection closing (a network partition).

Pure: no sockets, no clock; the engine client passes in the times, and each connection as the
file descriptor its messages carry (ZMQ_SRCFD) and its monitor names when it closes.
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.constants import RECONNECT_GRACE_S


class Liveness:
    def __init__(self, silence_limit: float, reconnect_grace: float = RECONNECT_GRACE_S) -> None:
        self.silence_limit, self.reconnect_grace = silence_limit, reconnect_grace
        self._last_seen: dict[str, float] = {}
        self._connection: dict[str, int] = {}  # component -> the connection of its last beat
        self._closed_at: dict[str, float] = {}  # component -> when that closed (no beat since)

    @property
    def last_seen(self) -> Mapping[str, float]:
        """Every component heard from, and when it last beat."""
        return self._last_seen

    def beat(self, name: str, now: float, connection: int | None = None) -> None:
        """A heartbeat from `name` on `connection` (None: unknown, as over inproc://)."""
        self._last_seen[name] = now
        self._closed_at.pop(name, None)
        if connection is None:
            self._connection.pop(name, None)
        else:
            self._connection[name] = connection

    def closed(self, connection: int, now: float) -> None:
        """A connection closed: the component whose beats came on it may be gone.

        A new connection may take the same descriptor and carry a beat before this notice is
        read; that beat's component is then suspected wrongly, and cleared by its next beat,
        well within the grace."""
        for name in [n for n, c in self._connection.items() if c == connection]:
            del self._connection[name]
            self._closed_at.setdefault(name, now)

    def forget(self, name: str) -> None:
        """`name` left (a tokenizer worker dropped from the pool): nothing more is judged."""
        self._last_seen.pop(name, None)
        self._connection.pop(name, None)
        self._closed_at.pop(name, None)

    def gone(self, name: str, now: float) -> str | None:
        """Why `name` counts as gone at `now`, or None while it may be alive, however late its
        heartbeats are within the silence limit (and a component never heard from: starting).
        A component that beats again is alive again."""
        closed_at = self._closed_at.get(name)
        if closed_at is not None and now - closed_at >= self.reconnect_grace:
            return f"{name} is gone (its connection closed {now - closed_at:.0f} s ago)"
        seen = self._last_seen.get(name)
        if seen is not None and now - seen > self.silence_limit:
            return f"no heartbeat from {name} for {now - seen:.0f} s"
        return None
