"""Randomized differential fuzzer: paged batch decode, backend="fa2" against backend="reference".

Each seed is a session: an fa2 and a reference `BatchDecodeWithPagedKVCacheWrapper` (random layout, heads,
head_dim, dtypes, CUDA-graph mode, workspace, FLASHDISPATCH_FA2_DECODE_CONFIG knobs), 2-5 rounds of plan()
(lengths with empty requests, page size, window, soft cap, ALiBi/RoPE, sm_scale, fixed_split_size, block_tables,
shared/offset tables, host/device indices, NaN in unused cache slots), each with 1-3 run() cases (q_len_per_req,
lse, out=/lse=, fp8 scales, 5-D/tuple/strided caches). Some eager sessions grow the cache round by round, as an
engine does (later indices read the new pages; on a GPU plan() mostly defers its page check). Checked: out and
base-2 lse within tolerance, empty rows 0 and -inf, no NaN, inputs unchanged. Graph sessions capture each
variant's first run() in a torch.cuda.CUDAGraph and replay it in later cases, after re-plans (CPU: the captured
plan object runs on the new tables, as tests/test_replan.py does). Only the fa2 refusals the spec asks for
(Unsupported, documented ValueErrors) are counted; other errors fail, a page check refusing indices within their
cache too. CPU: Triton interpreter, --scale small, a forked child per session with a timeout:
    TRITON_INTERPRET=1 .venv/bin/python scripts/fuzz_decode.py --minutes 10 --start 0
GPU: --scale large (batch <= 300, KV <= 8192, heads 32/8 64/8 32/32 16/2, d64-256, pages 1-128: split-KV, wave
tiles, packing, the line kernel, fused merge), in-process; a CUDA error exits 3, resume at the summary's next_seed:
    s=0; while :; do python scripts/fuzz_decode.py --device cuda --minutes 8 --start $s | tee log
      [ ${PIPESTATUS[0]} = 3 ] || break
      s=$(tail -1 log | python3 -c 'import json,sys; print(json.load(sys.stdin)["next_seed"])'); done
--config JSON sets DecodeConfig knobs under every session's own (e.g. the Gluon split, off by default).
Replay a seed verbosely (same --device/--scale/--dtypes: failure records hold the command), print specs:
    .venv/bin/python scripts/fuzz_decode.py --replay 1234
    .venv/bin/python scripts/fuzz_decode.py --scale large --dry-run 20
Failures: JSONL at --out; the last line printed is a JSON summary. Exit 0, 1 (failures), 3 (CUDA error).
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import re
import sys
import time

import fuzz_common as fc

fc.use_interpreter(fc.argv_device())  # before Triton (flashdispatch) is imported

import torch  # noqa: E402

import flashdispatch as fd  # noqa: E402
from flashdispatch import checks  # noqa: E402
from flashdispatch.backends.base import AttentionInputs  # noqa: E402

DT = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32, "e4m3": torch.float8_e4m3fn,
      "e5m2": torch.float8_e5m2}
TOL = {"f16": 1e-2, "bf16": 2e-2, "e4m3": 2e-2, "e5m2": 3e-2}  # atol = rtol by KV dtype; fp8 with bf16 q: +1e-2
DTYPE_WEIGHT = {"f16": 6, "bf16": 6, "e4m3": 3, "e5m2": 1}
# documented refusals, each only where the spec asks for it (else a failure): a small workspace, a graph grid
WORKSPACE_REFUSAL = re.compile(r"float_workspace_buffer too small|bytes of int workspace")
GRAPH_REFUSAL = re.compile(r"use_cuda_graph: a request needs")
BOTH_RAISE_OK = re.compile(r"use_cuda_graph=True fixes batch_size")  # a graph session's round of another batch
CACHE_BYTES = 1 << 30  # --scale large: K+V bytes of a round's cache
SESSION_TIMEOUT = 300  # s, CPU
CFG_ENV = "FLASHDISPATCH_FA2_DECODE_CONFIG"
KNOBS = {  # decode_config.DecodeConfig overrides
    "block_n": [16, 32, 64, 128], "max_block_m": [8, 16, 32, 64], "ctas_per_sm": [1, 1, 2, 4],
    "min_chunk_tokens": [8, 16, 32, 64, 256], "max_splits": [2, 3, 4, 64], "k_rows": [True, False],
    "split_block_n": [None, 16, 32, 64], "heads_fastest": [True, False], "page_prefetch": [True, False],
    "fused_merge_max_chunks": [0, 1, 2, 16], "direct_table": [True, False], "swap_ab": [True, False],
    "pack_items": [1, 2, 3, 4], "pack_fill": [0.3, 0.65, 0.95], "wave_pack_line": [True, False],
    "few_pack_line": [True, False], "graph_few_line": [True, False], "split_ctas_per_sm": [0, 2, 8],
    "wave_split_ctas": [0, 8, 24], "line_segment_tokens": [0, 16, 64], "wave_pack_spread": [0.0, 1.5, 4.0],
    "wave_pack_max_waves": [0.0, 4.0], "wave_pack_below": [0.0, 0.96], "wave_pack_tokens": [0, 64, 512],
    "wave_pack_below_tokens": [0, 128], "shared_kv_rows": [True, False], "line_waves": [1, 2],
    "fp8_dot_dtype": ["q", "fp16"],
    "num_stages": [1, 2, 3], "num_warps": [1, 2, 4], "lone_wave_split_tokens": [0, 64],
    "split_chunk_tokens": [0, 48], "wave_slots": [0, 2, 4], "line_page_prefetch": [True, False],
    "line_align_fill": [0.5, 0.9], "fused_merge_values": [256, 4096],
    "wave_tiles": [[], [[32, 2, 8, 1.0], [64, 3, 4, 0.9]], [[16, 2, 4, 1.0]]],
    "gluon_fp8_stages": [-1, 0, 2, 4], "gluon_fp8_split_tokens": [0, 64, 256, 256]}


def _scalars(R: random.Random, large: bool, page: int | None = None) -> dict:
    """plan()'s scalar arguments for a round."""
    s = {"page_size": page or (R.choices([1, 16, 32, 64, 128], [2, 5, 1, 2, 1]) if large
                               else R.choices([1, 16, 64, 8, 32], [3, 4, 3, 1, 1]))[0], "window_left": -1}
    if R.random() > (0.85 if large else 0.6):
        s["window_left"] = R.choice([0, R.randint(1, 128), R.randint(128, 4096)] if large
                                    else [0, 1, R.randint(0, 40), R.randint(0, 300)])
    s["logits_soft_cap"] = None if R.random() < (0.9 if large else 0.7) else R.choice([30.0, round(R.uniform(1, 50))])
    s["pos_encoding_mode"] = R.choices(["NONE", "ALIBI", "ROPE_LLAMA"], [8, 1, 1] if large else [2, 1, 1])[0]
    s["rope_theta"] = None if R.random() < 0.5 else R.choice([1e4, 5e5, 100.0])
    s["rope_scale"] = None if R.random() < 0.7 else R.choice([1.0, 2.0, 4.0])
    s["sm_scale"] = None if R.random() < 0.7 else round(R.uniform(0.02, 0.5), 4)
    s["fixed_split_size"] = None  # chunks of >= 16 tokens: 1-token chunks take minutes interpreted
    if R.random() < (0.15 if large else 0.4):
        s["fixed_split_size"] = max(1, (R.randint(64, 2048) if large else R.randint(16, 64)) // s["page_size"])
    s["disable_split_kv"] = R.random() < (0.1 if large else 0.2)
    return s


def _lens(R: random.Random, large: bool, batch: int, page: int, budget: int) -> tuple[str, list[int]]:
    """(pattern, KV lengths). Small: 0..300 (empty, within a page, full pages). Large: equal, mixed
    (1 .. 2 x mean) or a long tail, some empty, scaled down to ``budget`` tokens."""
    if not large:
        mx = R.choice([300, 300, 300, 100, 20])
        return "small", [R.choice([0, R.randint(1, page + 1), min(mx, page * R.randint(1, max(1, mx // page)))])
                         if R.random() < 0.35 else R.randint(1, mx) for _ in range(batch)]
    pattern, mean = R.choice(["equal", "equal", "mixed", "mixed", "tail"]), int(2 ** R.uniform(5, 13))
    lens = ([mean] * batch if pattern == "equal" else [R.randint(1, 2 * mean) for _ in range(batch)]
            if pattern == "mixed" else [R.randint(1, 256) if R.random() < 0.9 else R.randint(mean, 8192)
                                        for _ in range(batch)])
    if R.random() < 0.3:
        lens = [0 if R.random() < 0.1 else n for n in lens]
    f = min(1.0, max(batch, budget - batch * page) / max(1, sum(lens)))  # (the last pages' padding counts)
    return pattern, [min(8192, max(1, int(n * f))) if n else 0 for n in lens]


def _scale_args(R: random.Random, fp8: bool) -> dict | None:
    """run()'s fp8 scales (mostly with fp8 KV), or None."""
    on = fp8 and R.random() < 0.7 or R.random() < 0.05
    return {"k_scale": round(R.uniform(0.3, 2.0), 3), "v_scale": round(R.uniform(0.3, 2.0), 3),
            "q_scale": round(R.uniform(0.5, 1.5), 3) if R.random() < 0.3 else None,
            "as_tensor": R.random() < 0.3} if on else None


def _config_arg(text: str) -> dict:
    """--config: a JSON object of DecodeConfig overrides."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of DecodeConfig fields, got {text!r}")
    return value


def gen_session(seed: int, scale: str, dtypes: list[str], base: dict | None = None) -> dict:
    """The session's spec (pure JSON) from its seed; ``base``: config knobs (--config) under the
    session's own."""
    R, large = random.Random(seed), scale == "large"
    s = {"seed": seed, "scale": scale, "layout": R.choice(["NHD", "HND"]), "graph": R.random() < 0.25}
    kv = s["kv_dtype"] = R.choices(dtypes, [DTYPE_WEIGHT[d] for d in dtypes])[0]
    fp8 = kv in ("e4m3", "e5m2")
    s["q_dtype"] = kv if not fp8 else ("bf16" if "bf16" in dtypes and R.random() < 0.5 else "f16")
    if large:
        hq, hk = R.choices([(32, 8), (64, 8), (32, 32), (16, 2), (28, 4), (8, 1)], [5, 2, 3, 2, 1, 1])[0]
        s["head_dim"] = R.choices([64, 128, 256], [1, 3, 1])[0]
    else:
        hk = R.choice([1, 2, 4]) if R.random() > 0.03 else 3
        hq, s["head_dim"] = hk * R.choice([1, 2, 4, 8]), R.choices([64, 128, 32], [80, 17, 3])[0]
    s["num_qo_heads"], s["num_kv_heads"] = hq, hk
    s["o_dtype"] = "f32" if R.random() < 0.12 else None
    s["workspace"] = (128 << 20 if large else 4 << 20) if R.random() < 0.95 else 16 << 10
    s["cfg_env"] = ({k: R.choice(KNOBS[k]) for k in sorted(R.sample(sorted(KNOBS), R.randint(1, 4)))}
                    if R.random() < (0.25 if large else 0.4) else None)
    s["q_mag"] = 1.0 if R.random() < 0.85 else R.choice([3.0, 0.1])
    budget = CACHE_BYTES // (hk * s["head_dim"] * 2 * DT[kv].itemsize)
    new_batch = lambda: R.randint(*R.choices([(1, 8), (9, 63), (64, 256), (257, 300)], [35, 30, 30, 5])[0]  # noqa: E731
                                  if large else (1, 5))
    batch, sc = new_batch(), _scalars(R, large)
    if s["graph"] and R.random() < 0.7:
        sc["fixed_split_size"] = None  # a graph's grid mostly refuses it (and its scalars stay)
    storages = ["5d", "tuple", "5d_strided", "5d_kvfirst", "tuple_strided"]
    graph_storage, graph_scales = R.choices(storages, [5, 4, 1, 1, 1])[0], _scale_args(R, fp8)
    s["rounds"] = []
    for ri in range(R.randint(2, 5) if large else R.randint(2, 4)):
        if ri and not s["graph"] and R.random() < (0.1 if large else 0.15):
            sc = _scalars(R, large, page=sc["page_size"])  # one page size: one cache for all rounds
        if ri and not s["graph"] and R.random() < 0.15:
            batch = new_batch()
        pattern, lens = _lens(R, large, batch, sc["page_size"], budget)
        rd = {"scalars": dict(sc), "kv_lens": lens, "pattern": pattern, "spare_pages": R.randint(0, 8),
              "shared_pages": R.random() < 0.1, "block_tables": R.random() < 0.15,
              "indices_offset": R.randint(1, 7) if R.random() < 0.15 else 0, "poison": R.random() < 0.5,
              "storage": graph_storage if s["graph"] else R.choices(storages, [5, 4, 1, 1, 1])[0],
              "index_device": R.choice(["host", "device", "mixed"]), "runs": []}
        for _ in range(R.randint(1, 3)):
            q_len = (1 if R.random() < 0.85 else R.choice([2, 4])) if large else R.choice([1, 1, 1, 2, 3])
            rd["runs"].append({"q_len": q_len, "return_lse": R.random() < 0.6, "prealloc_out": R.random() < 0.25,
                               "prealloc_lse": R.random() < 0.25, "q_strided": not s["graph"] and R.random() < 0.1,
                               "scales": graph_scales if s["graph"] else _scale_args(R, fp8)})
        s["rounds"].append(rd)
    if not s["graph"] and R.random() < 0.4:  # an engine growing its cache round by round (`Session._rounds`;
        for ri, rd in enumerate(s["rounds"]):  # drawn last, the other seeds' specs are as they were without it)
            if ri:
                rd["grow_pages"] = R.randint(1, 16)  # at least this many pages more than the last round's cache
            if R.random() < 0.7:  # host lengths, device indices: on a GPU plan() defers its page check
                rd["index_device"], rd["block_tables"] = "mixed", False
    if base:
        s["cfg_env"] = {**base, **(s["cfg_env"] or {})}
    return s


def features(spec: dict, rd: dict, run: dict, cuda: bool) -> list[str]:
    """Feature labels of a case (counted in the summary)."""
    sc, b = rd["scalars"], len(rd["kv_lens"])
    f = [f"layout={spec['layout']}", f"d={spec['head_dim']}", f"kv={spec['kv_dtype']}", f"q={spec['q_dtype']}",
         f"page={sc['page_size']}", f"heads={spec['num_qo_heads']}/{spec['num_kv_heads']}",
         f"pos={sc['pos_encoding_mode']}", f"q_len={run['q_len']}", f"storage={rd['storage']}",
         f"lens={rd['pattern']}", "batch=" + ("1" if b == 1 else "2-8" if b <= 8 else "9-63" if b < 64 else "64+")]
    flags = {"cuda_graph": spec["graph"], "o=f32": spec["o_dtype"], "cfg_env": spec["cfg_env"],
             "small_workspace": spec["workspace"] < (1 << 20), "window": sc["window_left"] >= 0,
             "soft_cap": sc["logits_soft_cap"], "sm_scale": sc["sm_scale"] is not None,
             "rope_params": sc["rope_theta"] or sc["rope_scale"], "fixed_split_size": sc["fixed_split_size"],
             "disable_split_kv": sc["disable_split_kv"], "empty_request": 0 in rd["kv_lens"],
             "shared_pages": rd["shared_pages"], "block_tables": rd["block_tables"],
             "indices_offset": rd["indices_offset"], "nan_poison": rd["poison"], "return_lse": run["return_lse"],
             "prealloc_out": run["prealloc_out"], "prealloc_lse": run["prealloc_lse"] and run["return_lse"],
             "q_strided": run["q_strided"], "scales": run["scales"], "q_mag": spec["q_mag"] != 1.0,
             "cache_growth": "grow_pages" in rd,
             f"index={rd['index_device']}": cuda}
    return f + [k for k, v in flags.items() if v]


def build_table(rd: dict, gen: torch.Generator, num_pages: int, fresh: int = 0):
    """(indptr, indices, last_page_len, num_pages, pages per request) on the host, and the [pages,
    page] mask of the slots some request reads (None without NaN poisoning), for a cache of
    ``num_pages`` pages; ``fresh``: some used index is at least that (a page new to a grown cache)."""
    page, lens = rd["scalars"]["page_size"], rd["kv_lens"]
    counts = [-(-n // page) for n in lens]
    used = sum(counts)
    if rd["shared_pages"] and num_pages:
        indices = torch.randint(0, num_pages, (used,), generator=gen).to(torch.int32)
    else:
        indices = torch.randperm(num_pages, generator=gen)[:used].to(torch.int32)
    if fresh and used and int(indices.max()) < fresh:
        indices[-1] = num_pages - 1  # (a page no other index has)
    indptr = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    last = torch.tensor([n - (c - 1) * page if c else 0 for n, c in zip(lens, counts)], dtype=torch.int32)
    mask = None
    if rd["poison"]:
        fill, nonempty = torch.full((used,), page, dtype=torch.int64), [b for b, c in enumerate(counts) if c]
        if nonempty:
            fill[indptr[1:][nonempty].long() - 1] = last[nonempty].long()
        acc = torch.zeros(num_pages, page, dtype=torch.int32)
        acc.index_put_((indices.long(),), (torch.arange(page)[None, :] < fill[:, None]).int(), accumulate=True)
        mask = acc > 0
    return indptr, indices, last, num_pages, counts, mask


def kv_views(cache):
    """(k, v) of a 5-D [pages, 2, ...] cache or a (k, v) tuple."""
    return cache if isinstance(cache, tuple) else (cache[:, 0], cache[:, 1])


def make_cache(spec: dict, rd: dict, num_pages: int, dev: torch.device, gen: torch.Generator, used=None):
    """The round's KV cache in its storage, NaN in every slot outside ``used`` (if given)."""
    page, hk, d, kvd = rd["scalars"]["page_size"], spec["num_kv_heads"], spec["head_dim"], DT[spec["kv_dtype"]]
    gd = kvd if kvd.itemsize == 2 else torch.float16
    k, v = (torch.randn(num_pages, page, hk, d, generator=gen, device=dev, dtype=gd) for _ in range(2))
    if used is not None:
        hole = ~used.to(dev)[:, :, None, None]
        k, v = k.masked_fill_(hole, float("nan")), v.masked_fill_(hole, float("nan"))
    k, v = k.to(kvd), v.to(kvd)
    if spec["layout"] == "HND":
        k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    storage = rd["storage"]
    if storage in ("5d", "tuple"):
        return torch.stack([k, v], 1) if storage == "5d" else (k, v)
    if storage == "5d_strided":  # every other page of a larger 5-D cache
        big = torch.empty(2 * num_pages + 1, 2, *k.shape[1:], dtype=kvd, device=dev)
        big.view(torch.uint8).fill_(0x7E)
        big[1::2][:num_pages, 0], big[1::2][:num_pages, 1] = k, v
        return big[1::2][:num_pages]
    if storage == "5d_kvfirst":  # [2, pages, ...] seen as [pages, 2, ...]
        return torch.stack([k, v], 0).transpose(0, 1)
    kb, vb = (torch.zeros(*k.shape[:-1], d + 16, dtype=kvd, device=dev) for _ in range(2))  # tuple_strided: wide rows
    kb[..., 8:8 + d], vb[..., 16:] = k, v
    return (kb[..., 8:8 + d], vb[..., 16:])


def compare(tag: str, out, lse, ref_out, ref_lse, empty, tol: float) -> list[str]:
    """Problems of (out, lse) against the reference's (an empty list: fine)."""
    if out.shape != ref_out.shape or lse is not None and ref_lse is not None and lse.shape != ref_lse.shape:
        return [f"{tag}: shapes {tuple(out.shape)}, {lse is not None and tuple(lse.shape)} vs reference's"]
    o, r, ne, probs = out.double(), ref_out.double(), ~empty, []
    if not torch.isfinite(o[ne]).all():
        probs.append(f"{tag}: NaN/inf in out rows {(~torch.isfinite(o)).flatten(1).any(1).nonzero()[:10].tolist()}")
    if (o[empty] != 0).any():
        probs.append(f"{tag}: empty rows {empty.nonzero().flatten()[:10].tolist()} not 0")
    probs += fc.off_by(f"{tag}: out", o[ne], r[ne], tol + tol * r[ne].abs())
    if lse is not None and ref_lse is not None:
        lf, rf = lse.double(), ref_lse.double()
        if not torch.isneginf(lf[empty]).all():
            probs.append(f"{tag}: lse of empty rows not -inf: {lf[empty].flatten()[:6].tolist()}")
        probs += fc.off_by(f"{tag}: lse", lf[ne], rf[ne], torch.full_like(rf[ne], tol))  # bits, whatever lse's size
    return probs


def new_stats() -> dict:
    """Counters: counts (sessions, growth_sessions, cases, compared, growth_compared, graph_replays),
    features, refusals, both_raise, fail_kinds."""
    return {k: collections.Counter() for k in ("counts", "features", "refusals", "both_raise", "fail_kinds")}


class Session:
    """One seed: plan and run both wrappers round by round, compare, capture and replay graphs."""

    def __init__(self, spec: dict, dev: torch.device, verbose: bool = False):
        self.spec, self.dev, self.verbose, self.cuda = spec, dev, verbose, dev.type == "cuda"
        self.stats, self.failures = new_stats(), []
        self.slots: dict = {}  # graph variant (q_len, return_lse) -> static q/out/lse/scales and replay()
        self.graph_ok = True

    def fail(self, where: str, kind: str, detail) -> None:
        self.failures.append({"seed": self.spec["seed"], "where": where, "kind": kind, "detail": detail})
        self.stats["fail_kinds"][kind] += 1
        if self.verbose:
            print("FAIL", json.dumps(self.failures[-1])[:3000], flush=True)

    def _check_fatal(self, e: Exception) -> None:
        """Raise CudaFatal where ``e`` is, or left, a CUDA error (the context is then unusable)."""
        if self.cuda and fc.is_cuda_error(e):
            raise fc.CudaFatal(fc.norm_msg(e, True)) from e

    def call(self, fn):
        """(fn(), None) or (None, exception), the GPU synchronized; a CUDA error raises CudaFatal."""
        try:
            res = fn()
            if self.cuda:
                torch.cuda.synchronize()
            return res, None
        except Exception as e:  # noqa: BLE001
            self._check_fatal(e)
            return None, e

    def run(self) -> list[dict]:
        """Run the session (a harness error becomes a failure)."""
        os.environ.pop(CFG_ENV, None)  # the spec's knobs only
        if self.spec["cfg_env"]:
            os.environ[CFG_ENV] = json.dumps(self.spec["cfg_env"])
        self.stats["counts"]["sessions"] += 1
        try:
            with fc.time_limit(0 if self.cuda else SESSION_TIMEOUT):
                self._rounds()
        except fc.Timeout as e:
            self.fail("session", "timeout", str(e))
        except Exception as e:  # noqa: BLE001
            self._check_fatal(e)
            self.fail("session", "harness_crash", fc.norm_msg(e, True))
        return self.failures

    def _plan_args(self, rd: dict, indptr, indices, last, counts, num_pages, gen):
        """(positional, keyword) table arguments of plan(), on the host / device as the round says."""
        dev, where = self.dev, rd["index_device"]
        on = (lambda t: t.to(dev)) if where == "device" else (lambda t: t)  # mixed: host lengths, device indices
        if rd["block_tables"]:
            bt = torch.randint(0, max(1, num_pages), (len(counts), max(counts + [0]) + 1), generator=gen).int()
            for b, c in enumerate(counts):
                bt[b, :c] = indices[int(indptr[b]):int(indptr[b + 1])]
            return (None, None, None), dict(block_tables=on(bt), seq_lens=on(torch.tensor(rd["kv_lens"]).int()))
        if rd["indices_offset"]:  # a view into a larger tensor
            off, n = rd["indices_offset"], indices.numel()
            indices = torch.full((n + 2 * off,), 10 ** 6, dtype=torch.int32).index_copy_(
                0, torch.arange(off, off + n), indices)[off:off + n]
        return (on(indptr), indices if where == "host" else indices.to(dev), on(last)), {}

    def _rounds(self) -> None:
        spec, dev, seed = self.spec, self.dev, self.spec["seed"]
        hq, hk, d, rounds = spec["num_qo_heads"], spec["num_kv_heads"], spec["head_dim"], spec["rounds"]
        batch, static_cache, graph = len(rounds[0]["kv_lens"]), None, {}
        p, grow = rounds[0]["scalars"]["page_size"], "grow_pages" in rounds[-1]
        need = [sum(-(-n // p) for n in r["kv_lens"]) + r["spare_pages"] for r in rounds]
        # the cache's pages by round: one size (graph replays read the capture's cache), or, where the spec grows
        # it as an engine does, more each round with a new page read: plan(k), run(k) on cache k, plan(k + 1) with
        # indices past cache k's pages, run(k + 1) on cache k + 1 (plan k + 1's page check must let it pass)
        pages = [max(need)] * len(rounds)
        if grow:
            pages = need[:1]
            for n, r in zip(need[1:], rounds[1:]):
                pages.append(max(n, pages[-1] + r["grow_pages"]))
            self.stats["counts"]["growth_sessions"] += 1
        if spec["graph"]:  # the reference refuses CUDA graphs on a GPU: fa2 only
            sizes = {"indptr": batch + 1, "indices": max(1, max(pages)), "last_page_len": batch}
            graph = dict(use_cuda_graph=True, **{f"paged_kv_{k}_buffer": torch.zeros(n, dtype=torch.int32, device=dev)
                                                 for k, n in sizes.items()})
        fa2, ref = (fd.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(spec["workspace"], dtype=torch.uint8, device=dev),
                                                          spec["layout"], backend=be, **kw)
                    for be, kw in (("fa2", graph), ("reference", {})))
        for ri, rd in enumerate(rounds):
            sc, gen = rd["scalars"], torch.Generator().manual_seed(seed * 1000 + ri)
            fresh = pages[ri - 1] if grow and ri else 0  # growth: some index past the last round's cache
            indptr, indices, last, num_pages, counts, used = build_table(rd, gen, pages[ri], fresh)
            pargs, pkw = self._plan_args(rd, indptr, indices, last, counts, num_pages, gen)
            pkw.update({k: v for k, v in sc.items() if k != "page_size"}, o_data_type=DT.get(spec["o_dtype"]),
                       q_data_type=DT[spec["q_dtype"]], kv_data_type=DT[spec["kv_dtype"]])
            tables = [t for t in list(pargs) + list(pkw.values()) if isinstance(t, torch.Tensor)]
            snap = [t.clone() for t in tables]
            (_, ef), (_, er) = (self.call(lambda w=w: w.plan(*pargs, hq, hk, d, sc["page_size"], **pkw))
                                for w in (fa2, ref))
            if ef is not None or er is not None:
                self.raised(f"round{ri}.plan", ef, er)
                continue
            if any(not torch.equal(a, b) for a, b in zip(tables, snap)):
                self.fail(f"round{ri}.plan", "plan_modified_index_tensors", "plan() changed its index arguments")
            cache = make_cache(spec, rd, num_pages, dev, torch.Generator(dev).manual_seed(seed * 1000 + ri), used)
            if spec["graph"] and static_cache is None:
                static_cache = cache
            elif spec["graph"]:  # the captured graphs read this cache: new contents, same memory
                for dst, src in zip(kv_views(static_cache), kv_views(cache)):
                    dst.copy_(src)
                cache = static_cache
            for rj, run in enumerate(rd["runs"]):
                self.case(f"round{ri}.run{rj}", rd, run, fa2, ref, cache,
                          torch.Generator(device=dev).manual_seed(seed * 1000 + ri * 10 + rj + 500))

    def raised(self, where: str, ef, er) -> None:
        """Sort the exceptions of a plan() or run() pair into stats and failures."""
        spec, msg = self.spec, str(ef)
        spurious = next((e for e in (ef, er) if e is not None and fc.PAGE_CHECK.search(str(e))), None)
        if spurious is not None:  # a page check refused indices within the cache (a grown one, say)
            return self.fail(where, "page_check_refusal", fc.norm_msg(spurious, True))
        if ef is not None and er is not None:  # both refuse: only what the spec asked for
            self.stats["both_raise"][f"fa2: {fc.norm_msg(ef)} || ref: {fc.norm_msg(er)}"] += 1
            if not (spec["graph"] and BOTH_RAISE_OK.search(msg)):
                self.fail(where, "both_raise", f"fa2: {fc.norm_msg(ef, True)} || ref: {fc.norm_msg(er)}")
        elif er is not None:
            self.fail(where, "reference_exception", fc.norm_msg(er, True))
        elif (isinstance(ef, fd.Unsupported) or isinstance(ef, ValueError) and (
                spec["workspace"] < (1 << 20) and WORKSPACE_REFUSAL.search(msg)
                or spec["graph"] and GRAPH_REFUSAL.search(msg))
              or spec["cfg_env"] and "out of resource" in msg.lower()):  # a knob's kernel too big
            self.stats["refusals"][fc.refusal_key(ef)] += 1
        else:
            self.fail(where, "fa2_exception", fc.norm_msg(ef, True))

    def case(self, where: str, rd: dict, run: dict, fa2, ref, cache, gen: torch.Generator) -> None:
        """One run() of both wrappers on a new q; in graph sessions also capture / replay fa2's."""
        spec, dev, st, feats = self.spec, self.dev, self.stats, features(self.spec, rd, run, self.cuda)
        st["counts"]["cases"] += 1
        st["features"].update(feats)
        hq, d, q_len, rl = spec["num_qo_heads"], spec["head_dim"], run["q_len"], run["return_lse"]
        n, qdt = len(rd["kv_lens"]) * q_len, DT[spec["q_dtype"]]
        o_dtype = DT[spec["o_dtype"]] if spec["o_dtype"] else qdt
        q = (torch.randn(n, hq, d, generator=gen, device=dev) * spec["q_mag"]).to(qdt)
        skw = {k: torch.tensor([x], device=dev) if run["scales"]["as_tensor"] else x
               for k, x in (run["scales"] or {}).items() if k != "as_tensor" and x is not None}
        key, slot = (q_len, rl), None
        if spec["graph"] and self.graph_ok:  # a captured graph reads its own q buffer and scale tensors
            slot = self.slots.setdefault(key, {"q": q, "skw": skw})
            q, skw = slot["q"].copy_(q), slot["skw"]  # (every case of a graph session has the same scales)
        elif run["q_strided"]:
            q = torch.zeros(n, hq + 3, d, dtype=qdt, device=dev)[:, 1:hq + 1].copy_(q)
        fkw = dict(skw)
        if run["prealloc_out"]:
            fkw["out"] = torch.full((n, hq, d), float("nan"), dtype=o_dtype, device=dev)
        if run["prealloc_lse"] and rl:
            fkw["lse"] = torch.full((n, hq), float("nan"), device=dev)
        digest = lambda: sum(int(t.view(torch.uint8).sum(dtype=torch.int64)) for t in kv_views(cache))  # noqa: E731
        q_snap, before = q.clone(), digest()
        rf, ef = self.call(lambda: fa2.run(q, cache, return_lse=rl, q_len_per_req=q_len, **fkw))
        rr, er = self.call(lambda: ref.run(q, cache, return_lse=rl, q_len_per_req=q_len, **skw))
        if ef is not None or er is not None:
            return self.raised(where, ef, er)
        st["counts"]["compared"] += 1
        st["counts"]["growth_compared"] += "cache_growth" in feats
        if digest() != before or not torch.equal(q, q_snap):
            self.fail(where, "input_modified", "run() modified q or the cache")
        (out_f, lse_f), (out_r, lse_r) = (rf if rl else (rf, None)), (rr if rl else (rr, None))
        for name, got in (("out", out_f), ("lse", lse_f)):
            if name in fkw and got.data_ptr() != fkw[name].data_ptr():
                self.fail(where, f"prealloc_{name}_not_used", f"fa2 returned another tensor than {name}=")
        if out_f.dtype != out_r.dtype:
            self.fail(where, "dtype_mismatch", f"{out_f.dtype} vs {out_r.dtype}")
        empty = torch.tensor([i + m < q_len for m in rd["kv_lens"] for i in range(q_len)], device=dev)  # no key seen
        sm, scl = rd["scalars"]["sm_scale"], run["scales"] or {}  # sigma: the logits' std, roughly
        sigma = (sm * d ** 0.5 if sm else 1.0) * spec["q_mag"] * (scl.get("q_scale") or 1) * (scl.get("k_scale") or 1)
        # q or k rounded before the dot: sharp logits amplify it. fp8 KV: q (scaled into fp16 range);
        # ROPE_LLAMA: the rotated q and k both (16-bit, as FlashInfer's tensor-core path), a logit error
        # of ~2^-8.5 x sigma a key, up to ~0.016 x sigma in lse (log2) at the tail of a few thousand rows
        amplified = 1.0
        if rd["scalars"]["pos_encoding_mode"] == "ROPE_LLAMA":
            amplified = max(1.0, sigma)
        elif spec["kv_dtype"] in ("e4m3", "e5m2"):
            amplified = max(1.0, sigma / 4)
        tol = (TOL[spec["kv_dtype"]] + (0.01 if spec["q_dtype"] == "bf16" and spec["kv_dtype"] != "bf16" else 0.0)
               ) * amplified
        probs = compare("fa2 vs ref", out_f, lse_f, out_r, lse_r, empty, tol)
        if probs:
            self.fail(where, "mismatch", probs)
        if self.verbose:
            print(f"{where}: compared, {'MISMATCH' if probs else 'ok'} {feats}", flush=True)
        if slot is None:
            return
        if "replay" not in slot:  # capture this variant's run() (its first case, just run eagerly)
            slot["out"] = torch.empty(n, hq, d, dtype=o_dtype, device=dev)
            slot["lse"] = torch.empty(n, hq, device=dev) if rl else None
            _, e = self.call(lambda: self.capture(fa2, slot, cache, key))
            if e is not None:
                self.graph_ok = False
                return self.fail(where, "graph_capture_exception", fc.norm_msg(e, True))
        slot["out"].fill_(float("nan"))
        if rl:
            slot["lse"].fill_(float("nan"))
        _, e = self.call(slot["replay"])
        if e is not None:
            return self.fail(where, "graph_replay_exception", fc.norm_msg(e, True))
        st["counts"]["graph_replays"] += 1
        probs = compare("graph replay vs ref", slot["out"], slot["lse"], out_r, lse_r, empty, tol)
        if probs:
            self.fail(where, "graph_replay_mismatch", probs)

    def capture(self, fa2, slot: dict, cache, key) -> None:
        """slot["replay"]: on a GPU a CUDAGraph's replay of fa2.run() on the slot's tensors; on the
        CPU this plan()'s plan object, run on the tables later plan()s write (the emulation)."""
        q_len, rl = key
        if self.cuda:
            def call():
                fa2.run(slot["q"], cache, out=slot["out"], lse=slot["lse"], return_lse=rl, q_len_per_req=q_len,
                        **slot["skw"])
            torch.cuda.synchronize()
            call()  # after the sync, this ends a deferred page check: the capture makes no host sync
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                call()
            slot["graph"], slot["replay"] = g, g.replay
            return
        planned = fa2._variants[key]
        kv = checks.unpack_paged_kv_cache(cache, self.spec["layout"])
        sv = [checks.check_run_scale(slot["skw"].get(nm), nm, self.dev) for nm in ("q_scale", "k_scale", "v_scale")]
        slot["replay"] = lambda: planned.backend.run(planned.plan, AttentionInputs(
            slot["q"], kv, slot["out"], slot["lse"], *sv))


def forked_session(spec: dict) -> tuple[dict, list[dict]]:
    """A CPU session in a forked child (a crash must not end the fuzzer): (stats, failures)."""
    def work() -> dict:
        sess = Session(spec, torch.device("cpu"))
        sess.run()
        return {"stats": sess.stats, "failures": sess.failures}
    res, why = fc.run_forked(work, SESSION_TIMEOUT + 60)  # (the session's own time limit comes first)
    if res:
        return res["stats"], res["failures"]
    return ({"counts": {"sessions": 1}, "fail_kinds": {"process_crash": 1}},
            [{"seed": spec["seed"], "where": "session", "kind": "process_crash", "detail": why}])


def main() -> int:
    """Parse the command line; dry-run, replay, or fuzz until --sessions or --minutes are done."""
    args = fc.parse_args(__doc__, 10.0, "/tmp/fuzz_decode/failures-{device}.jsonl", ",".join(TOL),
                         "f16,e4m3,e5m2", "bf16,f16,e4m3,e5m2",
                         more=(("--config", dict(type=_config_arg, default=None, metavar="JSON", help=(
                             "DecodeConfig overrides under every session's own knobs, e.g. "
                             "'{\"gluon_fp8_split_tokens\": 256}'"))),))
    cuda, dtypes = args.device == "cuda", args.dtypes
    base = args.config or {}
    for seed in range(args.start, args.start + args.dry_run * args.stride, args.stride):  # per round: page, batch,
        s = gen_session(seed, args.scale, dtypes, base)  # lengths (pattern, max, empty), q_lens, cache MB
        mb = s["num_kv_heads"] * s["head_dim"] * 2 * DT[s["kv_dtype"]].itemsize / 2 ** 20
        print(seed, s["kv_dtype"], s["q_dtype"], f"{s['num_qo_heads']}/{s['num_kv_heads']}", s["head_dim"], s["layout"],
              "graph" * s["graph"] or "grow" * ("grow_pages" in s["rounds"][-1]), s["cfg_env"] or "",
              [(p, len(L), r["pattern"], max(L), L.count(0), [c["q_len"] for c in r["runs"]],
                round(sum(-(-n // p) * p for n in L) * mb))
              for r in s["rounds"] for p, L in [(r["scalars"]["page_size"], r["kv_lens"])]])
    if args.dry_run:
        return 0
    dev = torch.device(args.device)
    if not cuda:
        torch.set_num_threads(1)
    if args.replay is not None:  # one session, in this process, verbose
        args.start, args.minutes = args.replay, 0
        print(json.dumps(gen_session(args.replay, args.scale, dtypes, base))[:6000], flush=True)
    stats, code = new_stats(), 0
    loop = fc.SeedLoop(args, 30, lambda: f"{dict(stats['counts'])} failures {sum(stats['fail_kinds'].values())} "
                                         f"{dict(stats['fail_kinds'])}")
    for seed in loop:
        spec = gen_session(seed, args.scale, dtypes, base)
        if cuda or args.replay is not None:
            sess = Session(spec, dev, verbose=args.replay is not None)
            try:
                sess.run()
            except fc.CudaFatal as e:
                sess.fail("session", "cuda_error", str(e))
                code = fc.EXIT_CUDA
            delta, failures = sess.stats, sess.failures
            del sess
            gc.collect()  # a session's graphs and their memory pools go with it
        else:
            delta, failures = forked_session(spec)
        for k, v in delta.items():
            stats[k].update(v)
        if args.replay is None:
            fc.append_jsonl(args.out, [{**rec, "device": args.device, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                                        "replay": fc.replay_command("fuzz_decode.py", args, seed)
                                        + (f" --config '{json.dumps(base)}'" if base else ""), "spec": spec}
                                       for rec in failures])
        if code:
            break
    return fc.finish({"device": args.device, "scale": args.scale, "dtypes": dtypes,
                      "failures": sum(stats["fail_kinds"].values()), "elapsed_s": round(loop.elapsed()),
                      "next_seed": loop.next_seed, "out": args.out, **stats["counts"],
                      **{k: v for k, v in stats.items() if k != "counts"}}, code)


if __name__ == "__main__":
    sys.exit(main())
