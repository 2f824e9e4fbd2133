"""FlashInfer's launch geometry, restated from its source for the static benchmarks (static_perf.py,
static_prefill.py): which template parameters, shared memory, split and CTAs its batch decode and batch
prefill choose (the file each rule comes from is named). kgen's own model (kgen/perf) does not use them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kgen.perf.model import H200, Device
from kgen.plan.arch import limits_for


def flashinfer_data() -> Path | None:
    """The flashinfer-python wheel's data/ folder (include/, cccl/), found without importing flashinfer."""
    found = importlib.util.find_spec("flashinfer")
    for loc in (found.submodule_search_locations or []) if found else []:
        if Path(loc, "data", "include", "flashinfer", "attention", "decode.cuh").exists():
            return Path(loc, "data")
    return None


# ---- FlashInfer's batch decode (flashinfer/data/include/flashinfer/attention/decode.cuh, scheduler.cuh)
def flashinfer_geometry(head_dim: int, group: int, kv_itemsize: int, sm_major: int = 9) -> dict:
    """BatchDecodeWithPagedKVCacheDispatched's template parameters and dynamic shared memory."""
    vec = max(16 // kv_itemsize, head_dim // 32)
    bdx = head_dim // vec
    bdy = group
    threads = max(128, bdx * bdy)
    bdz = threads // (bdx * bdy)
    tile = (2 if kv_itemsize == 1 else 4) if group == 1 else 1
    stages = 2 if sm_major >= 8 else 1
    smem = (max(2 * stages * tile * bdy * bdz * head_dim * kv_itemsize, bdz * bdy * head_dim * 4)
            + max(tile * threads * 8, 2 * bdy * bdz * 4))
    return {"vec": vec, "bdx": bdx, "bdy": bdy, "bdz": bdz, "tile": tile, "stages": stages,
            "threads": threads, "smem": smem}


def flashinfer_split(pages: list[int], num_kv_heads: int, page_size: int, blocks_per_sm: int,
                     dev: Device = H200) -> tuple[bool, int, int]:
    """BatchDecodeWithPagedKVCacheWorkEstimationDispatched without CUDA graphs: (split, pages per
    chunk, grid x). No split when batch x kv_heads already fills max_grid = blocks/SM x SMs; else the
    smallest chunk (>= 128 / page_size pages) whose chunk count x kv_heads fits max_grid."""
    max_grid = blocks_per_sm * dev.sms
    if len(pages) * num_kv_heads >= max_grid:
        return False, max(pages), len(pages)
    low, high = max(128 // page_size, 1), max(pages)
    while low < high:
        mid = (low + high) // 2
        if sum(-(-p // mid) for p in pages) * num_kv_heads > max_grid:
            low = mid + 1
        else:
            high = mid
    new_batch = sum(-(-max(p, 1) // low) for p in pages)
    return new_batch != len(pages), low, new_batch


# ---- FlashInfer's batch prefill, sm80 path (flashinfer/data/include/flashinfer: utils.cuh,
# attention/scheduler.cuh, attention/prefill.cuh of the flashinfer-python wheel) ---------------------
def flashinfer_cta_tile_q(avg_packed_qo_len: int, head_dim: int) -> int:
    """utils.cuh FA2DetermineCtaTileQ for head_dim < 256 on sm_80+: 128 past 64 packed rows, 64 past 16,
    else 16."""
    if avg_packed_qo_len > 64 and head_dim < 256:
        return 128
    return 64 if avg_packed_qo_len > 16 else 16


def flashinfer_traits(cta_tile_q: int, head_dim: int, kv_itemsize: int, q_itemsize: int = 2,
                      smem_per_sm: int | None = None, smem_optin: int | None = None) -> dict:
    """prefill.cuh BatchPrefillWithPagedKVCacheDispatched for head_dim <= 256 (no VO split, no RoPE,
    fp32 QK accumulation): NUM_MMA_Q (2 for a 128-row tile, else 1), NUM_WARPS_Q (4 past 16 rows, else
    1), NUM_WARPS_KV = 4 / NUM_WARPS_Q; K/V smem per NUM_MMA_KV = (D_QK + D_VO) x 16 x NUM_WARPS_KV x
    sizeof(KV), plus a D x 16 x NUM_WARPS_KV q-type repack tile for a one-byte KV (use_kv_repack); the
    Q tile CTA_TILE_Q x D x sizeof(Q) fixed; 2 CTAs per SM when two minimum tiles fit the SM; NUM_MMA_KV
    = the DISPATCH_NUM_MMA_KV step (8, 4, 2, 1) at or below min(smem bound, 8 / NUM_MMA_Q)."""
    limits = limits_for("sm_90")  # the device FlashInfer queries (sharedMemPerMultiprocessor, ...Optin)
    smem_per_sm = limits.smem_per_sm if smem_per_sm is None else smem_per_sm
    smem_optin = limits.smem_per_block if smem_optin is None else smem_optin
    num_mma_q = 2 if cta_tile_q > 64 else 1
    warps_q = 4 if cta_tile_q > 16 else 1
    warps_kv = 4 // warps_q
    per_kv = 2 * head_dim * 16 * warps_kv * kv_itemsize
    if kv_itemsize == 1 and cta_tile_q > 16 and head_dim != 64:
        per_kv += head_dim * 16 * warps_kv * q_itemsize
    fixed = cta_tile_q * head_dim * q_itemsize
    min_kv = warps_q // 2 if kv_itemsize == 1 and warps_q > 2 else 1
    ctas_per_sm = 2 if smem_per_sm >= 2 * (fixed + min_kv * per_kv) else 1
    per_block = min(smem_per_sm // ctas_per_sm, smem_optin)
    limit = min((per_block - fixed) // per_kv, 8 // num_mma_q)
    num_mma_kv = next(s for s in (8, 4, 2, 1) if limit >= s)
    return {"CTA_TILE_Q": cta_tile_q, "NUM_MMA_Q": num_mma_q, "NUM_WARPS_Q": warps_q, "NUM_WARPS_KV": warps_kv,
            "NUM_MMA_KV": num_mma_kv, "NUM_MMA_D": head_dim // 16, "CTA_TILE_KV": num_mma_kv * 16 * warps_kv,
            "threads": 32 * warps_q * warps_kv, "smem": fixed + num_mma_kv * per_kv}


def flashinfer_chunk(packed: list[int], kv_pages: list[int], cta_tile_q: int, max_batch_if_split: int,
                     min_chunk_pages: int) -> tuple[bool, int]:
    """scheduler.cuh PrefillBinarySearchKVChunkSize (CUDA graphs off): the smallest chunk (pages, at
    least 128 / page_size) whose work items sum(ceil(packed / CTA_TILE_Q) x ceil(pages / chunk)) fit
    max_batch_size_if_split = 2 x SMs / kv_heads; split when that chunk is under the longest KV."""
    low, high = min_chunk_pages, max(max(kv_pages), 1)
    while low < high:
        mid = (low + high) // 2
        n = sum(-(-p // cta_tile_q) * -(-max(kv, 1) // mid) for p, kv in zip(packed, kv_pages, strict=True))
        if n > max_batch_if_split:
            low = mid + 1
        else:
            high = mid
    return low < max(max(kv_pages), 1), low


def flashinfer_ctas(seqs: list[tuple[int, int]], group: int, num_kv_heads: int, page: int, traits: dict,
                    sms: int) -> tuple[list[int], int]:
    """(tile iterations of every CTA in launch order, KV chunks in all): scheduler.cuh PrefillSplitQOKVIndptr
    work items (request, q tile, KV chunk) on grid x, KV heads on grid z; prefill.cuh's causal
    num_iterations = ceil(min(chunk_size, max(0, kv_len - qo_len + ceil((q_tile + 1) x CTA_TILE_Q /
    group) - chunk_start)) / CTA_TILE_KV)."""
    tq, tkv = traits["CTA_TILE_Q"], traits["CTA_TILE_KV"]
    packed = [q * group for q, _ in seqs]
    pages = [-(-kv // page) for _, kv in seqs]
    split, chunk_pages = flashinfer_chunk(packed, pages, tq, 2 * sms // num_kv_heads, max(128 // page, 1))
    items = []
    chunks = 0
    for (q_len, kv_len), p, np_ in zip(seqs, packed, pages, strict=True):
        n_chunks = -(-max(np_, 1) // chunk_pages) if split else 1
        size = chunk_pages * page if split else kv_len
        chunks += n_chunks
        for qt in range(-(-p // tq)):
            limit = kv_len - q_len + -(-((qt + 1) * tq) // group)
            for c in range(n_chunks):
                start = min(c * size, kv_len)
                csize = min((c + 1) * size, kv_len) - start
                items.append(-(-min(csize, max(0, limit - start)) // tkv))
    return [t for _ in range(num_kv_heads) for t in items], (chunks if split else 0)


def flashinfer_sm90_items(seqs: list[tuple[int, int]], num_q_heads: int, cta_q: int = 128, cta_kv: int = 96) -> list[int]:
    """Main-loop iterations of every work item of FlashInfer's sm90 batch prefill (scheduler.cuh
    PrefillSM90Plan): per query head, the requests by KV length (longest first), each one's query
    tiles of cta_q tokens (one head: GQA heads are not packed) from the last; a causal tile sees
    kv_len - qo_len + min((tile + 1) x cta_q, qo_len) keys, in iterations of cta_kv. The plan hands
    the items in this order to the least-loaded of the SMs' persistent CTAs (by its cost estimate);
    list scheduling them on SMs x 1 slots is that greedy by modeled time."""
    order = sorted(seqs, key=lambda s: -s[1])
    items = []
    for q_len, kv_len in order:
        tiles = -(-q_len // cta_q)
        for t in range(tiles - 1, -1, -1):
            items.append(-(-(kv_len - q_len + min((t + 1) * cta_q, q_len)) // cta_kv))
    return items * num_q_heads
