// ABI 1's call of the Hopper (wgmma) prefill body: the positional signature a hand-written source
// written against ABI 1 calls (`#include "kgen/paged_prefill_wgmma.cuh"`, then
// `kgen::paged_prefill_wgmma_body<Cfg>(...)`, as `kgen show` printed it for an sm_90 target), filling
// the internal body's Params (templates/abi1/paged_prefill.cuh says why). Needs kgen/hopper.cuh first.
#pragma once

#include "kgen/abi1/paged_prefill.cuh"
#include "kgen/bodies/paged_prefill_wgmma.cuh"

namespace kgen {

template <class Cfg>
__device__ __forceinline__ void paged_prefill_wgmma_body(KGEN_ABI1_PREFILL_PARAMETERS) {
  const abi1::PrefillParams<Cfg> p = KGEN_ABI1_PREFILL_FIELDS;
  paged_prefill_wgmma_body<abi1::PrefillCfg<Cfg>>(p);
}

}  // namespace kgen
