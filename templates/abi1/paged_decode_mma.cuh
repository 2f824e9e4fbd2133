// ABI 1's call of the tensor-core decode body: `kgen::paged_decode_mma_body<Cfg>(...)` with
// paged_decode_body's positional parameters (templates/abi1/paged_decode.cuh), filling the internal
// body's Params. Needs kgen/mma.cuh first.
#pragma once

#include "kgen/abi1/paged_decode.cuh"
#include "kgen/bodies/paged_decode_mma.cuh"

namespace kgen {

template <class Cfg>
__device__ __forceinline__ void paged_decode_mma_body(KGEN_ABI1_DECODE_PARAMETERS) {
  const abi1::DecodeParams<Cfg> p = KGEN_ABI1_DECODE_FIELDS;
  paged_decode_mma_body<Cfg>(p);
}

}  // namespace kgen
