// pybind11 bindings of the block manager, in the extension module pagedkv._C (which also registers the
// torch.ops.pagedkv operators from csrc/ops).
#include <torch/extension.h>

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagedkv native module: block manager and paged KV ops";
}
