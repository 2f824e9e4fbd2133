// The cp.async stage ring of the attention bodies: tile i of a block's loop lands in one of STAGES
// stages while tiles i + 1 .. i + STAGES - 1 are in flight, one commit group per tile (an empty
// group where there is no tile, so that "all but the newest STAGES - 2 groups" is always
// "everything up to tile i").
//
//   StageRing<STAGES>::start(ntiles, issue)       before the loop: tiles 0 .. STAGES - 2 requested
//   StageRing<STAGES>::next(tile, ntiles, issue)  at the top of step `tile`: when it returns, every
//                                                 thread's copies of `tile` have landed, every thread
//                                                 is done with tile - 1, and tile + STAGES - 1 is
//                                                 requested into tile - 1's stage
// issue(i) issues the copies of tile i into its stage (the caller knows which: i % STAGES, or a
// counter of its own). next() holds a block barrier: every thread calls it with the same tile and
// ntiles. STAGES 1: no prefetch; the one stage is refilled after a barrier and waited for at once.
//   StageRing<STAGES>::next(tile, ntiles, issue, landed)
//                                                 the same, with landed() run by every thread after
//                                                 its wait and before the barrier (a wgmma body's
//                                                 fence.proxy.async: the landed copies made visible
//                                                 to the tensor cores' async-proxy reads)
//
// Provided by kgen to both compilers as "kgen/attention/stage_ring.cuh" (kgen/compile/provided.py);
// needs kgen/async_copy.cuh before it.
#pragma once

namespace kgen {

template <int STAGES>
struct StageRing {
  static_assert(STAGES >= 1, "stages");

  template <class Issue>
  static __device__ __forceinline__ void start(int ntiles, Issue&& issue) {
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
      if (i < ntiles) issue(i);
      cp_async_commit();
    }
  }

  template <class Issue>
  static __device__ __forceinline__ void next(int tile, int ntiles, Issue&& issue) {
    next(tile, ntiles, issue, [] {});
  }

  template <class Issue, class Landed>
  static __device__ __forceinline__ void next(int tile, int ntiles, Issue&& issue, Landed&& landed) {
    if (STAGES == 1) {
      __syncthreads();  // everybody is done with the stage
      issue(tile);
      cp_async_commit();
      cp_async_wait<0>();
    } else {
      cp_async_wait<(STAGES >= 2 ? STAGES - 2 : 0)>();  // this thread's copies of `tile` have landed
    }
    landed();
    __syncthreads();  // everybody's have; and everybody is done with tile - 1, whose stage is refilled next
    if (STAGES > 1) {
      if (tile + STAGES - 1 < ntiles) issue(tile + STAGES - 1);
      cp_async_commit();
    }
  }
};

}  // namespace kgen
