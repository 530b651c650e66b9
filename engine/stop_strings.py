"""Stop strings matched in time linear in the generated text, whatever their length.

One Knuth-Morris-Pratt automaton per stop string.  Its state is the length of
the longest tail of the text so far that is a prefix of the stop, so feeding a
step's new characters costs O(new characters) amortized, and the state is also
how much text must be held back because it could still grow into the stop.
(Searching the whole tail again each step, and trying every prefix length
against it, cost O(stop length) and O(text length ^ 2) per step.)
"""

from __future__ import annotations

from collections.abc import Sequence


class _Automaton:
    __slots__ = ("stop", "border", "state")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        # border[i]: length of the longest proper prefix of stop[:i + 1] that is also its suffix
        border = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = border[k - 1]
            if stop[i] == stop[k]:
                k += 1
            border[i] = k
        self.border = border
        self.state = 0

    def feed(self, chunk: str) -> int:
        """-> the index in `chunk` just past the stop's first full match, or -1."""
        stop, border, k = self.stop, self.border, self.state
        j, n = 0, len(chunk)
        while j < n:
            if k == 0:  # nothing matched yet: jump (in C) to the stop's first character
                j = chunk.find(stop[0], j)
                if j < 0:
                    break
            c = chunk[j]
            while k and c != stop[k]:
                k = border[k - 1]
            if c == stop[k]:
                k += 1
                if k == len(stop):
                    self.state = k
                    return j + 1
            j += 1
        self.state = k
        return -1


class StopMatcher:
    """Feed text as it is generated; learn where the earliest stop string starts."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._automata = [_Automaton(s) for s in stops]
        self._length = 0  # characters fed so far

    def feed(self, chunk: str) -> tuple[int, str] | None:
        """-> (index in the whole text, stop) of the earliest match that ends in
        `chunk` (ties go to the longer stop), or None."""
        best: tuple[int, str] | None = None
        for a in self._automata:
            end = a.feed(chunk)
            if end >= 0:
                start = self._length + end - len(a.stop)
                if best is None or start < best[0] or (start == best[0] and len(a.stop) > len(best[1])):
                    best = (start, a.stop)
        self._length += len(chunk)
        return best

    def held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        return max((a.state for a in self._automata), default=0)
