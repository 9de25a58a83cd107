"""The request metrics of frontends run side by side (`serve --api-server-count N`), which take
connections on one port: a Prometheus scrape reaches one of them, and its /metrics must count
every frontend's requests. Each writes its own figures (`FrontendFigures`, JSON) to a file of
--metrics-share-dir every second, replaced whole; /metrics adds the others' files to its own
live figures. A peer's counters lag by up to a second, and never go back."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

import msgspec

from services.frontend.metrics.prometheus import FrontendFigures

logger = logging.getLogger(__name__)
WRITE_INTERVAL_S = 1.0


def share_file(folder: str, name: str) -> Path:
    """A frontend's file (`name`: its process id, unless a test names it): written every
    second while its loop runs, so `serve` also tells a hung frontend by its age."""
    return Path(folder) / f"frontend-{name}.json"


class MetricsShare:
    def __init__(self, folder: str, name: str | None = None) -> None:
        """`name`: this frontend's file in the folder (default: after its process)."""
        self.folder = Path(folder)
        self.own = share_file(folder, name or str(os.getpid()))
        self._decoder = msgspec.json.Decoder(FrontendFigures)

    def write(self, figures: FrontendFigures) -> None:
        partial = self.own.with_suffix(".partial")
        partial.write_bytes(msgspec.json.encode(figures))
        os.replace(partial, self.own)  # a reader sees the old file or the new, never half

    def peers(self) -> list[FrontendFigures]:
        """The other frontends' latest figures (a file that cannot be read is left out)."""
        figures = []
        for path in sorted(self.folder.glob("frontend-*.json")):
            if path == self.own:
                continue
            try:
                figures.append(self._decoder.decode(path.read_bytes()))
            except (OSError, msgspec.DecodeError) as exc:
                logger.debug("%s: %s", path, exc)
        return figures

    async def run(self, figures: Callable[[], FrontendFigures]) -> None:
        while True:
            try:
                self.write(figures())
            except OSError as exc:
                logger.warning("cannot share this frontend's metrics: %s", exc)
            await asyncio.sleep(WRITE_INTERVAL_S)
