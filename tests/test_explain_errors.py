"""Bad values given to explain(), select_backend(), Problem, Device, the CLI and the fa2 decode
environment variable: each is a TypeError/ValueError naming the argument (CLI: exit 2, one line)."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import flashdispatch as fi
from flashdispatch.backends.fa2.decode_config import CONFIG_ENV, _base_config, resolve_config
from flashdispatch.cli import main
from flashdispatch.dispatch.explain import describe_device, describe_problem, describe_workload
from flashdispatch.dispatch.problem import Device, Problem

NO_CUDA = not torch.cuda.is_available()
WS = torch.empty(1 << 20, dtype=torch.uint8)


def problem(**kw) -> Problem:
    base = dict(op="decode", q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, o_dtype=torch.bfloat16,
                num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, head_dim_vo=128, page_size=16)
    return Problem(**{**base, **kw})


# --- explain() and select_backend() arguments --------------------------------------------------
@pytest.mark.parametrize("obj", ["garbage", 123, torch.zeros(2), fi.BatchDecodeWithPagedKVCacheWrapper])
def test_explain_refuses_what_it_cannot_explain(obj):
    with pytest.raises(TypeError, match=r"explain\(obj=.*expected a wrapper after plan\(\), a Decision or a Problem"):
        fi.explain(obj)


def test_explain_refuses_arguments_it_would_ignore():
    with pytest.raises(TypeError, match=r"explain\(problem, \.\.\.\) takes no problem keywords, got op"):
        fi.explain(problem(), op="mla")
    decision = fi.select_backend(problem(), device="cpu")
    assert fi.explain(decision) == decision.explain()
    with pytest.raises(TypeError, match=r"explain\(Decision\) .* takes no op, device"):
        fi.explain(decision, op="mla", device="cpu")
    with pytest.raises(TypeError, match="unknown keyword.*colour.*a problem is described by op, heads"):
        fi.explain(colour="red")


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(heads=32.9), TypeError, "heads=32.9: expected an int"),
    (dict(heads=True), TypeError, "heads=True: expected an int"),
    (dict(heads=0), ValueError, "heads=0: num_qo_heads=0 must be a positive int"),
    (dict(heads="32/5"), ValueError, "heads='32/5': num_qo_heads=32 is not a multiple of num_kv_heads=5"),
    (dict(heads=(32, 8, 4)), ValueError, r"heads=\(32, 8, 4\): expected one or two numbers"),
    (dict(head_dim="128/0"), ValueError, "head_dim='128/0': head_dim_vo=0 must be a positive int"),
    (dict(page_size=-5), ValueError, "page_size=-5 must be a positive int"),
    (dict(page_size=16.5), ValueError, "page_size=16.5 must be a positive int"),
    (dict(page_size="16"), ValueError, "page_size='16' must be a positive int"),
    (dict(page_size=0), ValueError, "page_size=0 must be a positive int"),
    (dict(op="prefill_ragged", page_size=16), ValueError, "page_size=16: op prefill_ragged reads ragged KV"),
    (dict(window_left=-7), ValueError, r"window_left=-7 must be an int in \[-1, 2\^31 - 1\]"),
    (dict(window_left="5"), ValueError, "window_left='5' must be an int"),
    (dict(logits_soft_cap=float("nan")), ValueError, "logits_soft_cap=nan must be"),
    (dict(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap=inf must be"),
    (dict(q_len_per_req=0), ValueError, "q_len_per_req=0 must be a positive int"),
    (dict(return_lse="no"), TypeError, "return_lse='no' must be a bool"),
    (dict(features=5), TypeError, "features=5: expected a comma-separated str or a list"),
    (dict(features=[["causal"]]), ValueError, r"features: \['causal'\] is not a feature"),
    (dict(q_dtype="int8"), ValueError, "q_dtype='int8' is not a dtype name"),
    (dict(kv_dtype=torch.int8), ValueError, "kv_dtype=torch.int8 is not supported"),
    (dict(op="mla", heads="128/2"), ValueError, "MLA has one KV head"),
    (dict(op="mla", layout="HND"), ValueError, "layout='HND'; valid: NHD"),
    (dict(op=["decode"]), ValueError, r"op=\['decode'\]; valid: decode"),
])
def test_explain_refuses_bad_values(kwargs, error, message):
    with pytest.raises(error, match=message):
        fi.explain(device="cpu", **kwargs)


def _decode_plan(**kw):
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, "NHD", backend="reference")
    args = dict(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16, window_left=-1, logits_soft_cap=None)
    args.update(kw)
    w.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
           torch.tensor([1], dtype=torch.int32), args.pop("num_qo_heads"), args.pop("num_kv_heads"),
           args.pop("head_dim"), args.pop("page_size"), q_data_type=torch.float32, **args)


@pytest.mark.parametrize("plan_kw, explain_kw", [
    (dict(page_size=-5), dict(page_size=-5)), (dict(page_size=16.5), dict(page_size=16.5)),
    (dict(page_size=1), dict(page_size=1)), (dict(window_left=-7), dict(window_left=-7)),
    (dict(window_left=-1), dict(window_left=-1)), (dict(window_left=0), dict(window_left=0)),
    (dict(logits_soft_cap=float("nan")), dict(logits_soft_cap=float("nan"))),
    (dict(logits_soft_cap=1e31), dict(logits_soft_cap=1e31)), (dict(logits_soft_cap=30), dict(logits_soft_cap=30)),
    (dict(num_kv_heads=3), dict(heads="4/3")), (dict(num_qo_heads=4, num_kv_heads=4), dict(heads=4)),
    (dict(head_dim=0), dict(head_dim=0)),
])
def test_explain_accepts_what_plan_accepts(plan_kw, explain_kw):
    def outcome(f):
        try:
            f()
        except (TypeError, ValueError) as e:
            return type(e).__name__
        return "ok"
    explained = outcome(lambda: fi.explain(device="cpu", **{"heads": "4/2", "head_dim": 64, **explain_kw}))
    assert explained == outcome(lambda: _decode_plan(**plan_kw))


def test_mla_head_dims_and_heads():
    p = describe_problem("mla", heads=16, head_dim=512)
    assert (p.num_qo_heads, p.num_kv_heads, p.head_dim_vo, p.head_dim_kpe, p.head_dim_qk) == (16, 1, 512, 64, 576)
    p = describe_problem("mla", heads="16/1", head_dim=(256, 32))
    assert (p.num_qo_heads, p.num_kv_heads, p.head_dim_vo, p.head_dim_kpe) == (16, 1, 256, 32)


def test_select_backend_and_devices():
    with pytest.raises(TypeError, match="select_backend: problem='decode': expected a flashdispatch.Problem"):
        fi.select_backend("decode")
    with pytest.raises(TypeError, match="workload='x': expected a flashdispatch.Workload"):
        fi.explain(device="cpu", workload="x")
    assert fi.select_backend(problem(), device="sm90").device == describe_device("sm90")
    assert "device sm_90 (described)" in fi.explain(device="sm_90a").splitlines()[0]
    with pytest.raises(TypeError, match="device=5.5: expected cpu or cuda"):
        fi.select_backend(problem(), device=5.5)
    for bad in ("foo", "meta", "cuda:x"):
        with pytest.raises(ValueError, match=f"device='{bad}'"):
            fi.explain(device=bad)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a CUDA device")
def test_cuda_device_on_a_cpu_machine():
    for spec in ("cuda", "cuda:1", torch.device("cuda"), 0):
        with pytest.raises(ValueError, match="this machine has no CUDA device"):
            fi.select_backend(problem(), device=spec)


def test_describe_workload_values():
    with pytest.raises(ValueError, match=r"batch_size=-3 must be an int in \[0, 2\^31 - 1\]"):
        describe_workload(-3)
    with pytest.raises(ValueError, match="kv_len=4096 needs batch_size > 0"):
        describe_workload(0, 4096)


# --- Problem and Device fields ----------------------------------------------------------------------
@pytest.mark.parametrize("kw, error, message", [
    (dict(num_kv_heads=0), ValueError, r"Problem.num_kv_heads=0: expected an int >= 1"),
    (dict(num_qo_heads=32.0), TypeError, "Problem.num_qo_heads=32.0: expected an int"),
    (dict(mask_mode="casual"), ValueError, "Problem.mask_mode='casual': expected one of none, causal, custom"),
    (dict(pos_encoding_mode="rope"), ValueError, "Problem.pos_encoding_mode='rope': expected one of NONE"),
    (dict(op="attention"), ValueError, "Problem.op='attention': expected one of decode"),
    (dict(kv_layout=["NHD"]), ValueError, r"Problem.kv_layout=\['NHD'\]"),
    (dict(q_dtype="bf16"), TypeError, "Problem.q_dtype='bf16': expected a torch.dtype"),
    (dict(window_left=-2), ValueError, "Problem.window_left=-2: expected an int >= -1"),
    (dict(page_size=-1), ValueError, "Problem.page_size=-1"),
    (dict(q_len_per_req=0), ValueError, "Problem.q_len_per_req=0"),
    (dict(logits_soft_cap=float("nan")), ValueError, r"Problem.logits_soft_cap=nan: expected a float in \[0, 1e30\]"),
    (dict(logits_soft_cap=None), TypeError, "Problem.logits_soft_cap=None: expected a float"),
    (dict(return_lse="no"), TypeError, "Problem.return_lse='no': expected a bool"),
])
def test_problem_fields_are_checked(kw, error, message):
    with pytest.raises(error, match=message):
        problem(**kw)
    with pytest.raises(error, match=message):
        problem().with_(**kw)


def test_problem_takes_equal_values_of_other_types():
    p = problem(logits_soft_cap=30, return_lse=1, sinks=np.bool_(True), page_size=np.int64(16))
    assert type(p.logits_soft_cap) is float and p.return_lse is True and p.sinks is True and type(p.page_size) is int
    assert p == problem(logits_soft_cap=30.0, return_lse=True, sinks=True)


@pytest.mark.parametrize("args, message", [
    (("cuda", 0, (9,)), r"Device.cc=\(9,\): expected None or a compute capability \(major, minor\)"),
    (("cuda", 0, [9, 0]), r"Device.cc=\[9, 0\]"),
    (("cuda", -1), "Device.index=-1: expected an int >= 0"),
    (("",), "Device.type=''"),
])
def test_device_fields_are_checked(args, message):
    with pytest.raises((TypeError, ValueError), match=message):
        Device(*args)


# --- the CLI: exit 2 and one error line -----------------------------------------------------------
def _cli_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0] == err.splitlines()[-1], err
    return errors[0]


@pytest.mark.parametrize("argv, message", [
    (["--heads", "0"], "heads=0: num_qo_heads=0 must be a positive int"),
    (["--heads", "32", "8", "4"], "argument --heads: expected 1 or 2 values, got 3: 32 8 4"),
    (["--head-dim", "1", "2", "3"], "argument --head-dim: expected 1 or 2 values"),
    (["--q-dtype", "int8"], "q_dtype='int8' is not a dtype name"),
    (["--features", "nope"], "'nope' is not a feature"),
    (["--device", "foo"], "device='foo'"),
    (["--backend", "fa9"], "backend='fa9' is not a backend; valid: auto, reference"),
    (["--window-left", "-7"], "window_left=-7"),
    (["--page-size", "-5"], "page_size=-5"),
    (["--soft-cap", "nan"], "logits_soft_cap=nan"),
    (["--batch", "-1"], "batch_size=-1"),
])
def test_cli_explain_errors(capsys, argv, message):
    assert message in _cli_error(capsys, ["explain", *argv])


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a CUDA device")
def test_cli_cuda_on_a_cpu_machine(capsys):
    assert "device='cuda': this machine has no CUDA device" in _cli_error(capsys, ["explain", "--device", "cuda"])
    assert "device='cuda': this machine has no CUDA device" in _cli_error(capsys, ["demo", "--device", "cuda"])


@pytest.mark.parametrize("device, message", [("foo", "device='foo' is not a device"),
                                             ("meta", "expected cpu or cuda[:N], not a meta device")])
def test_cli_demo_device_errors(capsys, device, message):
    assert message in _cli_error(capsys, ["demo", "--device", device])


def test_cli_explain_mla_head_dim(capsys):
    assert main(["explain", "--op", "mla", "--head-dim", "512", "--device", "cpu"]) == 0
    assert "heads=128/1 d=ckv=512 kpe=64" in capsys.readouterr().out.splitlines()[0]


# --- FLASHDISPATCH_FA2_DECODE_CONFIG ---------------------------------------------------------------------
@pytest.mark.parametrize("value, message", [
    ("garbage", "not JSON"), ("5", "expected a JSON object .* got a number"), ("null", "got null"),
    ('"abc"', "got a string"), ("[1,2]", "got an array"),
    ('{"colour": 1}', r"unknown fa2 decode config keys \['colour'\]"),
    ('{"block_n": 3}', "block_n must be a power of two"),
])
def test_decode_config_env_errors_name_the_variable(monkeypatch, value, message):
    monkeypatch.setenv(CONFIG_ENV, value)
    _base_config.cache_clear()
    try:
        with pytest.raises(ValueError, match=f"^{re.escape(f'{CONFIG_ENV}={value!r}: ')}.*{message}"):
            resolve_config(problem(q_dtype=torch.float16, kv_dtype=torch.float16, o_dtype=torch.float16))
    finally:
        _base_config.cache_clear()


def test_decode_config_env_blank_is_unset(monkeypatch):
    p = problem(q_dtype=torch.float16, kv_dtype=torch.float16, o_dtype=torch.float16)
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    _base_config.cache_clear()
    default = resolve_config(p)
    monkeypatch.setenv(CONFIG_ENV, "  ")
    _base_config.cache_clear()
    assert resolve_config(p) == default
    _base_config.cache_clear()
