"""The YAML policy: the packaged defaults, merging a user file, matching, and every error."""
from __future__ import annotations

import textwrap
from importlib import resources

import pytest
import torch

from flashdispatch.dispatch import policy as policy_mod
from flashdispatch.dispatch.policy import (
    CONDITION_KEYS, PACKAGED_LABEL, active_policy, load_config, load_policy, reset_policy,
)
from flashdispatch.dispatch.problem import EMPTY_WORKLOAD, OPS, Device, Problem, Workload

SM80 = Device("cuda", 0, (8, 0), "A100")
SM90 = Device("cuda", 0, (9, 0), "H200")
SM100 = Device("cuda", 0, (10, 0), "B200")
CPU = Device("cpu")


def problem(op="decode", **kw) -> Problem:
    base = dict(op=op, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, o_dtype=torch.bfloat16,
                num_qo_heads=32, num_kv_heads=8, head_dim_qk=128, head_dim_vo=128, page_size=16)
    base.update(kw)
    return Problem(**base)


def workload(batch, kv_len=1024, qo_len=1) -> Workload:
    return Workload(batch, batch * qo_len, qo_len, batch * kv_len, kv_len)


@pytest.fixture(autouse=True)
def _clean_policy(monkeypatch):
    monkeypatch.delenv("FLASHDISPATCH_CONFIG", raising=False)
    reset_policy()
    yield
    reset_policy()


