"""Bad input is skipped, counted and logged — until there is too much of it.

A sample that cannot be used (missing or unreadable file, corrupt or truncated video, zero-length
clip, malformed annotation line, placeholders that do not match the media) raises `BadSample`
where it is found. Whoever owns the data set's `BadInputLog` records it and moves on; once the
skips exceed ``max_bad_fraction`` of the data set the run stops with a `DataError` that names the
files, because a data set that bad is a problem to fix, not to train through.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple

logger = logging.getLogger("mm_data")


class BadSample(Exception):
    """One sample cannot be used: ``source`` (a file or an annotation line) and the reason why."""

    def __init__(self, source: str, reason: str):
        super().__init__(f"{source}: {reason}")
        self.source, self.reason = str(source), reason

    @property
    def unnamed(self) -> bool:
        """Whether the source is a medium's bytes (`bytes_source`), which its sample should name."""
        return self.source.startswith("<") and self.source.endswith(" bytes>")


def bytes_source(what: str, data: bytes) -> str:
    """The name of a medium given as bytes (inside a shard) until its sample names it: the data
    sets re-raise such a `BadSample` under the sample's row (`BadSample.unnamed`)."""
    return f"<{what} of {len(data)} bytes>"


class DataError(RuntimeError):
    """The data set is unusable as configured (too many bad samples, nothing left, wrong options)."""


class BadInputLog:
    """Counts skipped samples; raises `DataError` once they exceed ``max_bad_fraction`` of ``total``.

    ``total`` is the number of entries the data set was built from (set once loading is done);
    before it is known only the count grows, and `check` applies the limit later.
    """

    def __init__(self, max_bad_fraction: float = 0.05, total: Optional[int] = None, names_in_error: int = 10):
        if not 0.0 <= max_bad_fraction <= 1.0:
            raise ValueError(f"max_bad_fraction must be within [0, 1], got {max_bad_fraction}")
        self.max_bad_fraction, self.total, self.names_in_error = max_bad_fraction, total, names_in_error
        self.skipped: List[Tuple[str, str]] = []
        self._sources = set()

    @property
    def count(self) -> int:
        return len(self.skipped)

    def skip(self, error: BadSample) -> None:
        """Record one bad sample, log it, and stop the run if there are now too many.

        A source counts once however often it is met (a bad video stays bad every epoch)."""
        if error.source in self._sources:
            return
        self._sources.add(error.source)
        self.skipped.append((error.source, error.reason))
        logger.warning("skipped bad sample %d: %s: %s", self.count, error.source, error.reason)
        self.check()

    def check(self) -> None:
        if self.total is None:
            return
        if self.total == 0:
            raise DataError("the data set has no usable samples" + self._names())
        if self.count > self.max_bad_fraction * self.total:
            raise DataError(
                f"{self.count} of {self.total} samples are bad, more than max_bad_fraction="
                f"{self.max_bad_fraction}; fix or remove them, or raise max_bad_fraction." + self._names())

    def _names(self) -> str:
        if not self.skipped:
            return ""
        shown = "\n".join(f"  {source}: {reason}" for source, reason in self.skipped[: self.names_in_error])
        more = self.count - self.names_in_error
        return f"\nbad samples:\n{shown}" + (f"\n  ... and {more} more" if more > 0 else "")
