"""`BatchLookahead`: the training loop's batches, with a peek at the ones to come (background rounds, streaming).

The background rounds (`max_staleness >= 1`) and the stream (`rollout_stream: true`) sample a generation batch
before the trainer reaches it. They peek it here, pulled early from the loop's own epoch iterator, and the loop
gets the same batches in the same order. Past an epoch's end a peek starts the next epoch's iterator the way
`transformers.Trainer` starts it (`next_epoch_iterator`), and the loop's own iterator for that epoch, still
unread, is swapped for it: the sampler draws each epoch's order once, so the batches are those of a run without
the lookahead (tested in tests/trainer/test_async_rounds.py and test_streaming_trainer.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any


def next_epoch_iterator(trainer) -> Iterator | None:
    """The iterator `Trainer._run_epoch` makes for the epoch after the current one, over the train dataloader
    (the one the callbacks see: a resumed epoch's skipping wrapper is not reused): `set_epoch` on the dataloader
    and on a batch sampler wrapped in accelerate's `BatchSamplerShard`, then `iter`; None when the training ends
    with the current epoch. Call it while the current epoch runs (`trainer.state.epoch` counts the optimizer steps
    done, so its floor is the current epoch)."""
    dataloader = trainer.callback_handler.train_dataloader
    epoch = int(trainer.state.epoch or 0) + 1
    if epoch >= trainer.state.num_train_epochs:
        return None
    if hasattr(dataloader, "set_epoch"):
        dataloader.set_epoch(epoch)
    inner = getattr(getattr(dataloader, "batch_sampler", None), "batch_sampler", None)
    if hasattr(inner, "set_epoch"):
        inner.set_epoch(epoch)
    return iter(dataloader)


class BatchLookahead:
    """The training loop's batches, with a peek at the generation batch that comes `ahead` batches later.

    `pull` replaces `Trainer.get_batch_samples` (same batches, same order); `peek(batch, ahead)` returns the
    batch the loop will hand to `training_step` `ahead` micro-steps after `batch`, pulling it early from the
    same epoch iterator. Past the epoch's end it reads the next epoch from `next_epoch()` (module docstring; at
    most one epoch ahead), or returns None without one (no `next_epoch`, or it returned None: the last epoch). Batches are matched by identity, never by content.
    """

    def __init__(self, next_epoch: Callable[[], Iterator] | None = None):
        self.next_epoch = next_epoch
        self._loop_it = None  # the iterator the loop passes (its epoch's)
        self._it = None  # the one read: the loop's, or the next epoch's started early in its place
        self._buf: deque = deque()
        self._index: dict[int, tuple[int, Any]] = {}
        self._pos = 0  # stream index of the next batch handed out
        self._done = False
        self._ahead: Iterator | None = None  # the next epoch's iterator, started by a peek past this epoch's end
        self._ahead_buf: deque = deque()
        self._ahead_done = False

    @staticmethod
    def _read(iterator):
        try:
            return next(iterator)
        except StopIteration:
            return None

    def _next(self):
        if self._done:
            return None
        nxt = self._read(self._it)
        self._done = nxt is None
        return nxt

    def pull(self, iterator, num: int) -> list:
        if iterator is not self._loop_it:  # a new epoch: nothing peeked from the old one survives, but the next one
            self._loop_it = self._it = iterator
            self._buf, self._index, self._pos, self._done = deque(), {}, 0, False
            if self._ahead is not None:  # started early: the loop's own iterator is unread, and is not read
                self._it, self._buf, self._done = self._ahead, self._ahead_buf, self._ahead_done
                self._ahead, self._ahead_buf, self._ahead_done = None, deque(), False
        out = []
        for _ in range(num):
            batch = self._buf.popleft() if self._buf else self._next()
            if batch is None:
                break
            self._index[id(batch)] = (self._pos, batch)
            self._pos += 1
            out.append(batch)
        while len(self._index) > 256:  # the references keep ids unique; only recent batches are looked up
            self._index.pop(next(iter(self._index)))
        return out

    @property
    def epoch_batches(self) -> int | None:
        """Batches of the current epoch once its iterator is spent (None before)."""
        return self._pos + len(self._buf) if self._done else None

    def peek(self, batch, ahead: int):
        entry = self._index.get(id(batch))
        if entry is None or entry[1] is not batch:
            return None
        j = entry[0] + ahead - self._pos
        if j < 0:
            return None
        while len(self._buf) <= j and not self._done:
            if (nxt := self._next()) is not None:
                self._buf.append(nxt)
        if j < len(self._buf):
            return self._buf[j]
        if self.next_epoch is None:
            return None
        j -= len(self._buf)
        if self._ahead is None:
            self._ahead = self.next_epoch()
            if self._ahead is None:  # no epoch after this one: asked once
                self.next_epoch = None
                return None
        while len(self._ahead_buf) <= j and not self._ahead_done:
            nxt = self._read(self._ahead)
            self._ahead_done = nxt is None
            if nxt is not None:
                self._ahead_buf.append(nxt)
        return self._ahead_buf[j] if j < len(self._ahead_buf) else None


__all__ = ["BatchLookahead", "next_epoch_iterator"]
