"""KV layout benchmark: contiguous vs per-layer (non-contiguous) kvcached
tensors, read by decode attention over paged KV as an engine reads it.

For each layout a model-sized KV cache (default: Llama-3-8B shapes, 32 layers,
8 KV heads, 32 query heads, head dim 128, bf16, 16-token blocks) holds a batch
of sequences whose blocks are scattered by a shuffled block table. Timed over
every layer of one decode step (CUDA events, median of repeats):

* ``triton_paged``: a paged decode-attention kernel (Triton) that reads K/V
  straight from the kvcached views through the block table, as vLLM's and
  FlashInfer's paged kernels do (no copy);
* ``gather_sdpa``: gather each sequence's blocks (``view[table]``) and run
  ``scaled_dot_product_attention`` on the dense result;
* ``write``: scatter one new token per sequence into every layer (the
  ``reshape_and_cache`` step).

The baseline is the same work on plain ``torch.empty`` tensors of the
per-layer shape (what an engine allocates without kvcached). The JSON says
which layout is faster and by how much: the lead sets the auto default from it.

    python benchmarks/kv_layout.py                      # CUDA, writes benchmarks/results/kv-layout-h200.json
    python benchmarks/kv_layout.py --device cpu --layers 2 --batch 4 --context 256   # logic check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

import _provenance
from kvcached.memory import KVCache, KVCacheSpec, KVLayout

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _paged_decode(
        q_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        lens_ptr,
        out_ptr,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_tb,
        sm_scale,
        HQ: tl.constexpr,
        GROUP: tl.constexpr,
        BS: tl.constexpr,
        D: tl.constexpr,
    ):
        b = tl.program_id(0)
        hq = tl.program_id(1)
        hk = hq // GROUP
        offs_d = tl.arange(0, D)
        offs_t = tl.arange(0, BS)
        q = tl.load(q_ptr + (b * HQ + hq) * D + offs_d).to(tl.float32)
        n = tl.load(lens_ptr + b)
        m_i = tl.zeros([1], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([D], dtype=tl.float32)
        for j in range(0, tl.cdiv(n, BS)):
            blk = tl.load(table_ptr + b * stride_tb + j).to(tl.int64)
            k = tl.load(
                k_ptr
                + blk * stride_kb
                + offs_t[:, None] * stride_kt
                + hk * stride_kh
                + offs_d[None, :]
            ).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * sm_scale
            s = tl.where(j * BS + offs_t < n, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m_i - m_new)
            v = tl.load(
                v_ptr
                + blk * stride_vb
                + offs_t[:, None] * stride_vt
                + hk * stride_vh
                + offs_d[None, :]
            ).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        tl.store(out_ptr + (b * HQ + hq) * D + offs_d, (acc / l_i).to(out_ptr.dtype.element_ty))

    TRITON_ERROR = None
except Exception as exc:  # noqa: BLE001 - no triton: that kernel is skipped and said so
    TRITON_ERROR = f"{type(exc).__name__}: {exc}"


def paged_decode(q, key, value, table, lens, group):
    """q (B, HQ, D); key/value (num_blocks, BS, HKV, D) views; -> (B, HQ, D)."""
    B, HQ, D = q.shape
    out = torch.empty_like(q)
    assert key.stride(3) == 1 and value.stride(3) == 1
    _paged_decode[(B, HQ)](
        q,
        key,
        value,
        table,
        lens,
        out,
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        table.stride(0),
        D**-0.5,
        HQ=HQ,
        GROUP=group,
        BS=key.shape[1],
        D=D,
        num_warps=4,
    )
    return out


def gather_sdpa(q, key, value, table, n_tokens):
    """q (B, HQ, D); gathered dense K/V per batch -> (B, HQ, D)."""
    B = q.shape[0]
    k = key[table]  # (B, nblk, BS, H, D)
    v = value[table]
    k = k.reshape(B, -1, *k.shape[3:])[:, :n_tokens].transpose(1, 2)
    v = v.reshape(B, -1, *v.shape[3:])[:, :n_tokens].transpose(1, 2)
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True).squeeze(2)


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn, repeats: int, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def build_views(kind: str, spec: KVCacheSpec, num_blocks: int, device, driver):
    """Per-layer (key, value) views and a closer, for a kvcached layout or the
    plain-tensor baseline."""
    if kind == "native":
        shape = (num_blocks, spec.block_size, spec.num_heads, spec.head_dim)
        views = [
            (
                torch.empty(shape, dtype=spec.dtype, device=device),
                torch.empty(shape, dtype=spec.dtype, device=device),
            )
            for _ in range(spec.num_layers)
        ]
        return views, list(range(1, num_blocks)), lambda: None
    layout = KVLayout(kind)
    kv = KVCache(
        spec,
        driver=driver,
        layout=layout,
        num_blocks=num_blocks,
        background=False,
        min_reserved=0,
        max_reserved=0,
    )
    ids = kv.alloc(num_blocks - 1)
    assert ids is not None, "not enough device memory for this size; lower --batch/--context"
    views = [(kv.tensors.key_view(i), kv.tensors.value_view(i)) for i in range(spec.num_layers)]
    return views, ids, kv.close


def _step_gather(views, q, table, n_tokens):
    for key, value in views:
        gather_sdpa(q, key, value, table, n_tokens)


def _step_write(views, blocks, slot, new_k):
    for key, value in views:
        key[blocks, slot] = new_k
        value[blocks, slot] = new_k


def _step_triton(views, q, table, lens, group):
    for key, value in views:
        paged_decode(q, key, value, table, lens, group)


def measure(views, ids, args, spec, device, timer, group, nblk, ref, result) -> dict:
    """Time one layout with a shuffled and a sequential block table."""
    entry: dict = {}
    gen = torch.Generator().manual_seed(0)  # the same tables for every layout
    for order in ("shuffled", "sequential"):
        blocks = torch.tensor(sorted(ids), dtype=torch.long)
        if order == "shuffled":
            blocks = blocks[torch.randperm(len(ids), generator=gen)]
        table = blocks[: args.batch * nblk].view(args.batch, nblk).to(device)
        lens = torch.full((args.batch,), args.context, dtype=torch.int32, device=device)
        torch.manual_seed(1)
        for key, value in views:  # the same data in every layout (same seed)
            shape = (args.batch, nblk, *key.shape[1:])
            key[table] = torch.randn(shape, device=device, dtype=spec.dtype)
            value[table] = torch.randn(shape, device=device, dtype=spec.dtype)
        q = torch.randn(args.batch, args.q_heads, args.head_dim, device=device, dtype=spec.dtype)
        new_k = torch.randn(
            args.batch, args.kv_heads, args.head_dim, device=device, dtype=spec.dtype
        )
        slot = (args.context - 1) % args.block_size
        timings = {
            "gather_sdpa_s": timer(
                partial(_step_gather, views, q, table, args.context), args.repeats
            ),
            "write_s": timer(partial(_step_write, views, table[:, -1], slot, new_k), args.repeats),
        }
        out = gather_sdpa(q, *views[0], table, args.context).float()
        if TRITON_ERROR is None and device.type == "cuda":
            try:
                timings["triton_paged_s"] = timer(
                    partial(_step_triton, views, q, table, lens, group), args.repeats
                )
                tri = paged_decode(q, *views[0], table, lens, group).float()
                timings["triton_max_abs_err_vs_sdpa"] = (tri - out).abs().max().item()
            except Exception:  # noqa: BLE001 - record it, keep the other figures
                result["triton"] = traceback.format_exc(limit=3)
        if order == "shuffled":
            if not ref:
                ref.append(out)
            timings["same_output_as_native"] = bool(torch.equal(out, ref[0]))
        entry[order] = timings
    return entry


def run(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda":
        from kvcached.driver import make_driver

        driver = make_driver("cuda", device.index or 0)
    else:
        from kvcached.driver.host import HostDriver

        driver = HostDriver(29, capacity=64 << 30)
    spec = KVCacheSpec(
        num_layers=args.layers,
        block_size=args.block_size,
        num_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=torch.bfloat16,
    )
    group = args.q_heads // args.kv_heads
    nblk = -(-args.context // args.block_size)
    num_blocks = args.batch * nblk + 1
    timer = Timer(device)
    result: dict = {
        "config": vars(args),
        "kv_bytes_per_layout": num_blocks * spec.block_bytes,
        "triton": TRITON_ERROR or "ok",
        "layouts": {},
    }
    ref: list[torch.Tensor] = []
    for kind in ("native", "per_layer", "contiguous"):
        views, ids, close = build_views(kind, spec, num_blocks, device, driver)
        try:
            result["layouts"][kind] = measure(
                views, ids, args, spec, device, timer, group, nblk, ref, result
            )
        finally:
            views.clear()
            close()
    lay = result["layouts"]
    summary = {}
    for metric in ("triton_paged_s", "gather_sdpa_s", "write_s"):
        for order in ("shuffled", "sequential"):
            if metric in lay["per_layer"][order]:
                c = lay["contiguous"][order][metric]
                p = lay["per_layer"][order][metric]
                n = lay["native"][order][metric]
                summary[f"{metric[:-2]}_{order}"] = {
                    "contiguous_over_per_layer": round(c / p, 3),
                    "per_layer_over_native": round(p / n, 3),
                    "contiguous_over_native": round(c / n, 3),
                }
    result["summary"] = summary
    key = "triton_paged_shuffled" if "triton_paged_shuffled" in summary else "gather_sdpa_shuffled"
    ratio = summary[key]["contiguous_over_per_layer"]
    result["faster_layout"] = "per_layer" if ratio > 1.0 else "contiguous"
    result["decided_by"] = key
    driver.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    prov = _provenance.start()
    result = run(args)
    out = (
        Path(args.out)
        if args.out
        else Path(__file__).parent
        / "results"
        / ("kv-layout-h200.json" if args.device.startswith("cuda") else "kv-layout-cpu.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    result["command"] = " ".join([Path(sys.executable).name, *sys.argv])
    result["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    result["torch"] = torch.__version__
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name()
    _provenance.write_result(out, result, prov)
    print(
        json.dumps(
            {
                "summary": result["summary"],
                "faster_layout": result["faster_layout"],
                "triton": result["triton"][:200],
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
