// The CPU attention kernel copy switch as plain C functions of the ops library (pagedkv/_ops*.so), which has
// no Python module: pagedkv/_ops_library.py calls them through ctypes. A refused name returns its message
// (the library's own storage, valid until the next call on this thread) instead of throwing across C.
#include <cstring>
#include <exception>
#include <string>

#include "ops/ops.h"

namespace {
thread_local std::string c_api_text;  // what the last call returned on this thread

const char* keep(std::string text) {
  c_api_text = std::move(text);
  return c_api_text.c_str();
}
}  // namespace

extern "C" {

// nullptr when `isa` is now the cap, else why it was refused (nothing changes then).
__attribute__((visibility("default"))) const char* pagedkv_set_cpu_attention_isa(const char* isa) {
  try {
    pagedkv::set_cpu_attention_isa(isa == nullptr ? "" : isa);
    return nullptr;
  } catch (const std::exception& e) {
    return keep(e.what());
  }
}

__attribute__((visibility("default"))) const char* pagedkv_cpu_attention_isa() {
  return keep(pagedkv::cpu_attention_isa());
}

// The copies this CPU runs, best first, separated by commas.
__attribute__((visibility("default"))) const char* pagedkv_cpu_attention_isas() {
  std::string names;
  for (const std::string& name : pagedkv::cpu_attention_isas()) names += (names.empty() ? "" : ",") + name;
  return keep(std::move(names));
}

}  // extern "C"
