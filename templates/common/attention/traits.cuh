// What every attention body (and the cache writer) reads off its Cfg the same way: the cache's
// scale granularity as a named enum, and the one type-equality test.
//
//   ScaleMode        how a cache element's dequantisation scale is found (real = stored x scale)
//   ScaleModeOf<Cfg> Cfg::SCALE_MODE as a ScaleMode, whether the Cfg spells it as the enum or as
//                    the bare integer of sources written before it (0..4 in the enum's order)
//   IsSame<A, B>     A and B are one type (std::is_same; NVRTC has no <type_traits>)
//
// Provided by kgen to both compilers as "kgen/attention/traits.cuh" (kgen/compile/provided.py).
#pragma once

namespace kgen {

enum class ScaleMode : int {
  none = 0,            // a float cache: no scale
  per_tensor = 1,      // k_scale[0], v_scale[0]
  per_head = 2,        // k_scale[kv_head], ...
  per_token_head = 3,  // one float per (block, slot, KV head), copied with each tile
  block = 4,           // nvfp4: an e4m3 scale per 16 elements of a row, and one fp32 per tensor
};

template <class Cfg> struct ScaleModeOf {
  static constexpr ScaleMode value = static_cast<ScaleMode>(Cfg::SCALE_MODE);
};

template <class A, class B> struct IsSame { static constexpr bool value = false; };
template <class A> struct IsSame<A, A> { static constexpr bool value = true; };

}  // namespace kgen
