"""The page-index check of a paged wrapper's plan() that does not wait for the GPU.

A serving engine builds a step's lengths (indptr, last_page_len) on the host and its page
indices on the GPU; FlashInfer's plan() then reads nothing from the device and checks nothing.
Ours checks the used indices ((min, max) >= 0 and within the cache), and reading them back
would wait for every kernel queued before plan(), the previous step's included. So when the
lengths are CPU tensors, the indices a CUDA tensor and the check on
(`checks.page_indices_checked`), plan() queues the reduction (`device_read.IndexRangeReader`)
and returns; `DeferredPageCheck._finish_page_check` says where the check ends. That is safe
only where the planned backend clamps every page index it reads into the cache
(`Backend.clamps_page_indices`); with another backend plan() ends the check before it returns.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import checks

if TYPE_CHECKING:
    import numpy as np

    from .device_read import IndexRangeReader
    from .planned import PlannedAttention


def clamps(planned: PlannedAttention | None) -> bool:
    """Whether the planned backend's kernels clamp the page indices they read."""
    return planned is not None and planned.backend.clamps_page_indices(planned.problem)


class DeferredPageCheck:
    """The deferred page-index check of a paged plan()/run() wrapper (a `planned.WrapperBase`).

    plan() calls `_finish_page_check` first (the last plan()'s check), then `_begin_page_check`,
    and plans inside `_planning_with_page_check`; run() calls `_page_check_at_run` before its
    launch. ``_INDICES``/``_INDPTR`` name the wrapper's arguments in the errors;
    `_set_max_page_index` records the largest index where the wrapper keeps it."""

    _INDICES = "indices"
    _INDPTR = "indptr"
    _page_reader: IndexRangeReader | None = None  # made at the first deferred check
    _cache_pages: int | None = None  # pages its end checks against (`_finish_page_check`)
    _checked_pages = 0  # the used indices of the pending check (indptr[-1])
    _page_runs = 0  # run()s since the pending check's plan() (`_reduction_ran`)

    @staticmethod
    def _defers_page_check(lengths: tuple[torch.Tensor, ...], indices: torch.Tensor) -> bool:
        """Whether plan() may queue the check: lengths on the host, indices on a GPU, check on."""
        return all(t.is_cpu for t in lengths) and indices.is_cuda and checks.page_indices_checked()

    def _begin_page_check(self, indices: torch.Tensor, used_pages: int, max_page_index: int,
                          upload: list[np.ndarray] | None = None) -> tuple[int, list[torch.Tensor] | None]:
        """Queue the check of ``indices[:used_pages]``. Returns the largest index plan() may record
        until it ends (0: page 0 at least is read; ``max_page_index`` when nothing is used) and,
        with ``upload`` (host int arrays), their int32 copies on the indices' GPU, made by the
        check's own launch (`IndexRangeReader.start`; None when nothing is used: no launch)."""
        if used_pages <= 0:
            return max_page_index, None
        if not self._use_cuda_graph:  # (graph replays read the capture's cache and run no Python)
            self._cache_pages = None
        if self._page_reader is None:
            from .device_read import IndexRangeReader  # Triton: only where device values are read
            self._page_reader = IndexRangeReader()
        uploaded = self._page_reader.start(indices, used_pages, upload)
        self._checked_pages, self._page_runs = used_pages, 0
        return 0, uploaded

    def _planning_with_page_check(self, plan) -> None:
        """``plan()`` (the wrapper's planning), dropping a queued check if it fails, and ending it
        now where the planned backend does not clamp page indices."""
        try:
            plan()
        except BaseException:
            if self._page_checking():
                self._page_reader.result()  # this plan failed: its check goes with it
            raise
        if self._page_checking() and not clamps(self._planned):
            self._finish_page_check()

    def _page_check_at_run(self, planned: PlannedAttention, num_pages: int) -> None:
        """Before run()'s launch on a cache of ``num_pages`` pages: end the check if
        ``planned``'s backend does not clamp page indices, or if this run() asks whether its
        reduction has run and it has (`_reduction_ran`). A plan whose check found a negative index
        is refused at every run() until a plan() succeeds (`WrapperBase._variant`, which run()
        calls first)."""
        keep = self._use_cuda_graph or self._cache_pages is None
        self._cache_pages = num_pages if keep else min(self._cache_pages, num_pages)
        if self._page_checking() and (not clamps(planned) or self._reduction_ran()):
            self._finish_page_check()

    def _reduction_ran(self) -> bool:
        """Whether the pending check's reduction has run, asked at the 1st, 2nd, 4th, 8th, ...
        run() after its plan(): the question is an event query (a driver call), which an engine
        issuing a step's runs (one a layer) ahead of the GPU would otherwise pay at each of them;
        a plan run many times still ends its check (within twice the runs it took to run)."""
        self._page_runs = n = self._page_runs + 1
        return n & (n - 1) == 0 and self._page_reader.done()

    def _page_checking(self) -> bool:
        """Whether a deferred page-index check has not ended (`_finish_page_check`)."""
        return self._page_reader is not None and self._page_reader.pending

    def _finish_page_check(self) -> None:
        """End a deferred page-index check (waiting for its reduction if it has not run): raise
        ValueError for a negative page index, or for one past the pages of the smallest cache a
        run() got since that plan() (none: a later run() checks it; CUDA-graph wrappers: the cache
        of the last run(), the capture's, which the replays read); else make its largest index
        what run() checks the cache against (also when it raises for it: a retried run() on that
        cache is refused; after a negative index, every run() of the plan is; raised in a plan(),
        every run() is refused until a plan() succeeds, `refuse_runs_after_failure`). An engine may grow
        its cache between steps: an eager plan's indices are never checked against the cache of
        an earlier plan's run().

        The check ends at a run() that asks whether its reduction has run and finds it has
        (before the launch; `_reduction_ran`), at a run() of a backend that does not clamp, or at
        the next plan() (CUDA-graph replays run no Python). Runs before its end read clamped
        pages: an error raised at the end says their outputs are wrong."""
        if not self._page_checking():
            return
        low, high = self._page_reader.result()
        clamped = "any run() of that plan before this error read the cache's last page in its place"
        if low < 0:  # no cache makes that index valid: later runs of the plan are refused too
            self._refused_plan = (f"{self._INDICES} of the last plan() hold a negative page index {low} in their "
                                  f"first {self._checked_pages} entries ({self._INDPTR}[-1])")
            raise ValueError(f"{self._refused_plan}; {clamped}")
        self._set_max_page_index(high)
        if self._cache_pages is not None and high >= self._cache_pages:
            which = ("the cache of the last run()" if self._use_cuda_graph
                     else "the smallest cache a run() got since that plan()")
            raise ValueError(f"{self._INDICES} of the last plan() reference page {high}, but paged_kv_cache has only "
                             f"{self._cache_pages} pages ({which}); {clamped}")

    def _set_max_page_index(self, high: int) -> None:
        """Record ``high``, the largest used page index, in the plan variants made so far."""
        for planned in self._variants.values():
            planned.max_page_index = high
