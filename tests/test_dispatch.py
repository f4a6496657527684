"""Selection and explain with fake devices and fake backends (no GPU, no real kernels)."""
from __future__ import annotations

import threading
import warnings

import pytest
import torch

from flashdispatch.backends.base import Backend
from flashdispatch.dispatch import registry
from flashdispatch.dispatch.caps import ALL_FEATURES, Caps
from flashdispatch.dispatch.explain import (
    backends_table, describe_device, describe_problem, describe_workload, explain_problem, format_decision,
)
from flashdispatch.dispatch.policy import load_config, reset_policy
from flashdispatch.dispatch.problem import EMPTY_WORKLOAD, Device, Problem, Workload
from flashdispatch.dispatch.reasons import Reason, Unsupported
from flashdispatch.dispatch.select import (
    ReferenceFallbackWarning, active_backends, clear_cache, decide, select, use_backends,
)

SM80 = Device("cuda", 0, (8, 0), "A100")
SM90 = Device("cuda", 0, (9, 0), "NVIDIA H200")
SM100 = Device("cuda", 0, (10, 0), "B200")
CPU = Device("cpu")
ALL_OPS = ("decode", "prefill_paged", "prefill_ragged", "mla", "merge")


def problem(op="decode", **kw) -> Problem:
    base = dict(op=op, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, o_dtype=torch.bfloat16,
                num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, head_dim_vo=128, page_size=16)
    base.update(kw)
    return Problem(**base)


def make_fake(name, devices=("cuda",), features=ALL_FEATURES, ops=ALL_OPS, unavailable=(), min_cc=None):
    """A Backend subclass with the given caps that counts its supports() calls."""
    caps = Caps(ops=frozenset(ops), device_types=frozenset(devices), features=frozenset(features), min_cc=min_cc)

    class Fake(Backend):
        calls = 0

        @classmethod
        def _availability(cls):
            return list(unavailable)

        @classmethod
        def supports(cls, problem, device):
            cls.calls += 1
            return super().supports(problem, device)

        @classmethod
        def version(cls):
            return f"fake {name} 1.0"

    Fake.name, Fake.caps = name, caps
    return Fake


@pytest.fixture
def fakes(monkeypatch):
    """Every registered name served by a fake that can run anything on CUDA (reference and fa2
    on the CPU too). Tests replace entries; an Exception entry makes the import fail."""
    monkeypatch.delenv("FLASHDISPATCH_BACKEND", raising=False)
    monkeypatch.delenv("FLASHDISPATCH_CONFIG", raising=False)
    table = {n: make_fake(n) for n in registry.BACKEND_NAMES}
    table["reference"] = make_fake("reference", devices=("cpu", "cuda"))
    table["fa2"] = make_fake("fa2", devices=("cpu", "cuda"))

    def backend_class(name):
        registry.check_backend_name(name)
        entry = table[name]
        if isinstance(entry, Exception):
            raise entry
        return entry

    monkeypatch.setattr(registry, "backend_class", backend_class)
    monkeypatch.setattr(registry, "get_backend", lambda name: backend_class(name)())
    reset_policy()
    clear_cache()
    yield table
    reset_policy()
    clear_cache()


def reject(table, name, **kw):
    table[name] = make_fake(name, **kw)


NO_SOFT_CAP = ALL_FEATURES - {"soft_cap"}


# --- the order and the choice ----------------------------------------------------------------------
def test_auto_picks_first_ok_in_rule_order(fakes):
    d = select(problem(), SM90)
    assert d.backend == "fa2"
    assert d.order_source == "rule 'hopper-decode' (configs/default.yaml)"
    assert [c[0] for c in d.candidates][:5] == ["fa2", "cudnn", "xqa", "trtllm-gen", "reference"]
    assert select(problem("prefill_paged"), SM90).backend == "fa3"
    assert select(problem("mla"), SM100).backend == "trtllm-gen"


def test_auto_runs_mla_on_fa2_on_hopper():
    """The packaged backends: fa3 and cutlass have no MLA kernels, so sm90 MLA goes to fa2 (not
    the PyTorch reference)."""
    d = select(describe_problem("mla"), SM90)
    assert d.backend == "fa2" and d.order_source.startswith("rule 'hopper-mla'")


