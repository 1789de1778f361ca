// Exception types of the core; the bindings translate them to Python's KeyError, ValueError, RuntimeError.
#pragma once
#include <stdexcept>
#include <string>

namespace pagedkv {

// An unknown sequence id (or a double free): KeyError in Python.
struct KeyError : std::out_of_range {
  using std::out_of_range::out_of_range;
};

// A malformed argument: ValueError in Python.
struct ValueError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// The request is well formed but cannot be served now (e.g. out of blocks): RuntimeError in Python.
struct OutOfBlocks : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// check_invariants() found a broken invariant: RuntimeError in Python.
struct InvariantError : std::logic_error {
  using std::logic_error::logic_error;
};

}  // namespace pagedkv
