// kgen SIMT runtime, part 4: the glue compiled into a kernel's own translation unit.
//
// A kernel source is compiled alone (g++ -c) and its object checked before it is linked
// with the launch shim (kgen/compile/host.py), so the shim cannot see the kernels' parameter
// types. Per kernel, host.py appends after the source:
//   extern "C" void kgen_glue_run_NAME(void* args);      // body of every fiber: call NAME
//   extern "C" const char* kgen_glue_sig_NAME();         // parameter type codes
// both built from the templates below, which call no library function (the object check
// holds them to the same allow-list as the kernel).
#pragma once
#include <cstddef>
#include <type_traits>
#include <utility>

namespace kgen_glue {

// args: cuLaunchKernel-style, args[i] points at parameter i's value (alive during the launch).
template <class... P, std::size_t... I>
inline void call(void (*fn)(P...), void** args, std::index_sequence<I...>) {
  fn(*static_cast<std::decay_t<P>*>(args[I])...);
}

template <class... P>
inline void run(void (*fn)(P...), void* args) {
  // Called through a volatile pointer, never inlined: g++ may otherwise see undefined behaviour
  // in the kernel (a null store) and drop the whole call, turning a crash into a silent no-op.
  void (*volatile target)(P...) = fn;
  call(target, static_cast<void**>(args), std::index_sequence_for<P...>{});
}

// Parameter type codes, as kgen_simt::type_code spells them: p (pointer), i<N>/u<N> (integers),
// f<N> (floating point), b<N> (anything else passed by value), N in bytes; comma-separated.
template <class T>
struct Code {
  typedef std::decay_t<T> U;
  static constexpr char kind = std::is_pointer<U>::value ? 'p'
                               : std::is_floating_point<U>::value ? 'f'
                               : std::is_integral<U>::value ? (std::is_signed<U>::value ? 'i' : 'u')
                                                            : 'b';
  static constexpr std::size_t size = sizeof(U);
};

template <class... P>
struct Signature {
  struct Text {
    char s[sizeof...(P) * 24 + 1];
  };
  static constexpr Text make() {
    Text t{};
    const char kinds[] = {Code<P>::kind..., 0};
    const std::size_t sizes[] = {Code<P>::size..., 0};
    std::size_t n = 0;
    for (std::size_t i = 0; i < sizeof...(P); ++i) {
      if (i) t.s[n++] = ',';
      t.s[n++] = kinds[i];
      if (kinds[i] == 'p') continue;
      char digits[24] = {};
      std::size_t k = 0;
      for (std::size_t v = sizes[i]; v; v /= 10) digits[k++] = char('0' + v % 10);
      while (k) t.s[n++] = digits[--k];
    }
    return t;
  }
  static constexpr Text text = make();
};

template <class... P>
constexpr const char* signature(void (*)(P...)) {
  return Signature<P...>::text.s;
}

}  // namespace kgen_glue
