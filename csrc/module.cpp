// The extension module pystronghold._C: runs the binders every source file registered.
#include <algorithm>
#include <cstring>

#include "bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pystronghold native core: fused CPU Adam, copy engine, host arena, file tier";
  auto all = pystronghold::binders();
  std::sort(all.begin(), all.end(),
            [](const auto& a, const auto& b) { return std::strcmp(a.first, b.first) < 0; });
  for (const auto& [name, bind] : all) bind(m);
}