def test_every_backend_is_checked_and_every_reason_kept(fakes):
    reject(fakes, "fa2", features=NO_SOFT_CAP - {"lse"}, unavailable=())
    d = select(problem(logits_soft_cap=30.0), SM90)
    assert d.backend == "cudnn"
    assert [r.code for r in d.reasons("fa2")] == ["feature.lse", "feature.soft_cap"]
    assert all(cls.calls == 1 for cls in fakes.values())


def test_defaults_when_no_rule_matches(fakes):
    d = select(problem(), SM80)
    assert d.backend == "fa2" and d.order_source == "defaults (configs/default.yaml)"


def test_cpu_uses_reference_only_and_fa2_only_on_request(fakes):
    d = select(problem(), CPU)
    assert d.backend == "reference" and d.order_source == "rule 'cpu' (configs/default.yaml)"
    assert dict((n, note) for n, _, note in d.candidates)["fa2"] == "not in order"
    assert select(problem(), CPU, requested="fa2").backend == "fa2"


def test_explicit_request_wins_over_everything(fakes, monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHDISPATCH_BACKEND", "xqa")
    load_config(_yaml(tmp_path, "pins:\n  - {backend: cudnn}\n"))
    with use_backends(["fa3"]):
        d = select(problem(), SM90, requested="trtllm-gen")
    assert d.backend == "trtllm-gen" and d.order_source == "backend= argument"


def test_explicit_request_that_cannot_run_never_falls_back(fakes):
    reject(fakes, "cudnn", features=NO_SOFT_CAP)
    with pytest.raises(Unsupported) as err:
        select(problem(logits_soft_cap=30.0), SM90, requested="cudnn")
    assert set(err.value.reasons) == {"cudnn"}
    assert err.value.reasons["cudnn"][0].code == "feature.soft_cap"
    assert "'cudnn' was requested" in str(err.value) and "feature.soft_cap" in str(err.value)


def test_requested_name_is_validated(fakes):
    with pytest.raises(ValueError, match="valid: auto, reference, fa2, fa3, cudnn, trtllm-gen, xqa, cutlass"):
        select(problem(), SM90, requested="flash")


def test_use_backends_restricts_orders_and_nests(fakes, monkeypatch):
    monkeypatch.setenv("FLASHDISPATCH_BACKEND", "cudnn")
    assert active_backends() is None
    with use_backends(["xqa", "fa2"]) as names:
        assert names == ("xqa", "fa2")
        d = select(problem(), SM90)
        assert d.backend == "xqa" and d.order_source == "use_backends"
        with use_backends("fa2"):
            assert select(problem(), SM90).backend == "fa2"
            assert active_backends() == ("fa2",)
        assert select(problem(), SM90).backend == "xqa"
    assert active_backends() is None
    assert select(problem(), SM90).backend == "cudnn"


def test_use_backends_restriction_is_strict(fakes):
    reject(fakes, "xqa", ops=("mla",))
    with use_backends(["xqa"]):
        with pytest.raises(Unsupported, match=r"no backend in the order \(use_backends\)") as err:
            select(problem(), SM90)
    assert set(err.value.reasons) == {"xqa"}


def test_use_backends_is_thread_local(fakes):
    seen = []
    with use_backends(["cudnn"]):
        t = threading.Thread(target=lambda: seen.append((active_backends(), select(problem(), SM90).backend)))
        t.start()
        t.join()
        assert select(problem(), SM90).backend == "cudnn"
    assert seen == [(None, "fa2")]


@pytest.mark.parametrize("bad", [["fa9"], [], "flash"])
def test_use_backends_validates_names(fakes, bad):
    with pytest.raises(ValueError, match="use_backends: .*reference, fa2"):
        with use_backends(bad):
            pass


@pytest.mark.parametrize("bad", [3, None, b"fa2", 2.5])
def test_use_backends_refuses_what_is_not_names(fakes, bad):
    with pytest.raises(TypeError, match=r"use_backends: backends=.*: expected a backend name \(str\) or an iterable"):
        with use_backends(bad):
            pass


def test_decision_reasons_of_an_unknown_backend_lists_the_candidates(fakes):
    d = select(problem(), SM90)
    with pytest.raises(KeyError, match="'nope' is not a candidate of this decision; candidates: fa2, cudnn"):
        d.reasons("nope")


def test_env_backend_order(fakes, monkeypatch):
    monkeypatch.setenv("FLASHDISPATCH_BACKEND", "xqa")
    d = select(problem(), SM90)
    assert d.backend == "xqa" and d.order_source == "FLASHDISPATCH_BACKEND"
    reject(fakes, "xqa", ops=("mla",))
    clear_cache()
    monkeypatch.setenv("FLASHDISPATCH_BACKEND", " xqa, cudnn ,fa2")
    d = select(problem(), SM90)
    assert d.backend == "cudnn" and [c[0] for c in d.candidates][:3] == ["xqa", "cudnn", "fa2"]
    monkeypatch.setenv("FLASHDISPATCH_BACKEND", "auto")
    assert select(problem(), SM90).order_source.startswith("rule 'hopper-decode'")
    monkeypatch.setenv("FLASHDISPATCH_BACKEND", "fa2,turbo")
    with pytest.raises(ValueError, match="FLASHDISPATCH_BACKEND: 'turbo' is not a backend"):
        select(problem(), SM90)


def _yaml(tmp_path, text):
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return str(path)


def test_pin_beats_rules_and_rule_beats_defaults(fakes, tmp_path):
    path = _yaml(tmp_path, "pins:\n  - {name: mine, when: {op: decode}, backend: xqa}\n"
                           "rules:\n  - {name: ampere, when: {cc_max: [8, 9]}, order: [cudnn, fa2]}\n")
    load_config(path)
    d = select(problem(), SM90)
    assert d.backend == "xqa" and d.order_source == f"pin 'mine' ({path})"
    d = select(problem("merge"), SM80)
    assert d.backend == "cudnn" and d.order_source == f"rule 'ampere' ({path})"


def test_nothing_can_run_lists_every_backend_in_the_order(fakes):
    for name in ("fa2", "cudnn", "xqa", "trtllm-gen", "reference"):
        reject(fakes, name, features=NO_SOFT_CAP)
    with pytest.raises(Unsupported) as err:
        select(problem(logits_soft_cap=30.0), SM90)
    assert list(err.value.reasons) == ["fa2", "cudnn", "xqa", "trtllm-gen", "reference"]


def test_import_failure_is_a_reason_not_a_crash(fakes):
    fakes["fa2"] = ImportError("no module named triton_lite")
    d = select(problem(), SM90)
    assert d.backend == "cudnn"
    (reason,) = d.reasons("fa2")
    assert reason.code == "import" and "triton_lite" in reason.detail


def test_broken_supports_is_a_reason(fakes):
    class Broken(fakes["cudnn"]):
        @classmethod
        def supports(cls, problem, device):
            raise RuntimeError("bad caps")

    fakes["fa2"] = Broken
    d = select(problem(), SM90)
    assert d.backend == "cudnn" and d.reasons("fa2")[0].code == "supports_error"


# --- the reference on a GPU ----------------------------------------------------------------------
def test_reference_is_last_on_a_gpu_whatever_the_order(fakes):
    with use_backends(["reference", "fa2"]):
        d = select(problem(), SM90)
    assert d.backend == "fa2" and [c[0] for c in d.candidates][:2] == ["fa2", "reference"]


def _only_reference_can(fakes):
    for name in ("fa2", "cudnn", "xqa", "trtllm-gen"):
        reject(fakes, name, features=NO_SOFT_CAP, unavailable=[Reason("device", f"{name} lost")])


def test_reference_fallback_warns_once_with_reasons(fakes):
    _only_reference_can(fakes)
    p = problem(logits_soft_cap=30.0)
    with pytest.warns(ReferenceFallbackWarning) as record:
        d = select(p, SM90, Workload(8, 8, 1, 8192, 1024))
    assert d.backend == "reference"
    text = str(record[0].message)
    for name in ("fa2", "cudnn", "xqa", "trtllm-gen"):
        assert f"  {name}: device: {name} lost" in text and f"  {name}: feature.soft_cap" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        select(p, SM90, Workload(8, 8, 1, 8192, 1024))
        select(p, SM90, Workload(500, 500, 1, 5000, 10))   # another workload: still once
        select(p, CPU)                                       # the CPU never warns
        select(p, SM90, requested="reference")               # nor an explicit request
        with use_backends("reference"):                      # nor an order of only the reference
            select(p, SM80)
    clear_cache()
    with pytest.warns(ReferenceFallbackWarning):
        select(p, SM90)


def test_reference_fallback_error_and_allow(fakes, tmp_path):
    _only_reference_can(fakes)
    p = problem(logits_soft_cap=30.0)
    path = load_config(_yaml(tmp_path, "reference_fallback: error\n")).files[-1]
    with pytest.raises(Unsupported, match="reference_fallback: error") as err:
        select(p, SM90)
    assert set(err.value.reasons) == {"fa2", "cudnn", "xqa", "trtllm-gen"} and path in str(err.value)
    assert "(refused: reference_fallback is error)" in decide(p, SM90).explain()
    load_config(_yaml(tmp_path, "reference_fallback: allow\n"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select(p, SM90).backend == "reference"


# --- caching -------------------------------------------------------------------------------------
def test_decisions_are_cached_per_bucket(fakes, monkeypatch, tmp_path):
    w1, w2 = Workload(33, 33, 1, 33 * 900, 900), Workload(64, 64, 1, 32000, 1000)
    d1 = select(problem(), SM90, w1)
    calls = fakes["fa2"].calls
    d2 = select(problem(), SM90, w2)
    assert fakes["fa2"].calls == calls and d2.workload == w2 and d1.workload == w1
    assert d2.candidates is d1.candidates
    select(problem(), SM90, Workload(65, 65, 1, 65 * 1000, 1000))      # another bucket
    assert fakes["fa2"].calls == calls + 1
    for change in (lambda: select(problem(), SM90, w1, requested="cudnn"),
                   lambda: monkeypatch.setenv("FLASHDISPATCH_BACKEND", "cudnn"),
                   lambda: load_config(_yaml(tmp_path, "pins: []\n"))):
        before = fakes["fa2"].calls
        change()
        select(problem(), SM90, w1)
        assert fakes["fa2"].calls == before + 1
    with use_backends(["fa2"]):
        before = fakes["fa2"].calls
        select(problem(), SM90, w1)
        assert fakes["fa2"].calls == before + 1
    clear_cache()
    before = fakes["fa2"].calls
    select(problem(), SM90, w1)
    assert fakes["fa2"].calls == before + 1


def test_cached_decision_is_not_stale_across_rules_on_workload(fakes, tmp_path):
    load_config(_yaml(tmp_path, "rules:\n  - {name: big, when: {min_batch: 128}, order: [cudnn]}\n"))
    assert select(problem(), SM90, Workload(64, 64, 1, 64, 1)).backend == "fa2"
    assert select(problem(), SM90, Workload(128, 128, 1, 128, 1)).backend == "cudnn"


# --- explain ------------------------------------------------------------------------------------
def test_explain_table(fakes):
    reject(fakes, "cudnn", features=NO_SOFT_CAP, unavailable=[Reason("package", "cudnn missing", "pip it")])
    reject(fakes, "fa3", ops=("prefill_paged",))
    p = problem(logits_soft_cap=30.0)
    d = select(p, SM90, Workload(64, 64, 1, 64 * 4096, 4096))
    text = d.explain()
    lines = text.splitlines()
    assert lines[0] == ("decode q=bf16 kv=bf16 heads=32/8 d=128 page=16 NHD +soft_cap  B=64 q<=1 kv<=4096"
                        "   device sm_90 NVIDIA H200")
    assert lines[1] == "order from rule 'hopper-decode' (configs/default.yaml)"
    assert lines[2] == "  fa2         OK      <- selected"
    assert lines[3] == "  cudnn       REJECT  package  cudnn missing (pip it)"
    assert lines[4] == "                      feature.soft_cap  logits_soft_cap > 0 is not supported"
    assert "  reference   OK      (last resort on a GPU)" in lines
    assert any(l.startswith("  fa3         REJECT  op  op=decode not in {prefill_paged}  (not in order)")
               for l in lines)
    assert "  cutlass     OK      (not in order)" in lines
    for name in registry.BACKEND_NAMES:
        assert sum(l.startswith(f"  {name} ") for l in lines) == 1, name
    assert format_decision(d) == text


def test_explain_reference_selected_and_failure(fakes):
    _only_reference_can(fakes)
    p = problem(logits_soft_cap=30.0)
    assert "  reference   OK      <- selected (last resort on a GPU)" in decide(p, SM90).explain()
    reject(fakes, "reference", features=NO_SOFT_CAP, devices=("cpu", "cuda"))
    clear_cache()
    text = explain_problem(p, SM90)
    assert text.splitlines()[-1].startswith("no backend selected: no backend in the order")
    assert "(last resort on a GPU)" in text
    with pytest.raises(Unsupported):
        select(p, SM90)


def test_explain_on_cpu_without_workload(fakes):
    text = explain_problem(describe_problem("merge", page_size=0), CPU)
    assert text.splitlines()[0] == "merge q=bf16 kv=bf16 heads=32/8 d=128 NHD   device cpu"
    assert "  reference   OK      <- selected" in text


def test_explain_requested(fakes):
    text = explain_problem(problem(), SM90, requested="xqa")
    assert "order from backend= argument" in text and "  xqa         OK      <- selected" in text
    assert "  fa2         OK      (not in order)" in text


# --- describing problems, devices and workloads ----------------------------------------------------
def test_describe_problem_defaults():
    p = describe_problem()
    assert p == Problem("decode", torch.bfloat16, torch.bfloat16, torch.bfloat16, 32, 8, 128, 128, page_size=16,
                        return_lse=False)  # like a wrapper's plan: lse only when a run asks (features="lse")
    assert describe_problem("prefill_ragged").page_size == 0
    m = describe_problem("mla")
    assert (m.num_qo_heads, m.num_kv_heads, m.head_dim_qk, m.head_dim_vo, m.head_dim_kpe, m.page_size) == \
        (128, 1, 576, 512, 64, 64)


def test_describe_problem_features():
    p = describe_problem("prefill_paged", heads="64/8", head_dim="192/128", q_dtype="fp16", layout="HND",
                         features="causal, fp8_kv,alibi,sinks,cuda_graph,soft_cap,sliding_window,spec_decode,lse",
                         logits_soft_cap=30.0, window_left=127, page_size=32)
    assert (p.num_qo_heads, p.num_kv_heads, p.head_dim_qk, p.head_dim_vo, p.page_size) == (64, 8, 192, 128, 32)
    assert p.q_dtype == torch.float16 and p.kv_dtype == torch.float8_e4m3fn and p.o_dtype == torch.float16
    assert p.kv_layout == "HND" and p.mask_mode == "causal" and p.pos_encoding_mode == "ALIBI"
    assert p.features() == {"causal", "fp8_kv", "alibi", "sinks", "cuda_graph", "soft_cap", "sliding_window",
                            "spec_decode", "lse"}
    q = describe_problem(features=["custom_mask", "rope", "q_len_per_req"], q_len_per_req=4, return_lse=False)
    assert q.mask_mode == "custom" and q.pos_encoding_mode == "ROPE_LLAMA" and q.q_len_per_req == 4
    assert not q.return_lse
    assert describe_problem(q_dtype="fp8_e4m3").o_dtype == torch.float16  # as plan() (FlashInfer) defaults it
    assert describe_problem("mla", q_dtype="fp8_e4m3").o_dtype == torch.bfloat16


@pytest.mark.parametrize("kwargs, message", [
    (dict(op="attention"), "op='attention'; valid: decode"),
    (dict(features="causal,flash"), "features: 'flash' is not a feature; valid: alibi"),
    (dict(features="sliding_window"), "needs its value: give window_left"),
    (dict(features="soft_cap"), "give logits_soft_cap"),
    (dict(features="q_len_per_req"), "give q_len_per_req"),
    (dict(features="causal,custom_mask"), "exclude each other"),
    (dict(features="rope,alibi"), "exclude each other"),
    (dict(features="fp8_kv", kv_dtype="bf16"), "needs an fp8 kv_dtype"),
    (dict(q_dtype="double"), "q_dtype='double' is not a dtype name; accepted: .*'bf16'"),
    (dict(heads="32/x"), "heads='32/x'"),
    (dict(head_dim=0), "head_dim=0"),
    (dict(layout="nhd"), "layout='nhd'; valid: NHD, HND"),
])
def test_describe_problem_errors(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        describe_problem(**kwargs)


@pytest.mark.parametrize("spec, cc", [("sm90", (9, 0)), ("sm_90a", (9, 0)), ("9.0", (9, 0)), ("100", (10, 0)),
                                      ("sm_100f", (10, 0)), ("8.9", (8, 9)), ("sm_120", (12, 0))])
def test_describe_device(spec, cc):
    d = describe_device(spec)
    assert d.type == "cuda" and d.cc == cc and d.describe() == f"device sm_{cc[0]}{cc[1]} (described)"


def test_describe_device_cpu_and_errors():
    assert describe_device("cpu") == CPU
    if not torch.cuda.is_available():
        assert describe_device() == CPU
    with pytest.raises(ValueError, match="expected cpu, cuda"):
        describe_device("h100")


def test_describe_workload():
    assert describe_workload() is EMPTY_WORKLOAD
    assert describe_workload(4, 100, 3) == Workload(4, 12, 3, 400, 100)


# --- backends listed ---------------------------------------------------------------------------------
def test_backends_table_with_fakes(fakes):
    fakes["cudnn"] = ImportError("no cudnn here")
    reject(fakes, "xqa", unavailable=[Reason("device", "no CUDA device"), Reason("not_implemented", "later")])
    lines = backends_table().splitlines()
    assert lines[0].split() == ["backend", "status", "version", "why", "not"]
    rows = {l.split()[0]: l for l in lines[1:] if not l.startswith(" ")}
    assert list(rows) == list(registry.BACKEND_NAMES)
    assert rows["fa2"].split()[1:] == ["available", "fake", "fa2", "1.0"]
    assert "unavailable" in rows["cudnn"]
    assert "import: flashdispatch.backends.cudnn: ImportError: no cudnn here" in rows["cudnn"]
    assert rows["xqa"].rstrip().endswith("device: no CUDA device")
    assert any(l.strip() == "not_implemented: later" for l in lines)


def test_backends_table_on_this_machine():
    lines = backends_table().splitlines()
    names = [l.split()[0] for l in lines[1:] if not l.startswith(" ")]
    assert names == list(registry.BACKEND_NAMES)


# --- the backends without kernels: honest caps, honest availability, never compute -----------
KERNELLESS = {"fa3": ({"prefill_paged", "prefill_ragged", "mla"}, (9, 0)),
              "xqa": ({"decode"}, (8, 0)),
              "trtllm-gen": ({"decode", "prefill_paged", "mla"}, (10, 0)),
              "cutlass": ({"mla"}, (10, 0))}


@pytest.mark.parametrize("name", list(KERNELLESS))
def test_kernelless_backends_are_unavailable_and_say_why(name):
    cls = registry.backend_class(name)
    ops, min_cc = KERNELLESS[name]
    assert cls.name == name
    assert {op for op in ALL_OPS if op in cls.caps_for(op).ops} == ops
    assert all(cls.caps_for(op).min_cc == min_cc for op in ops)
    codes = [r.code for r in cls.availability()]
    assert codes, f"{name} claims to be available"
    assert codes[-1] in ("not_implemented", "package")
    if "package" not in codes:
        assert "not_implemented" in codes
        if not torch.cuda.is_available():
            assert codes[0] == "device" and cls.availability()[0].detail == "no CUDA device"
    op = sorted(ops)[0]
    reasons = cls.supports(describe_problem(op, features="lse" if op != "decode" else ()), SM100)
    assert reasons and reasons[: len(codes)] == list(cls.availability())
    with pytest.raises(NotImplementedError):
        cls().plan(describe_problem(op), SM100, None)


def test_kernelless_caps_match_their_purpose():
    xqa = registry.backend_class("xqa").caps_for("decode")
    assert {"sinks", "fp8_kv", "spec_decode"} <= xqa.features and torch.float8_e4m3fn in xqa.kv_dtypes
    assert xqa.page_sizes == {16, 32, 64, 128}
    trt = registry.backend_class("trtllm-gen")
    assert trt.packages == ("tensorrt_llm",) and trt.caps_for("decode").max_cc == (10, 3)
    assert registry.backend_class("cutlass").packages == ("cutlass",)
    assert registry.backend_class("fa3").caps_for("mla").head_dims == {(512, 64)}
