"""The opt-in fa2 prefill autotune (backends/fa2/tuning.py) on the CPU: the candidates run under
the Triton interpreter, the timer is a stand-in (no GPU timing here), so the choice is forced and
what is tested is the mechanism: the winner runs and is kept per bucket, failures are skipped."""
from __future__ import annotations

import pytest
import torch

from flashdispatch.backends.base import DEFAULT_TOLERANCE
from flashdispatch.backends.fa2 import tuning
from flashdispatch.backends.fa2.prefill import PrefillPlan, plan_prefill
from flashdispatch.backends.fa2.prefill_config import PrefillConfig
from oracle import assert_close, make_ragged_case

pytestmark = pytest.mark.interpreted

CONFIGS = [PrefillConfig(32, 16, 4, 1), PrefillConfig(16, 16, 4, 1), PrefillConfig(16, 32, 4, 1)]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    tuning.clear()
    monkeypatch.setattr(tuning, "candidates", lambda problem, base: list(CONFIGS))
    yield
    tuning.clear()


def fake_timer(times: list[float]):
    """Runs each candidate once (so it must work) and reports the next time of ``times``."""
    it = iter(times)

    def timer(run):
        run()
        return next(it)
    return timer


def case(kv_len=70, seed=0):
    return make_ragged_case(qo_lens=[20, 33], kv_lens=[30, kv_len], mask_mode="causal", head_dim_qk=64,
                            q_dtype=torch.float16, seed=seed)


def test_first_run_times_the_candidates_runs_the_fastest_and_keeps_it(monkeypatch):
    monkeypatch.setattr(tuning, "device_ms", fake_timer([3.0, 1.0, 2.0]))
    c = case()
    plan = plan_prefill(c.problem, c.device, c.params, autotune=True)
    assert isinstance(plan, tuning.AutotunedPlan)
    c.inputs.out.fill_(float("nan"))
    plan.run(c.inputs)
    assert plan.plan.config == CONFIGS[1] and [t for _, t in plan.timings] == [3.0, 1.0, 2.0]
    assert_close(c.inputs.out, c.inputs.lse, *c.oracle(), DEFAULT_TOLERANCE[torch.float16])
    # the same bucket (lengths rounded up to powers of two) plans the winner directly
    again = case(kv_len=100, seed=1)
    kept = plan_prefill(again.problem, again.device, again.params, autotune=True)
    assert isinstance(kept, PrefillPlan) and kept.config == CONFIGS[1]
    kept.run(again.inputs)
    assert_close(again.inputs.out, again.inputs.lse, *again.oracle(), DEFAULT_TOLERANCE[torch.float16])
    # a longer KV is another bucket: tuned again
    assert isinstance(plan_prefill(c.problem, c.device, case(kv_len=200).params, autotune=True),
                      tuning.AutotunedPlan)


def test_a_failing_candidate_is_skipped_and_the_default_must_work():
    c = case()
    plans = {}

    def make_plan(cfg):
        if cfg == CONFIGS[2]:
            raise RuntimeError("out of shared memory")
        plans[cfg] = PrefillPlan(c.problem, c.device, c.params, cfg)
        return plans[cfg]

    tuned = tuning.AutotunedPlan(("k",), list(CONFIGS), make_plan, timer=fake_timer([2.0, 5.0]))
    tuned.run(c.inputs)
    assert tuned.plan is plans[CONFIGS[0]] and tuned.timings[2] == (CONFIGS[2], float("inf"))
    assert "out of shared memory" in tuned.failures[0]
    broken = tuning.AutotunedPlan(("k2",), [CONFIGS[2]], make_plan, timer=fake_timer([1.0]))
    with pytest.raises(RuntimeError, match="out of shared memory"):
        broken.run(c.inputs)


