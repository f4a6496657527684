"""Opt-in autotune of the fa2 prefill tile config, cached per shape bucket.

With ``FLASHDISPATCH_FA2_AUTOTUNE=1`` (and no explicit config), the first plan of a problem in a
new shape bucket (the problem's features and dtypes, the GPU, and the batch size, longest query
and longest KV rounded up to powers of two) returns an `AutotunedPlan`: its first run() plans
every candidate config of `candidates()` for the same inputs, times each on the real inputs (one
warm-up call, which compiles, then the median of ``TIMED_CALLS`` CUDA-event timings), keeps the
fastest for the bucket and runs it; the result is the winner's, like any later run. Later plans
in the bucket use the winner directly. The first run of a bucket therefore pays every
candidate's compile (seconds): leave it off where first-call latency matters, or warm the
buckets up before serving. Off under CUDA graphs (the candidates would share the wrapper's
fixed workspace) and on the interpreter (no GPU timing).
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Callable

import torch

from ...dispatch.problem import Device, Problem
from ...environ import env_get
from ..base import AttentionInputs, AttentionParams

AUTOTUNE_ENV = "FLASHDISPATCH_FA2_AUTOTUNE"
TIMED_CALLS = 3

# bucket key -> the winning config (process-wide; `clear()` empties it)
_WINNERS: dict = {}


def enabled() -> bool:
    """Whether FLASHDISPATCH_FA2_AUTOTUNE=1 asks for the prefill autotune."""
    return env_get(AUTOTUNE_ENV) == "1"


def clear() -> None:
    """Forget every bucket's winner."""
    _WINNERS.clear()


def _pow2(n: int) -> int:
    """The power of two at or above ``n`` (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def bucket_key(problem: Problem, device: Device, params: AttentionParams) -> tuple:
    """The bucket a plan's winner is kept for: the problem without its workload, the GPU, and
    (batch, longest query, longest KV) rounded up to powers of two."""
    return (problem, device.name, device.cc, _pow2(params.batch_size),
            _pow2(max(params.qo_lens_host, default=0)), _pow2(max(params.kv_lens_host, default=0)))


def candidates(problem: Problem, base) -> list:
    """The default config first, then, for 16-bit head dims up to 128, the tile shapes the H200
    sweeps put within a few % of the best on some row (docs/perf-notes.md, "Tile sweep")."""
    configs = [base]
    if problem.head_dim_qk <= 128 and problem.q_dtype in (torch.float16, torch.bfloat16):
        for m, n, w, st in ((128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)):
            cfg = replace(base, block_m=m, block_n=n, num_warps=w, num_stages=st)
            if cfg not in configs:
                configs.append(cfg)
    return configs


def device_ms(run: Callable[[], None], calls: int = TIMED_CALLS) -> float:
    """Median CUDA-event time of ``calls`` calls of ``run`` after one warm-up call, in ms."""
    run()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class AutotunedPlan:
    """A prefill plan whose first run() picks the config (see the module docstring).

    ``make_plan(config)`` plans the same problem with another config; ``timer(run)`` measures one
    candidate in ms (`device_ms` by default)."""

    def __init__(self, key: tuple, configs: list, make_plan: Callable, timer: Callable | None = None,
                 first_plan=None):
        self.key, self.configs, self.make_plan, self.timer = key, configs, make_plan, timer or device_ms
        self.first_plan = first_plan  # configs[0] planned already (plan() raised its errors)
        self.plan = None
        self.timings: list[tuple[object, float]] = []  # (config, ms); inf for a config that failed
        self.failures: list[str] = []  # why each failed config failed

    def run(self, inputs: AttentionInputs) -> None:
        """Tune on the first call (on the inputs' GPU), then run the winner."""
        if self.plan is None:
            if inputs.q.is_cuda:
                with torch.cuda.device(inputs.q.device):  # the events time the GPU the kernels run on
                    self.plan = self._tune(inputs)
            else:
                self.plan = self._tune(inputs)
        self.plan.run(inputs)

    def refresh_tile_lists(self) -> None:
        """A new custom mask: the tile lists of the plans made so far (candidates planned later, at
        the first run, read the mask then)."""
        for plan in {id(p): p for p in (self.first_plan, self.plan) if p is not None}.values():
            plan.refresh_tile_lists()

    def _tune(self, inputs: AttentionInputs):
        best, best_ms = None, float("inf")
        for cfg in self.configs:
            try:
                first = cfg is self.configs[0] and self.first_plan is not None
                plan = self.first_plan if first else self.make_plan(cfg)
                ms = self.timer(lambda: plan.run(inputs))
            except Exception as e:  # a config that does not compile or fit: skip it, keep its reason
                if cfg is self.configs[0]:
                    raise  # the default config must run: that is a real error, not a tuning miss
                self.timings.append((cfg, float("inf")))
                self.failures.append(f"{cfg}: {type(e).__name__}: {e}")
                continue
            self.timings.append((cfg, ms))
            if ms < best_ms:
                best, best_ms = plan, ms
        _WINNERS[self.key] = best.config
        return best


def plan_with_autotune(problem: Problem, device: Device, params: AttentionParams, base, make_plan: Callable,
                       kernel_variant: tuple = ()):
    """A plan for ``base`` or the bucket's winner, or an `AutotunedPlan` for a new bucket;
    ``kernel_variant`` tells apart buckets of one problem that run different kernels."""
    key = bucket_key(problem, device, params) + kernel_variant
    winner = _WINNERS.get(key)
    if winner is not None:
        return make_plan(winner)
    # the default is planned now, so plan() raises what a plain plan would (workspace size, ...)
    return AutotunedPlan(key, candidates(problem, base), make_plan, first_plan=make_plan(base))
