// Leaving Python threads running while a torch-free source waits on a long system call (pinning or
// unmapping GiBs): run_without_gil runs `work` with the GIL released when the calling thread holds
// it, else simply runs it. Defined in module.cpp, the one source that includes Python's headers.
#pragma once

#include <functional>

namespace pystronghold {

void run_without_gil(const std::function<void()>& work);

}  // namespace pystronghold
