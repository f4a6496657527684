"""Randomized differential fuzzer: fa2 prefill (paged, ragged, single) against the reference backend.

A session is one seed: a pure-JSON spec drawn from it (paged/ragged/single, NHD/HND, page size,
5-D or (k, v) cache, GQA, head dims, causal, custom/packed mask, window, soft cap, RoPE/ALiBi,
sm_scale, q/k/v scales, fp8 KV, f32 out, preallocated out/lse, FLASHDISPATCH_FA2_PREFILL_CONFIG,
split-KV knobs, CUDA-graph mode) with 1-3 rounds of lengths that re-plan the same wrappers.
Some eager paged sessions grow the cache round by round, as an engine does: lengths on the host,
indices on the device and reading a page past the last round's cache (on a GPU plan() defers its
page check, which must not refuse them).
Tensors come from CPU torch.Generators seeded by the spec (unused cache slots and outputs NaN),
then go to the device. fa2 and the reference get the same plan()/run() calls; out and lse are
compared elementwise (atol = rtol = 1e-2 f16, 2e-2 bf16, x3 with RoPE), rows that see no key give exactly
0 and lse -inf, nothing may be NaN. When only fa2 raises Unsupported/ValueError it is a refusal
(counted by message); when both raise nothing is compared. A page check refusing indices within
their cache is a failure of its own kind.

CPU (Triton interpreter, f16, small shapes, a forked child per session with a timeout):
    .venv/bin/python scripts/fuzz_prefill.py --minutes 4 --start 0
GPU (in-process, bf16+f16, large shapes; CUDA-graph sessions capture run() and replay it after
re-plans). After a CUDA error the script writes the failure and exits 3; OUT.next holds the seed
a driver loop restarts at:
    S=0; while :; do PYTHONPATH=. python3 scripts/fuzz_prefill.py --device cuda --minutes 20 --start $S; \\
        [ $? = 3 ] || break; S=$(cat /tmp/fuzz_prefill.jsonl.next); done
Replay a seed verbosely in-process, with the --device/--scale/--dtypes that found it (each JSONL
failure record in --out holds the command): scripts/fuzz_prefill.py --replay 1234
--dry-run N prints N specs. The last line printed is a JSON summary; exit status 1 on any failure.
"""
from __future__ import annotations

import bisect
import json
import os
import random
import re
import sys
import traceback
from collections import Counter

import numpy as np

import fuzz_common as fc

CONFIG_ENV = "FLASHDISPATCH_FA2_PREFILL_CONFIG"
REFUSAL = re.compile(r"float_workspace_buffer too small|int workspace")  # fa2's documented refusals
TOL = {"f16": 1e-2, "bf16": 2e-2}
DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
SMALL_HEADS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (3, 1), (6, 3)]
LARGE_HEADS = [(32, 8), (32, 32), (64, 8), (32, 4), (16, 2), (8, 1), (24, 3)]
torch = fd = None  # imported by main() once TRITON_INTERPRET is set (CPU)