def test_autotune_stays_off_unless_asked_and_on_a_gpu(monkeypatch):
    c = case()
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    assert isinstance(plan_prefill(c.problem, c.device, c.params), PrefillPlan)  # CPU device
    assert isinstance(plan_prefill(c.problem, c.device, c.params, config=CONFIGS[0], autotune=True), PrefillPlan)
    graph = c.problem.with_(use_cuda_graph=True)
    c.params.int_workspace = torch.zeros(1 << 16, dtype=torch.uint8)
    assert isinstance(plan_prefill(graph, c.device, c.params, autotune=True), PrefillPlan)
    monkeypatch.delenv(tuning.AUTOTUNE_ENV)
    assert not tuning.enabled()


def test_plan_errors_surface_at_plan_not_at_the_first_run():
    """The default config is planned at plan(), so its errors (here: a custom mask without its
    bits) are raised there, as without autotune."""
    c = make_ragged_case(qo_lens=[8], kv_lens=[20], mask_mode="custom", head_dim_qk=64, q_dtype=torch.float16)
    c.params.packed_mask = None
    with pytest.raises(ValueError, match="packed_mask"):
        plan_prefill(c.problem, c.device, c.params, autotune=True)


def test_rotated_first_rope_prefill_keeps_its_own_winner(monkeypatch):
    """A ragged RoPE prefill whose K is rotated first plans the problem without RoPE but runs a
    kernel that rotates Q: its bucket is not the plain problem's."""
    from flashdispatch.backends.fa2 import prefill_rope
    monkeypatch.setattr(prefill_rope, "MIN_QUERY_ROWS", 1)
    monkeypatch.setattr(tuning, "device_ms", fake_timer([3.0, 1.0, 2.0]))
    c = case()
    plain = plan_prefill(c.problem, c.device, c.params, autotune=True)
    plain.run(c.inputs)
    rope = make_ragged_case(qo_lens=[20, 33], kv_lens=[30, 70], mask_mode="causal", head_dim_qk=64,
                            q_dtype=torch.float16, pos_encoding_mode="ROPE_LLAMA")
    monkeypatch.setattr(tuning, "device_ms", fake_timer([1.0, 3.0, 2.0]))
    tuned = plan_prefill(rope.problem, rope.device, rope.params, autotune=True)
    assert isinstance(tuned.inner, tuning.AutotunedPlan)  # not the plain problem's kept winner
    rope.inputs.out.fill_(float("nan"))
    tuned.run(rope.inputs)
    assert tuned.inner.plan.config == CONFIGS[0] and tuned.inner.plan.q_rope == 1
    assert_close(rope.inputs.out, rope.inputs.lse, *rope.oracle(), DEFAULT_TOLERANCE[torch.float16])


@pytest.mark.parametrize("tuned_first", [False, True], ids=["before_tuning", "after_tuning"])
def test_a_new_custom_mask_refreshes_the_autotuned_plan(monkeypatch, tuned_first):
    """FA2Backend.replan_mask refreshes the tile lists of an autotuned plan before and after its
    tuning run, so a new mask of a kept plan gives the new mask's attention."""
    from flashdispatch.backends.fa2 import FA2Backend
    from flashdispatch.quantization import packbits
    monkeypatch.setattr(tuning, "device_ms", fake_timer([3.0, 1.0, 2.0]))
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    c = make_ragged_case(qo_lens=[40], kv_lens=[40], mask_mode="custom", custom_masks=[causal], head_dim_qk=64,
                         q_dtype=torch.float16)
    plan = plan_prefill(c.problem, c.device, c.params, autotune=True)
    if tuned_first:
        plan.run(c.inputs)
    flipped = causal.flip(0)
    c.params.packed_mask.copy_(packbits(flipped.reshape(-1), "little"))
    assert FA2Backend().replan_mask(plan, c.problem, c.device, c.params) is plan
    c.inputs.out.fill_(float("nan"))
    plan.run(c.inputs)
    want = make_ragged_case(qo_lens=[40], kv_lens=[40], mask_mode="custom", custom_masks=[flipped], head_dim_qk=64,
                            q_dtype=torch.float16)
    assert_close(c.inputs.out, c.inputs.lse, *want.oracle(), DEFAULT_TOLERANCE[torch.float16])
