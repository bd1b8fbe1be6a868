"""The one base of everything that holds device resources: `closed`, `close()`, and use in a `with` block."""

from __future__ import annotations

# How many device resources have been closed or collected in this process (Device._release, BufferRange.close):
# a launch that found its bindings open skips checking them one by one again until this moves.
_closes = [0]


def closes() -> int:
    return _closes[0]


def count_close() -> None:
    _closes[0] += 1


class Owned:
    """Holds device resources, freed by close() (safe to call twice), on leaving a `with` block, when
    garbage collected, or when its device closes. Objects made through Device.own set `_finalizer`;
    others (arrays, plans) override `closed` and `close`."""

    _finalizer = None   # a weakref.finalize from Device.own, once the resources exist

    @property
    def closed(self) -> bool:
        return self._finalizer is None or not self._finalizer.alive

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._drop_handles()

    def _drop_handles(self) -> None:
        """Forget the freed Vulkan handles, so a use after close fails loudly rather than reaching a freed one."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