# --- specs ------------------------------------------------------------------------------------
def _lengths(rng: random.Random, n: int, kv_max: int, q_max: int, page: int):
    """n (qo_len, kv_len) pairs: empty KV, one key, page edges, q == kv, q == 1, chunked-prefill
    tails (q < kv), empty q, and now and then more queries than keys."""
    qo, kv = [], []
    for _ in range(n):
        r = rng.random()
        k = (0 if r < 0.06 else 1 if r < 0.12 else kv_max if r < 0.2 else
             page * rng.randint(1, max(1, kv_max // page)) + rng.choice([-1, 0, 1]) if r < 0.35 and page > 1
             else rng.randint(1, kv_max))
        k = max(0, min(kv_max, k))
        r = rng.random()
        q = (0 if r < 0.06 else 1 if r < 0.2 else k if r < 0.4 else k + rng.randint(1, 40) if r < 0.45
             else rng.randint(1, max(1, k)))
        qo.append(max(0, min(q_max, q)))
        kv.append(k)
    return qo, kv


def _fits(s: dict, qo: list, kv: list) -> bool:
    """Small: interpreter tile steps (32x16 CPU tiles, non-causal bound) within budget. Large: q,
    K/V and mask sizes within a few hundred MB (a case well under 4 GB with the reference's)."""
    if s["scale"] == "small":
        return sum(-(-q // 32) * (-(-k // 16) + 1) * s["hq"] for q, k in zip(qo, kv)) <= 260
    ps = s["page_size"]
    tokens = sum(-(-k // ps) * ps for k in kv) if ps else sum(kv)
    masked = s["mask"] in ("custom", "packed")
    return (sum(qo) * s["hq"] * s["dqk"] <= 1 << 25 and tokens * s["hkv"] * (s["dqk"] + s["dvo"]) <= 1 << 27
            and (not masked or sum(q * k for q, k in zip(qo, kv)) <= 1 << 26))


def _config(rng: random.Random, s: dict) -> str:
    """A FLASHDISPATCH_FA2_PREFILL_CONFIG value: a subset of key=value pairs or the four numbers.
    On a GPU only tiles that fit the head dim and features (shared memory) are drawn."""
    if s["device"] == "cpu":
        tile = (rng.choice([16, 32, 64]), rng.choice([16, 32, 64]), rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 3]))
        knobs = {}
    else:
        light = s["pos"] != "ROPE_LLAMA" and s["mask"] not in ("custom", "packed")
        tiles = {64: [(128, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2), (128, 32, 4, 2)],
                 128: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 2), (64, 32, 4, 2)]
                 + ([(128, 128, 8, 3), (128, 128, 8, 2)] if light else []),
                 192: [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2)],
                 256: [(64, 64, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2)]}[s["dqk"]]
        tile = rng.choice(tiles)
        knobs = dict(ctas_per_sm=rng.choice([1, 2, 4]), min_chunk_tokens=rng.choice([128, 512, 1024]),
                     max_splits=rng.choice([2, 8, 32]))
    if rng.random() < 0.2:
        return ",".join(map(str, tile))
    pick = dict(zip(("block_m", "block_n", "num_warps", "num_stages"), tile), tma=rng.choice([0, 1]), **knobs)
    return ",".join(f"{k}={pick[k]}" for k in rng.sample(sorted(pick), rng.randint(1, len(pick))))


def gen_spec(seed: int, device: str, scale: str, dtypes: list) -> dict:
    """The JSON spec of session ``seed`` (pure function of its arguments)."""
    rng = random.Random(seed)
    large = scale == "large"
    kind = rng.choices(["paged", "ragged", "single"], [5, 3, 1])[0]
    hq, hkv = rng.choice(LARGE_HEADS if large else SMALL_HEADS)
    dqk, dvo = rng.choices([(128, 128), (64, 64), (256, 256), (192, 128)], [5, 4, large, large])[0]
    fp8 = rng.random() < 0.15
    s = dict(seed=seed, device=device, scale=scale, kind=kind, dtype=rng.choice(dtypes), hq=hq, hkv=hkv, dqk=dqk,
             dvo=dvo, layout=rng.choice(["NHD", "HND"]),
             page_size=rng.choice([1, 16, 32, 64, 128] if large else [1, 16, 16, 32, 64, 5]) if kind == "paged" else 0,
             storage="tuple" if dqk != dvo or rng.random() < 0.4 else "5d",
             kv_dtype=rng.choice(["e4m3", "e5m2"]) if fp8 else "same",
             o_dtype="f32" if rng.random() < 0.1 else None,
             mask=rng.choices(["none", "causal", "custom", "packed"], [30, 45, 12, 13])[0],
             window_left=-1 if rng.random() < 0.7 else rng.choice([0, 1, rng.randint(2, 300), 2**31 - 1]),
             soft_cap=None if rng.random() < 0.7 else rng.choice([0.0, 1.0, 2.5, 8.0, 30.0]),
             pos=rng.choices(["NONE", "ROPE_LLAMA", "ALIBI"], [70, 15, 15])[0],
             sm_scale=None if rng.random() < 0.6 else round(dqk ** -0.5 * rng.uniform(0.5, 2.0), 5),
             fp16_qk=rng.random() < 0.1, prealloc=rng.choice(["none", "contig", "strided"]),
             graph=kind != "single" and rng.random() < 0.2, host_meta=rng.random() < 0.5)
    s["causal"] = s["mask"] == "causal" or (s["mask"] in ("custom", "packed") and rng.random() < 0.3)
    s["rope_scale"], s["rope_theta"] = ((rng.choice([None, 1.0, 2.0, 8.0]), rng.choice([None, 1e4, 5e5]))
                                        if s["pos"] == "ROPE_LLAMA" else (None, None))
    s["scales"] = {name: [round(rng.uniform(0.5, 2.0), 3) * (-1 if name == "k_scale" and rng.random() < 0.1 else 1),
                          rng.random() < 0.4]  # [value, as a 1-element device tensor]
                   for name, p in (("q_scale", 0.05), ("k_scale", 0.7 if fp8 else 0.1),
                                   ("v_scale", 0.7 if fp8 else 0.1))
                   if rng.random() < p}
    s["split"] = "none" if kind == "single" else rng.choices(["none", "fixed", "disable"], [55, 25, 20])[0]
    if s["split"] == "fixed":
        s["fixed_split_size"] = (rng.choice([8, 37, 64, 128] if large else [1, 2, 3, 5]) if kind == "paged"
                                 else rng.choice([256, 592, 2048] if large else [7, 16, 50, 100]))
    s["config"] = _config(rng, s) if rng.random() < 0.35 else None
    batch = 1 if kind == "single" else rng.choice([1, 2, 3, 4, 8, 16, 32, 64] if large else [1, 2, 3, 4])
    kv_max = rng.choice([256, 1024, 4096, 8192]) if large else rng.choice([40, 100, 200])
    n_rounds = rng.choice([2, 3]) if s["graph"] else rng.choice([1, 1, 2, 3])
    rounds = []
    for _ in range(n_rounds):
        if rounds and kind == "single" and s["mask"] in ("custom", "packed") and rng.random() < 0.5:
            qo, kv = list(rounds[0]["qo"]), list(rounds[0]["kv"])  # the kept plan takes the new mask
        else:
            qo, kv = _lengths(rng, batch if s["graph"] or not rounds else rng.randint(1, batch), kv_max,
                              2048 if large else 200, max(s["page_size"], 1))
        while not _fits(s, qo, kv):  # halve the heaviest request until the round fits its budget
            i = max(range(len(qo)), key=lambda j: (qo[j] + 1) * (kv[j] + 1))
            qo[i], kv[i] = qo[i] // 2, kv[i] // 2
        if s["graph"] and not rounds:  # run() refuses a capture on 0 query rows (or 0 ragged keys): empty
            qo[0] += not sum(qo)  # views have no address, a replay with rows would read null pointers
            kv[0] += kind == "ragged" and not sum(kv)
        rounds.append(dict(qo=qo, kv=kv, data_seed=rng.getrandbits(48),
                           return_lse=rounds[0]["return_lse"] if s["graph"] and rounds else rng.random() < 0.6,
                           density=rng.choice([0.0, 0.1, 0.5, 0.9, 1.0, "tril", "tril"])))
    s["rounds"] = rounds
    if kind == "paged":
        need = [sum(-(-k // s["page_size"]) for k in r["kv"]) for r in rounds]
        s["num_pages"] = max(need) + rng.randint(0, 3)
        if not s["graph"] and n_rounds > 1 and rng.random() < 0.5:  # an engine's cache, grown between rounds
            s["host_meta"], s["growth"] = True, [need[0] + s["num_pages"] - max(need)]  # its pages by round (drawn
            for n in need[1:]:  # last: the other seeds' specs stay; graph replays read the capture's cache)
                s["growth"].append(max(n, s["growth"][-1] + rng.randint(1, 16)))
    return s


# --- tensors ----------------------------------------------------------------------------------
def _dt(name: str):
    """The torch dtype of a spec's dtype name."""
    return getattr(torch, DTYPES[name])


def _indptr(lens) -> "torch.Tensor":
    """int32 [0, cumsum(lens)...] on the CPU."""
    return torch.tensor(np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]), dtype=torch.int32)


def make_round(s: dict, r: int, dev) -> dict:
    """Round ``r``'s tensors, drawn on the CPU from its data seed, then moved to ``dev`` (with
    host_meta the lengths stay on the host, as a serving engine plans; a grown cache's indices
    read a page past the last round's)."""
    rd = s["rounds"][r]
    g = torch.Generator().manual_seed(rd["data_seed"])
    qo, kv = rd["qo"], rd["kv"]
    qdt = _dt(s["dtype"])
    kvdt = qdt if s["kv_dtype"] == "same" else _dt(s["kv_dtype"])
    meta_dev = "cpu" if s["host_meta"] else dev
    d = dict(q=torch.randn(sum(qo), s["hq"], s["dqk"], generator=g).to(qdt).to(dev),
             qo_indptr=_indptr(qo).to(meta_dev), qo=qo, kv=kv)
    if s["kind"] == "paged":
        ps, pages = s["page_size"], s["growth"][r] if "growth" in s else s["num_pages"]
        counts = [-(-k // ps) for k in kv]
        perm = torch.randperm(pages, generator=g)[:sum(counts)].to(torch.int32)
        if r and "growth" in s and len(perm) and int(perm.max()) < s["growth"][r - 1]:
            perm[-1] = pages - 1  # (a page no other index has)
        last = [k - (n - 1) * ps if n else 0 for k, n in zip(kv, counts)]
        filled = torch.zeros(pages, dtype=torch.int64)  # used slots per page; the others are NaN
        filled[perm.long()] = torch.tensor([ps if j < n - 1 else last[b] for b, n in enumerate(counts)
                                            for j in range(n)], dtype=torch.int64)
        caches = []
        for dim in (s["dqk"], s["dvo"]):
            c = torch.randn(pages, ps, s["hkv"], dim, generator=g)
            c[torch.arange(ps)[None, :] >= filled[:, None]] = float("nan")
            caches.append(c.to(kvdt).transpose(1, 2).contiguous() if s["layout"] == "HND" else c.to(kvdt))
        d.update(kv_indptr=_indptr(counts).to(meta_dev), indices=perm.to(dev),
                 last=torch.tensor(last, dtype=torch.int32).to(meta_dev),
                 cache=torch.stack(caches, 1).to(dev) if s["storage"] == "5d" else tuple(c.to(dev) for c in caches))
    else:
        k, v = (torch.randn(sum(kv), s["hkv"], dim, generator=g).to(kvdt) for dim in (s["dqk"], s["dvo"]))
        if s["layout"] == "HND":
            k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
        d.update(kv_indptr=_indptr(kv).to(meta_dev), k=k.to(dev), v=v.to(dev))
    if s["mask"] in ("custom", "packed"):
        masks = []
        for q, k in zip(qo, kv):
            m = (torch.ones(q, k, dtype=torch.bool).tril(k - q) if rd["density"] == "tril"
                 else torch.rand(q, k, generator=g) < rd["density"])
            if q and torch.rand(1, generator=g).item() < 0.3:
                m[int(torch.randint(q, (1,), generator=g))] = False  # a row that sees no key
            masks.append(m)
        d["mask2d"], d["custom"] = [m.to(dev) for m in masks], torch.cat([m.flatten() for m in masks]).to(dev)
        packed = [np.packbits(m.flatten().numpy(), bitorder="little") for m in masks]  # packed here, not by fd
        d["packed"] = torch.from_numpy(np.concatenate(packed + [np.zeros(0, np.uint8)])).to(dev)
    return d


def plan_kwargs(s: dict, d: dict, reference: bool) -> dict:
    """The keyword arguments of plan() shared by the paged and ragged wrappers."""
    kw = dict(causal=s["causal"], pos_encoding_mode=s["pos"], sm_scale=s["sm_scale"], window_left=s["window_left"],
              logits_soft_cap=s["soft_cap"], rope_scale=s["rope_scale"], rope_theta=s["rope_theta"],
              q_data_type=_dt(s["dtype"]), kv_data_type=None if s["kv_dtype"] == "same" else _dt(s["kv_dtype"]),
              o_data_type=_dt(s["o_dtype"]) if s["o_dtype"] else None, use_fp16_qk_reduction=s["fp16_qk"])
    if s["mask"] in ("custom", "packed"):
        kw["custom_mask" if s["mask"] == "custom" else "packed_custom_mask"] = d[s["mask"]]
    if not reference and s["split"] != "none":
        kw.update(fixed_split_size=s["fixed_split_size"]) if s["split"] == "fixed" else kw.update(disable_split_kv=True)
    return kw


class Session:
    """The fa2 and reference wrappers of one spec, planned and run round after round."""

    def __init__(self, s: dict, dev):
        self.s, self.dev, self.fixed = s, dev, None  # fixed: CUDA-graph mode's buffers
        self.odt = _dt(s["o_dtype"] or s["dtype"])
        self.scales = {name: torch.tensor([v], dtype=torch.float32, device=dev) if as_tensor else v
                       for name, (v, as_tensor) in s["scales"].items()}
        if s["kind"] == "single":
            fd.dispatch.select.clear_cache()  # kept single-request plans were made under another config
            return
        cls = (fd.BatchPrefillWithPagedKVCacheWrapper if s["kind"] == "paged"
               else fd.BatchPrefillWithRaggedKVCacheWrapper)
        b, bufs = len(s["rounds"][0]["qo"]), {}  # CUDA-graph buffers: int32 (uint8 for the packed mask)
        sizes = (dict(qo_indptr=b + 1, paged_kv_indptr=b + 1, paged_kv_indices=s["num_pages"], paged_kv_last_page_len=b)
                 if s["kind"] == "paged" else dict(qo_indptr=b + 1, kv_indptr=b + 1))
        if s["mask"] in ("custom", "packed"):
            sizes.update(mask_indptr=b + 1, custom_mask=8 + max(sum((q * k + 7) // 8 for q, k in zip(r["qo"], r["kv"]))
                                                                for r in s["rounds"]))
        for name, n in sizes.items() if s["graph"] else ():
            bufs[name + "_buf"] = torch.zeros(max(n, 1), dtype=torch.uint8 if name == "custom_mask" else torch.int32,
                                              device=dev)
        ws_mb = 256 if dev.type == "cuda" else 64  # fixed_split_size partials: rows x chunks x heads x (dvo + 1) fp32
        if s["split"] == "fixed":
            chunk = s["fixed_split_size"] * max(s["page_size"], 1)
            ws_mb = max(ws_mb, min(3072, max(sum(q * (k // chunk + 2) for q, k in zip(r["qo"], r["kv"]))
                                             for r in s["rounds"]) * s["hq"] * (s["dvo"] + 1) * 4 // 2**20 + 2))
        ws = torch.empty(ws_mb << 20, dtype=torch.uint8, device=dev)
        self.fa2 = cls(ws, s["layout"], use_cuda_graph=s["graph"], backend="fa2", **bufs)
        self.ref = cls(torch.empty(1 << 20, dtype=torch.uint8, device=dev), s["layout"], backend="reference")

    def _plan(self, w, d: dict, reference: bool) -> None:
        """plan() of wrapper ``w`` on round data ``d``."""
        s, kw = self.s, plan_kwargs(self.s, d, reference)
        if s["kind"] == "paged":
            w.plan(d["qo_indptr"], d["kv_indptr"], d["indices"], d["last"], s["hq"], s["hkv"], s["dqk"],
                   s["page_size"], head_dim_vo=s["dvo"], **kw)
        else:
            w.plan(d["qo_indptr"], d["kv_indptr"], s["hq"], s["hkv"], s["dqk"], s["dvo"], **kw)

    def _run(self, w, d: dict, return_lse: bool, out=None, lse=None):
        """run() of wrapper ``w``: (out, lse or None)."""
        kv = (d["cache"],) if self.s["kind"] == "paged" else (d["k"], d["v"])
        res = w.run(d["q"], *kv, out=out, lse=lse, return_lse=return_lse, **self.scales)
        return res if return_lse else (res, None)

    def _single(self, d: dict, backend: str, return_lse: bool):
        """single_prefill_with_kv_cache on ``backend``: (out, lse or None)."""
        s, sc = self.s, self.scales
        mask = ({"custom_mask": d["mask2d"][0]} if s["mask"] == "custom" else
                {"packed_custom_mask": d["packed"]} if s["mask"] == "packed" else {})
        res = fd.single_prefill_with_kv_cache(
            d["q"], d["k"], d["v"], sc.get("q_scale"), sc.get("k_scale"), sc.get("v_scale"),
            o_dtype=_dt(s["o_dtype"]) if s["o_dtype"] else None, causal=s["causal"], kv_layout=s["layout"],
            pos_encoding_mode=s["pos"], use_fp16_qk_reduction=s["fp16_qk"], sm_scale=s["sm_scale"],
            window_left=s["window_left"], logits_soft_cap=s["soft_cap"], rope_scale=s["rope_scale"],
            rope_theta=s["rope_theta"], backend=backend, return_lse=return_lse, **mask)
        return res if return_lse else (res, None)

    def reference(self, d: dict):
        """(out, lse) of the reference, lse always (it says which rows see no key)."""
        if self.s["kind"] == "single":
            return self._single(d, "reference", True)
        self._plan(self.ref, d, True)
        return self._run(self.ref, d, True)

    def fa2_round(self, r: int, d: dict):
        """Plan (re-plan) and run fa2 for round ``r`` under the spec's config; (out, lse or None)."""
        s, rd = self.s, self.s["rounds"][r]
        if s["config"]:
            os.environ[CONFIG_ENV] = s["config"]
        try:
            if s["kind"] == "single":
                return self._single(d, "fa2", rd["return_lse"])
            if s["graph"]:
                return self._graph_round(r, d)
            self._plan(self.fa2, d, False)
            if "growth" in s and self.dev.type == "cuda":
                torch.cuda.synchronize()  # the deferred page check then ends at this round's run()
            out = lse = None
            if s["prealloc"] != "none":  # NaN-poisoned, contiguous or strided views
                w, nq = 2 if s["prealloc"] == "strided" else 1, len(d["q"])
                out = torch.full((nq, s["hq"] * w, s["dvo"]), float("nan"), dtype=self.odt, device=self.dev)[:, ::w]
                lse = torch.full((nq, s["hq"] * w), float("nan"), device=self.dev)[:, ::w] if rd["return_lse"] else None
            return self._run(self.fa2, d, rd["return_lse"], out, lse)
        finally:
            os.environ.pop(CONFIG_ENV, None)
            if self.dev.type == "cuda":
                torch.cuda.synchronize()

    def _graph_round(self, r: int, d: dict):
        """CUDA-graph mode: the round's data copied into fixed buffers (sized for every round) and
        the wrapper re-planned; on a GPU round 0 runs eagerly, is captured and replayed, later
        rounds replay the graph. On the CPU every round runs eagerly on views of the buffers."""
        s, cuda, nq = self.s, self.dev.type == "cuda", len(d["q"])
        if self.fixed is None:
            most_q, most_kv = (max(sum(rd[k]) for rd in s["rounds"]) for k in ("qo", "kv"))
            f = self.fixed = dict(q=d["q"].new_zeros((most_q,) + d["q"].shape[1:]),
                                  out=torch.zeros(most_q, s["hq"], s["dvo"], dtype=self.odt, device=self.dev),
                                  lse=torch.zeros(most_q, s["hq"], device=self.dev))
            if s["kind"] == "paged":  # the page count is the session's: round 0's cache has the shape
                f["cache"] = d["cache"].clone() if s["storage"] == "5d" else tuple(c.clone() for c in d["cache"])
            for name in ("k", "v") if s["kind"] == "ragged" else ():
                shape = list(d[name].shape)
                shape[s["layout"] == "HND"] = most_kv
                f[name] = d[name].new_zeros(shape)
        f, view = self.fixed, {}
        poison = lambda: (f["out"].fill_(float("nan")), f["lse"].fill_(float("nan")))  # noqa: E731
        poison()
        for name in ("q", "k", "v") if s["kind"] == "ragged" else ("q",):
            n = len(d["q"]) if name == "q" else sum(d["kv"])
            view[name] = f[name][:, :n] if name != "q" and s["layout"] == "HND" else f[name][:n]
            view[name].copy_(d[name])
        if s["kind"] == "paged":
            for dst, src in zip(*(c if isinstance(c, tuple) else (c,) for c in (f["cache"], d["cache"]))):
                dst.copy_(src)
            view["cache"] = f["cache"]
        self._plan(self.fa2, d, False)
        rl = s["rounds"][0]["return_lse"]
        args = (self.fa2, view, rl, f["out"][:nq], f["lse"][:nq] if rl else None)
        if not cuda:
            self._run(*args)
        elif r == 0:
            torch.cuda.synchronize()  # a deferred page check ends at this run(), not inside the capture
            self._run(*args)
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._run(*args)
            poison()
            self.graph.replay()
        else:
            self.graph.replay()
        return f["out"][:nq], f["lse"][:nq] if rl else None


# --- outcomes ---------------------------------------------------------------------------------
def compare(out, lse, ref_out, ref_lse, tol: float, qo: list) -> tuple[list, float]:
    """(problems, max abs out error): elementwise atol = rtol = tol on out and finite lse, no NaN,
    rows the reference sees no key for exactly 0 with lse -inf."""
    starts = np.cumsum([0] + qo).tolist()

    def at(mask) -> str:  # the first True of a [rows, heads, ...] mask, as request / row / head
        i = mask.nonzero()[0].tolist()
        b = bisect.bisect_right(starts, i[0]) - 1
        return f"row {i[0]} (request {b}: q row {i[0] - starts[b]} of {qo[b]}) head {i[1]}" + (
            f" dim {i[2]}" if len(i) > 2 else "")

    probs, (o, r, rl) = [], (x.float() for x in (out, ref_out, ref_lse))
    empty = torch.isneginf(rl)
    err = torch.nan_to_num((o - r).abs(), nan=0.0)
    bad = err > tol + tol * r.abs()
    max_err = float(err.max()) if err.numel() else 0.0
    for cond, msg in ((torch.isnan(r), "NaN in reference out"), (torch.isnan(o), "NaN in fa2 out"),
                      ((o != 0).any(-1) & empty, "a row with no visible key not 0"),
                      (bad, f"out mismatch (max abs err {max_err:.4g})")):
        if cond.any():
            probs.append(f"{msg}: {int(cond.sum())}, first at {at(cond)}" + (
                f": fa2 {float(o[tuple(cond.nonzero()[0])]):.5g} ref {float(r[tuple(cond.nonzero()[0])]):.5g}"
                if cond is bad else ""))
    if lse is not None:
        lf = lse.float()
        lerr = torch.where(empty, 0.0, torch.nan_to_num((lf - rl).abs(), nan=float("inf")))
        for cond, msg in ((torch.isnan(lf), "NaN in fa2 lse"),
                          (torch.isneginf(lf) != empty, "lse -inf pattern differs"),
                          (lerr > tol, "lse mismatch")):  # bits, whatever lse's size
            if cond.any():
                i = tuple(cond.nonzero()[0].tolist())
                probs.append(f"{msg}: {int(cond.sum())}, first at {at(cond)}: "
                             f"fa2 {float(lf[i]):.5g} ref {float(rl[i]):.5g}")
                break
    return probs, max_err


def features(s: dict, r: int) -> list:
    """Feature labels of round ``r`` (counted over compared cases)."""
    rd, pairs = s["rounds"][r], list(zip(s["rounds"][r]["qo"], s["rounds"][r]["kv"]))
    f = [f"{k}={s[k]}" for k in ("kind", "layout", "dtype", "kv_dtype", "mask", "pos", "prealloc", "split")
         + (("page_size", "storage") if s["kind"] == "paged" else ())]
    f += [f"heads={s['hq']}/{s['hkv']}", f"group={s['hq'] // s['hkv']}", f"d={s['dqk']}/{s['dvo']}",
          f"lse={rd['return_lse']}", f"round={r}"]
    return f + [name for name, on in (
        ("window", s["window_left"] >= 0), ("soft_cap", bool(s["soft_cap"])), ("sm_scale", s["sm_scale"] is not None),
        ("scales", bool(s["scales"])), ("o_f32", s["o_dtype"] == "f32"), ("graph", s["graph"]),
        ("config", bool(s["config"])), ("q>kv", any(q > k for q, k in pairs)), ("q_empty", 0 in rd["qo"]),
        ("kv_empty", 0 in rd["kv"]), ("q==kv", any(q == k > 0 for q, k in pairs)), ("q=1", 1 in rd["qo"]),
        ("host_meta", s["host_meta"] and s["device"] == "cuda"), ("cache_growth", r > 0 and "growth" in s)) if on]


def run_session(s: dict, verbose: bool = False) -> dict:
    """Run every round of spec ``s``; a result dict (counts, refusals, failures, features)."""
    dev = torch.device(s["device"])
    res = dict(cases=0, compared=0, refusals={}, both_raise={}, ref_only={}, failures=[], features={})
    log = print if verbose else (lambda *a: None)

    def bump(bucket: str, key: str) -> None:  # count key in res[bucket]
        res[bucket][key] = res[bucket].get(key, 0) + 1

    sess = Session(s, dev)
    for r, rd in enumerate(s["rounds"]):
        d, ok, err = make_round(s, r, dev), {}, {}
        res["cases"] += 1
        for who, call in (("fa2", lambda: sess.fa2_round(r, d)), ("ref", lambda: sess.reference(d))):
            try:
                ok[who] = call()
            except Exception as e:  # noqa: BLE001
                err[who] = (e, traceback.format_exc())
                if dev.type == "cuda" and fc.is_cuda_error(e):
                    raise fc.CudaFatal(f"{who} round {r} (the reference runs after fa2): {err[who][1]}") from e
        (fa2_err, tb), ref_err = err.get("fa2", (None, "")), err.get("ref", (None,))[0]
        head = f"round {r}: qo={rd['qo']} kv={rd['kv']} lse={rd['return_lse']}"
        spurious = [who for who, (e, _) in err.items() if fc.PAGE_CHECK.search(str(e))]
        if spurious:  # a page check refused indices within their cache (a grown one, say)
            res["failures"].append(dict(round=r, kind="page_check_refusal",
                                        detail="\n".join(f"{who}: {err[who][1][-3000:]}" for who in spurious)))
            log(f"{head}: FAIL page check refuses: {fc.norm_msg(err[spurious[0]][0])}")
        elif fa2_err is not None and ref_err is not None:  # the spec makes valid input: a shared check refused it
            bump("both_raise", fc.norm_msg(fa2_err))
            res["failures"].append(dict(round=r, kind="both_raise",
                                        detail=f"ref: {fc.norm_msg(ref_err)}\nfa2: {tb[-3000:]}"))
            log(f"{head}: FAIL both raise: fa2 {fc.norm_msg(fa2_err)} | ref {fc.norm_msg(ref_err)}")
        elif ref_err is not None:
            bump("ref_only", fc.norm_msg(ref_err))
            res["failures"].append(dict(round=r, kind="reference_error", detail=err["ref"][1][-3000:]))
            log(f"{head}: FAIL only the reference raises: {fc.norm_msg(ref_err)}")
        elif fa2_err is not None:
            # fd.Unsupported (what fa2 cannot run), the documented workspace refusals; a tile override
            # may not fit in shared memory
            if (isinstance(fa2_err, fd.Unsupported) or isinstance(fa2_err, ValueError) and REFUSAL.search(str(fa2_err))
                    or type(fa2_err).__name__ == "OutOfResources" and s["config"]):
                refusal = fc.refusal_key(fa2_err)
                bump("refusals", refusal)
                log(f"{head}: fa2 refuses: {refusal}" + (f"\n{tb}" if verbose else ""))
            else:
                res["failures"].append(dict(round=r, kind="fa2_error", detail=tb[-3000:]))
                log(f"{head}: FAIL fa2 raised\n{tb}")
            if s["graph"]:
                break  # later rounds would replay a graph that was never captured
        else:
            # RoPE: fa2 rounds rotated q/k to the input dtype, the reference does not (few-key rows drift)
            tol = TOL[s["dtype"]] * (3 if s["pos"] == "ROPE_LLAMA" else 1)
            probs, max_err = compare(*ok["fa2"], *ok["ref"], tol, rd["qo"])
            res["compared"] += 1
            for f in features(s, r):
                bump("features", f)
            if probs:
                res["failures"].append(dict(round=r, kind="mismatch", detail="; ".join(probs)))
            log(f"{head}: {'FAIL ' + '; '.join(probs) if probs else 'ok'} (max abs err {max_err:.3g})")
    return res


# --- drivers ----------------------------------------------------------------------------------
def forked_session(s: dict, timeout: float) -> dict:
    """run_session in a forked child (the interpreter can hang or crash); a timeout kills it."""
    def work() -> dict:
        try:
            torch.set_num_threads(1)
            return run_session(s)
        except BaseException:  # noqa: BLE001
            return dict(cases=1, failures=[dict(round=-1, kind="crash", detail=traceback.format_exc()[-3000:])])
    res, why = fc.run_forked(work, timeout)
    return res or (dict(timeout=True) if why == "timeout" else
                   dict(cases=1, failures=[dict(round=-1, kind="crash", detail=f"child died, {why}")]))


def main() -> int:
    """Parse the command line; dry-run, replay, or fuzz until --sessions or --minutes are done."""
    a = fc.parse_args(__doc__, 4.0, "/tmp/fuzz_prefill.jsonl", ",".join(TOL), "f16", "bf16,f16",
                      more=[("--timeout", dict(type=float, default=90.0, help="seconds per CPU session"))])
    spec = lambda seed: gen_spec(seed, a.device, a.scale, a.dtypes)  # noqa: E731
    if a.dry_run:
        for i in range(a.dry_run):
            print(json.dumps(spec(a.start + i * a.stride)))
        return 0
    global torch, fd
    fc.use_interpreter(a.device)  # before the kernels are defined
    import flashdispatch as fd
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        print("fuzz_prefill.py: --device cuda: no CUDA device", file=sys.stderr)
        return 2
    if a.replay is not None:
        print(json.dumps(spec(a.replay), indent=1))
        res = run_session(spec(a.replay), verbose=True)
        print(json.dumps({k: v for k, v in res.items() if k != "features"}, indent=1))
        return 1 if res["failures"] else 0
    tot = Counter(sessions=0, growth_sessions=0, cases=0, compared=0, failures=0, timeouts=0)
    counts = {k: Counter() for k in ("refusals", "both_raise", "ref_only", "features")}
    status, timeouts = 0, []
    loop = fc.SeedLoop(a, 15, lambda: " ".join(f"{k} {v}" for k, v in tot.items())
                       + f" refusals {sum(counts['refusals'].values())}")
    for seed in loop:
        s = spec(seed)
        if a.device == "cpu":
            res = forked_session(s, a.timeout)
        else:
            try:
                res = run_session(s)
            except (fc.CudaFatal, Exception) as e:  # noqa: BLE001  (a CUDA error, or a crash: fatal if CUDA broke)
                status = fc.EXIT_CUDA if isinstance(e, fc.CudaFatal) or fc.is_cuda_error(e) else 0
                detail = str(e) if isinstance(e, fc.CudaFatal) else traceback.format_exc()
                res = dict(cases=1, failures=[dict(round=-1, kind="cuda_error" if status else "crash",
                                                   detail=detail[-3000:])])
        tot.update(sessions=1, growth_sessions=int("growth" in s), cases=res.get("cases", 0),
                   compared=res.get("compared", 0), timeouts=int(bool(res.get("timeout"))),
                   failures=len(res.get("failures", [])))
        timeouts += [seed] if res.get("timeout") else []
        for key, counter in counts.items():
            counter.update(res.get(key, {}))
        fc.append_jsonl(a.out, [dict(seed=seed, replay=fc.replay_command("fuzz_prefill.py", a, seed), **fail, spec=s)
                                for fail in res.get("failures", [])])
        for fail in res.get("failures", []):
            print(f"FAIL seed {seed} round {fail['round']} {fail['kind']}: {fail['detail'][-600:]}", flush=True)
        if status:
            with open(a.out + ".next", "w") as fh:
                fh.write(f"{loop.next_seed}\n")
            break
    return fc.finish(dict(tot, seconds=round(loop.elapsed()), device=a.device, scale=a.scale, dtypes=a.dtypes,
                          seeds=[a.start, loop.next_seed - a.stride, a.stride], next_seed=loop.next_seed, out=a.out,
                          timeout_seeds=timeouts[:50], **{k: dict(c.most_common()) for k, c in counts.items()}), status)


if __name__ == "__main__":
    sys.exit(main())
