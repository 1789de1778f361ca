// The core's two argument shapes for batches. Span<T>: a borrowed run of values (sequence ids, tokens,
// per-sequence counts), the one way a batch of ids or tokens comes in. Out<T>: a caller-provided buffer
// for an output whose size only the core knows, the one way a large batch output (slots, block-table
// rows) goes out. C++17 has no std::span.
#pragma once
#include <cstddef>
#include <functional>
#include <initializer_list>
#include <vector>

namespace pagedkv {

// Valid for the call it is passed to; the core copies what it keeps.
template <typename T>
struct Span {
  const T* data = nullptr;
  size_t size = 0;

  constexpr Span() = default;
  constexpr Span(const T* d, size_t n) : data(d), size(n) {}
  Span(const std::vector<T>& v) : data(v.data()), size(v.size()) {}  // NOLINT(google-explicit-constructor)
  // A braced list at the call site ({1, 2}): its values live until the end of the call's full expression,
  // which is as long as a Span argument is used (GCC warns for any Span made from a list: not for this).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winit-list-lifetime"
#endif
  constexpr Span(std::initializer_list<T> l) : data(l.begin()), size(l.size()) {}  // NOLINT
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

  constexpr bool empty() const { return size == 0; }
  constexpr const T& operator[](size_t i) const { return data[i]; }
  constexpr const T* begin() const { return data; }
  constexpr const T* end() const { return data + size; }
};

// out(n) returns a buffer for n values. The core calls it once, after it has validated the call (so an
// error allocates nothing), and writes every value before it returns.
template <typename T>
using Out = std::function<T*(size_t n)>;

// An Out<T> that writes into v (resized to n).
template <typename T>
Out<T> into(std::vector<T>& v) {
  return [&v](size_t n) {
    v.resize(n);
    return v.data();
  };
}

}  // namespace pagedkv