def write(tmp_path, text: str, name="user.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


# --- the packaged policy ----------------------------------------------------------------------
def test_packaged_defaults_cover_every_op():
    pol = load_policy()
    orders = {op: order for op, order, _ in pol.defaults}
    assert set(orders) == set(OPS)
    assert orders["decode"] == ("fa2", "cudnn", "xqa", "trtllm-gen", "reference")
    assert orders["prefill_paged"] == ("fa3", "cudnn", "fa2", "reference")
    assert orders["mla"] == ("fa3", "cutlass", "fa2", "reference")
    assert orders["merge"] == ("fa2", "reference")
    assert pol.reference_fallback == "warn" and pol.pins == ()
    assert pol.files == (PACKAGED_LABEL,)


@pytest.mark.parametrize("op, device, order, source", [
    ("decode", SM90, ("fa2", "cudnn", "xqa", "trtllm-gen", "reference"), "rule 'hopper-decode'"),
    ("prefill_paged", SM90, ("fa3", "cudnn", "fa2", "reference"), "rule 'hopper-prefill'"),
    ("prefill_ragged", SM90, ("fa3", "cudnn", "fa2", "reference"), "rule 'hopper-prefill'"),
    ("mla", SM90, ("fa3", "cutlass", "fa2", "reference"), "rule 'hopper-mla'"),
    ("merge", SM90, ("fa2", "reference"), "defaults"),
    ("decode", SM80, ("fa2", "cudnn", "xqa", "trtllm-gen", "reference"), "defaults"),
    ("mla", SM100, ("trtllm-gen", "cutlass", "fa3", "fa2", "reference"), "rule 'blackwell-mla'"),
    ("decode", CPU, ("reference",), "rule 'cpu'"),
    ("merge", CPU, ("reference",), "rule 'cpu'"),
])
def test_packaged_orders(op, device, order, source):
    got, got_source = load_policy().order_for(problem(op), device)
    assert got == order
    assert got_source == f"{source} ({PACKAGED_LABEL})"


@pytest.mark.parametrize("batch", [1, 16, 17, 256])
def test_hopper_decode_order_by_batch(batch):
    """fa2 leads or ties cudnn at every batch size in the session-10 H200 run (1 to 64 requests)."""
    got, source = load_policy().order_for(problem("decode"), SM90, workload(batch, 4096))
    assert got[:2] == ("fa2", "cudnn") and source == f"rule 'hopper-decode' ({PACKAGED_LABEL})"


def test_default_yaml_documents_every_condition_and_marks_numbers_to_measure():
    text = resources.files("flashdispatch").joinpath("configs/default.yaml").read_text()
    for key in CONDITION_KEYS + ("reference_fallback", "pins", "rules", "defaults"):
        assert key in text, key
    assert "to be measured" in text


# --- merging a user file -------------------------------------------------------------------------
def test_user_file_merges_over_packaged(tmp_path):
    path = write(tmp_path, """
        defaults:
          merge: [reference, fa2]
        rules:
          - name: my-decode
            when: {op: decode, cc_min: [9, 0]}
            order: [cudnn, fa2]
        pins:
          - name: ragged-on-fa2
            when: {op: prefill_ragged}
            backend: fa2
        reference_fallback: error
    """)
    pol = load_policy(path)
    assert pol.files == (PACKAGED_LABEL, path)
    assert pol.order_for(problem("decode"), SM90) == (("cudnn", "fa2"), f"rule 'my-decode' ({path})")
    # the packaged rules still follow the user's
    assert pol.order_for(problem("mla"), SM90)[1] == f"rule 'hopper-mla' ({PACKAGED_LABEL})"
    assert pol.order_for(problem("merge"), SM80) == (("reference", "fa2"), f"defaults ({path})")
    assert pol.order_for(problem("decode"), SM80)[1] == f"defaults ({PACKAGED_LABEL})"
    assert pol.order_for(problem("prefill_ragged", page_size=0), SM90) == (("fa2",), f"pin 'ragged-on-fa2' ({path})")
    assert pol.reference_fallback == "error" and pol.fallback_source == path


def test_pin_without_name_is_numbered_and_beats_rules(tmp_path):
    path = write(tmp_path, "pins:\n  - {when: {device_type: cpu}, backend: fa2}\n")
    assert load_policy(path).order_for(problem(), CPU) == (("fa2",), f"pin '#0' ({path})")


def test_empty_user_file_is_the_packaged_policy(tmp_path):
    pol = load_policy(write(tmp_path, "# nothing\n"))
    assert pol.order_for(problem(), SM90)[0] == load_policy().order_for(problem(), SM90)[0]


def test_env_names_the_user_file(tmp_path, monkeypatch):
    path = write(tmp_path, "reference_fallback: allow\n")
    assert active_policy().reference_fallback == "warn"
    monkeypatch.setenv("FLASHDISPATCH_CONFIG", path)
    pol = active_policy()
    assert pol.reference_fallback == "allow"
    assert active_policy() is pol  # read once


def test_load_config_installs_and_none_goes_back(tmp_path, monkeypatch):
    path = write(tmp_path, "reference_fallback: error\n")
    installed = load_config(path)
    assert active_policy() is installed and installed.reference_fallback == "error"
    monkeypatch.setenv("FLASHDISPATCH_CONFIG", write(tmp_path, "reference_fallback: allow\n", "env.yaml"))
    assert active_policy() is installed  # load_config() wins over the environment
    assert load_config(None).reference_fallback == "allow"


# --- matching -----------------------------------------------------------------------------------
def _one_rule(tmp_path, when: str):
    path = write(tmp_path, f"rules:\n  - name: r\n    when: {when}\n    order: [cudnn]\n")
    pol = load_policy(path)
    return lambda p=problem(), d=SM90, w=EMPTY_WORKLOAD: pol.order_for(p, d, w)[0] == ("cudnn",)


def test_match_problem_fields(tmp_path):
    m = _one_rule(tmp_path, "{q_dtype: [fp16, bf16], kv_dtype: fp8_e4m3, head_dim_qk: [64, 128], "
                            "page_size: 16, kv_layout: HND}")
    good = problem(kv_dtype=torch.float8_e4m3fn, kv_layout="HND")
    assert m(good)
    assert not m(good.with_(q_dtype=torch.float32))
    assert not m(good.with_(kv_dtype=torch.bfloat16))
    assert not m(good.with_(head_dim_qk=256, head_dim_vo=256))
    assert not m(good.with_(page_size=32))
    assert not m(good.with_(kv_layout="NHD"))
    # torch's dtype names and the argument aliases work as well as the short names
    m = _one_rule(tmp_path, "{q_dtype: [float16, bfloat16], kv_dtype: float8_e4m3fn}")
    assert m(good) and not m(good.with_(q_dtype=torch.float32))


def test_match_device_fields(tmp_path):
    m = _one_rule(tmp_path, "{device_type: cuda, cc_min: [8, 9], cc_max: [9, 0]}")
    assert m(d=SM90) and m(d=Device("cuda", 0, (8, 9)))
    assert not m(d=SM80) and not m(d=SM100) and not m(d=CPU)


def test_match_features(tmp_path):
    any_ = _one_rule(tmp_path, "{features_any: [soft_cap, sinks]}")
    all_ = _one_rule(tmp_path, "{features_all: [causal, soft_cap]}")
    capped = problem(logits_soft_cap=30.0)
    assert any_(capped) and any_(problem(sinks=True)) and not any_(problem())
    assert not all_(capped) and all_(capped.with_(mask_mode="causal"))


def test_match_workload_uses_power_of_two_buckets_and_never_an_unknown_workload(tmp_path):
    m = _one_rule(tmp_path, "{min_batch: 64, max_batch: 128, min_kv_len: 1024, max_qo_len: 1}")
    assert m(w=workload(64)) and m(w=workload(128))
    assert m(w=workload(33))          # bucket 64
    assert not m(w=workload(32)) and not m(w=workload(129))
    assert not m(w=workload(64, kv_len=512)) and not m(w=workload(64, qo_len=2))
    assert not m(w=EMPTY_WORKLOAD)
    only_max = _one_rule(tmp_path, "{max_kv_len: 4096}")
    assert only_max(w=workload(1, kv_len=4096)) and not only_max(w=EMPTY_WORKLOAD)


def test_match_op_list_and_empty_when(tmp_path):
    m = _one_rule(tmp_path, "{op: [decode, mla]}")
    assert m(problem("decode")) and m(problem("mla")) and not m(problem("merge"))
    assert _one_rule(tmp_path, "{}")(problem("merge"), CPU)


# --- errors ----------------------------------------------------------------------------------------
BAD = [
    ("colors: red\n", "colors", "valid: defaults, rules, pins, reference_fallback"),
    ("defaults:\n  attention: [fa2]\n", "defaults.attention", "valid: decode, prefill_paged"),
    ("defaults:\n  decode: [fa9]\n", "defaults.decode", "'fa9' is not a backend; valid: reference, fa2"),
    ("defaults:\n  decode: fa2\n", "defaults.decode", "expected a non-empty list of backends"),
    ("defaults:\n  decode: []\n", "defaults.decode", "expected a non-empty list of backends"),
    ("defaults:\n  decode: [fa2, fa2]\n", "defaults.decode", "listed twice"),
    ("defaults: [fa2]\n", "defaults", "expected a mapping with keys from decode"),
    ("rules: {name: x}\n", "rules", "expected a list of mappings with keys name, when, order"),
    ("rules:\n  - {name: x, order: [fa2], priority: 1}\n", "rules[0].priority", "valid: name, when, order"),
    ("rules:\n  - {order: [fa2]}\n", "rules[0].name", "missing"),
    ("rules:\n  - {name: x}\n", "rules[0].order", "missing"),
    ("rules:\n  - {name: 3, order: [fa2]}\n", "rules[0].name", "expected a non-empty string"),
    ("rules:\n  - {name: x, order: [fa2]}\n  - {name: x, order: [fa2]}\n", "rules[1].name", "used twice"),
    ("rules:\n  - {name: x, order: [flash]}\n", "rules[0].order", "'flash' is not a backend"),
    ("rules:\n  - {name: x, when: {gpu: h100}, order: [fa2]}\n", "rules[0].when.gpu", "valid: device_type, cc_min"),
    ("rules:\n  - {name: x, when: [op], order: [fa2]}\n", "rules[0].when", "expected a mapping"),
    ("rules:\n  - {name: x, when: {cc_min: '9.0'}, order: [fa2]}\n", "rules[0].when.cc_min", "[major, minor]"),
    ("rules:\n  - {name: x, when: {cc_max: [9]}, order: [fa2]}\n", "rules[0].when.cc_max", "[major, minor]"),
    ("rules:\n  - {name: x, when: {op: attention}, order: [fa2]}\n", "rules[0].when.op", "decode, prefill_paged"),
    ("rules:\n  - {name: x, when: {q_dtype: float64}, order: [fa2]}\n", "rules[0].when.q_dtype", "fp16, bf16"),
    ("rules:\n  - {name: x, when: {device_type: gpu}, order: [fa2]}\n", "rules[0].when.device_type", "cpu, cuda"),
    ("rules:\n  - {name: x, when: {kv_layout: nhd}, order: [fa2]}\n", "rules[0].when.kv_layout", "NHD, HND"),
    ("rules:\n  - {name: x, when: {features_any: [flash]}, order: [fa2]}\n", "rules[0].when.features_any", "causal"),
    ("rules:\n  - {name: x, when: {min_batch: many}, order: [fa2]}\n", "rules[0].when.min_batch", "non-negative"),
    ("rules:\n  - {name: x, when: {max_kv_len: true}, order: [fa2]}\n", "rules[0].when.max_kv_len", "non-negative"),
    ("rules:\n  - {name: x, when: {head_dim_qk: [128, x]}, order: [fa2]}\n", "rules[0].when.head_dim_qk", "integer"),
    ("pins:\n  - {when: {op: decode}}\n", "pins[0].backend", "missing"),
    ("pins:\n  - {when: {op: decode}, backend: fast}\n", "pins[0].backend", "'fast' is not a backend"),
    ("pins:\n  - {backend: fa2, order: [fa2]}\n", "pins[0].order", "valid: name, when, backend"),
    ("pins: fa2\n", "pins", "expected a list"),
    ("reference_fallback: never\n", "reference_fallback", "valid: warn, error, allow"),
    ("- just\n- a list\n", "", "expected a mapping with keys from defaults"),
    ("rules: [\n", "", "not valid YAML"),
]


@pytest.mark.parametrize("text, key, message", BAD, ids=[b[1] or b[2] for b in BAD])
def test_bad_files_name_file_key_and_valid_values(tmp_path, text, key, message):
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as err:
        load_policy(path)
    text = str(err.value)
    assert text.startswith(f"{path}: "), text
    assert f": {key}: " in text if key else True, text
    assert message in text, text


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read policy file"):
        load_policy(tmp_path / "absent.yaml")


def test_bad_file_from_env_fails_at_use(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHDISPATCH_CONFIG", write(tmp_path, "reference_fallback: sometimes\n"))
    with pytest.raises(ValueError, match="reference_fallback"):
        active_policy()


@pytest.mark.parametrize("text, key, line", [
    ("rules: []\nrules:\n  - {name: x, order: [fa2]}\n", "rules", 2),
    ("rules:\n  - name: x\n    order: [fa2]\n    name: y\n", "name", 4),
    ("defaults:\n  decode: [fa2]\n  decode: [cudnn]\n", "decode", 3),
    ("rules:\n  - {name: x, when: {op: decode, op: mla}, order: [fa2]}\n", "op", 2),
])
def test_duplicate_keys_are_refused(tmp_path, text, key, line):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=f"^{path}: line {line}: key '{key}' appears twice"):
        load_policy(path)


def test_yaml_merge_keys_may_override(tmp_path):
    path = write(tmp_path, """\
        rules:
          - &base {name: a, when: {op: decode}, order: [fa2]}
          - <<: *base
            name: b
        """)
    assert [(r.name, r.order) for r in load_policy(path).rules[:2]] == [("a", ("fa2",)), ("b", ("fa2",))]


def test_non_utf8_file_is_named(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("reference_fallback: warn  # caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=f"^{path}: not UTF-8 text"):
        load_policy(path)


def test_bad_paths(tmp_path):
    with pytest.raises(TypeError, match=r"path=3: expected a str or os.PathLike naming a policy file \(or None\)"):
        load_config(3)
    with pytest.raises(ValueError, match=r"path='a\\x00b': expected a policy file's path"):
        load_config("a\0b")
    with pytest.raises(ValueError, match="path='': expected a policy file's path"):
        load_policy("")
    path = write(tmp_path, "", "p.yaml")
    assert load_policy(path.encode()).files[-1] == path  # a bytes path names the file as a str


def test_only_safe_yaml_is_read(tmp_path):
    path = write(tmp_path, "reference_fallback: !!python/object/apply:os.getcwd []\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_policy(path)


def test_packaged_file_without_every_op_is_an_error(monkeypatch):
    monkeypatch.setattr(policy_mod, "_packaged_text", lambda: "defaults:\n  decode: [fa2]\n")
    with pytest.raises(ValueError, match="no order for op prefill_paged, prefill_ragged, mla, merge"):
        load_policy()


def test_policy_identity_is_its_hash():
    a, b = load_policy(), load_policy()
    assert a != b and hash(a) != hash(b) and a == a
