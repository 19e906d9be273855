// Each C++ source registers its own Python bindings here, so adding a file never touches a
// central list (module.cpp just runs every registered binder, in name order).
#pragma once

#include <torch/extension.h>

#include <utility>
#include <vector>

namespace pystronghold {

using BindFn = void (*)(pybind11::module_&);

// Meyers singleton: safe to use from static initialisers of any translation unit.
inline std::vector<std::pair<const char*, BindFn>>& binders() {
  static std::vector<std::pair<const char*, BindFn>> all;
  return all;
}

struct RegisterBindings {
  RegisterBindings(const char* name, BindFn fn) { binders().emplace_back(name, fn); }
};

}  // namespace pystronghold

// Usage, at namespace scope in one .cpp file:
//   PYSTRONGHOLD_BINDINGS(adam) { m.def("adam_step", ...); }
#define PYSTRONGHOLD_BINDINGS(name)                                                   \
  static void pystronghold_bind_##name(pybind11::module_& m);                         \
  static ::pystronghold::RegisterBindings pystronghold_register_##name(#name,         \
                                                             pystronghold_bind_##name); \
  static void pystronghold_bind_##name(pybind11::module_& m)
