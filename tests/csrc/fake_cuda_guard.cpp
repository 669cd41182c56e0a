// A CUDA device guard for the CUDA dry run (tests/test_cuda_dryrun.py) on a CPU-only torch.
//
// Under FakeTensorMode, tensors on a fake "cuda" device run their meta kernels; but some of torch's
// Python bindings (Tensor.copy_, indexing, bool(), .cuda()) first open a device guard for the
// tensor's device, and a CPU-only build registers no CUDA guard: "PyTorch is not linked with support
// for cuda devices". torch's FakeTensorMode installs a guard itself only on a CUDA build without a GPU
// (c10::impl::ensureCUDADeviceGuardSet). This library does the same on a CPU-only build, for the dry
// run's duration: localllm_fake_cuda_guard(1) puts c10's FakeGuardImpl<CUDA> (a current-device
// counter, no CUDA) where no CUDA guard is registered, localllm_fake_cuda_guard(0) takes it out again.
// It never replaces a real guard, and no kernel runs through it: fake tensors never reach a backend.
//
// A plain C function loaded with ctypes, not a torch op: torch/library.h would cost 6 s of compiling.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {
const c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> fake_guard;
}  // namespace

// Returns 1 when the fake guard is in place after the call, 0 when it is not.
extern "C" int localllm_fake_cuda_guard(int on) {
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)];
  const c10::impl::DeviceGuardImplInterface* current = slot.load();
  if (on) {
    if (current == nullptr) {
      slot.store(&fake_guard);
      return 1;
    }
    return current == &fake_guard;
  }
  if (current == &fake_guard) {
    slot.store(nullptr);
  }
  return 0;
}
