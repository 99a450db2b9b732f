"""TEST INFRASTRUCTURE: a CUDA emulation build (tools/build_emulation.py) from Python.

The emulated package has the same Python API as any variant; its ops run torch_binding.cpp's
CUDA path on CPU tensors, with the kernels emulated (cuda_emulation.h). The controls here
set the emulated device and read what the emulation observed, through ctypes on the loaded
.so (exported by tests/cuda_emulation/runtime.cpp and traffic.cpp).

Environment:
  LP_EMULATION           the flavor to load: fibers (default), traffic, tsan, concurrent or asan
  LP_EMULATION_SCHEDULE  a block's threads (fibers) in forward (default) or reversed order
  LP_EMULATION_BUILD     the flavor's directory (default build-emulation/<flavor>); the
                         mutation check points it at a mutant
"""

from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from pathlib import Path

from kernels import get_local_kernel

ROOT = Path(__file__).resolve().parents[2]
FLAVOR = os.environ.get("LP_EMULATION", "fibers")
BUILD = Path(os.environ.get("LP_EMULATION_BUILD", ROOT / "build-emulation" / FLAVOR))
COUNTS_TRAFFIC = FLAVOR == "traffic"  # its build counts global-memory bytes (traffic.cpp)
SCHEDULES = {"forward": 0, "reversed": 1}
SCHEDULE = os.environ.get("LP_EMULATION_SCHEDULE", "forward")
# The tests' smaller cases: the sanitizer flavors' and the reversed thread order's. They reach
# every line of the kernels that the forward run's larger cases reach (coverage.py checks it for
# tsan and asan), and a thread order matters line by line: a barrier missing between two lines.
SMALL_CASES = FLAVOR in ("tsan", "concurrent", "asan") or SCHEDULE == "reversed"
H200_SMS = 132

# cudaError_t values the tests inject (cuda_emulation.h)
LAUNCH_OUT_OF_RESOURCES = 701


class Emulation:
    def __init__(self, build: Path = BUILD):
        if not build.is_dir():
            raise RuntimeError(f"no CUDA emulation build in {build}: run `make emulate` "
                               "(or tools/build_emulation.py) first")
        self.lp = get_local_kernel(build, backend="cpu")
        so = next(Path(self.lp._ops.__file__).parent.glob("*.abi3.so"))
        self._lib = ctypes.CDLL(str(so))
        self.counts_traffic = hasattr(self._lib, "lp_emulation_traffic")  # the traffic build
        self._lib.lp_emulation_launches.restype = ctypes.c_uint64
        self._lib.lp_emulation_configure.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint64]
        self.configure()

    def configure(self, sms: int = H200_SMS, schedule: str = SCHEDULE, seed: int = 0) -> None:
        """The emulated GPU's SM count (which shapes grids and row splits), how a block's
        threads run, and the seed of the block order."""
        if self._lib.lp_emulation_configure(sms, SCHEDULES[schedule], seed) != 0:
            raise ValueError(f"this emulation build cannot run sms={sms}, schedule={schedule!r}")

    @contextmanager
    def gpu(self, sms: int, seed: int = 0):
        """Runs the body on an emulated GPU with `sms` SMs, then restores the H200."""
        self.configure(sms=sms, seed=seed)
        try:
            yield self.lp
        finally:
            self.configure()

    @contextmanager
    def device_tensors(self):
        """Inside the body the binding treats every tensor as device memory, which it does not
        read on the host (dispatch.h's host_readable): inputs only the kernels guard against,
        such as a device tree's links, reach them as they would on a GPU."""
        self._lib.lp_emulation_set_device_tensors(1)
        try:
            yield
        finally:
            self._lib.lp_emulation_set_device_tensors(0)

    def launches(self) -> int:
        """Kernel launches so far (that ran: injected failures do not count)."""
        return self._lib.lp_emulation_launches()

    def fail_next_launch(self, cuda_error: int) -> None:
        self._lib.lp_emulation_fail_next_launch(cuda_error)

    def leave_error_pending(self) -> None:
        """An emulated runtime call fails and nobody checks: its error stays this thread's last
        (cudaFuncGetAttributes on a device without kernels, called here through ctypes)."""
        get_attributes = getattr(self._lib, "_Z21cudaFuncGetAttributesP18cudaFuncAttributesPKv")
        attributes = ctypes.create_string_buffer(64)
        self._lib.lp_emulation_set_device(0, 9, 0, 0)
        try:
            assert get_attributes(attributes, None) != 0, "the emulated call did not fail"
        finally:
            self._lib.lp_emulation_set_device(0, 9, 0, 1)

    @contextmanager
    def device(self, index: int, capability: tuple[int, int], has_kernels: bool):
        """Runs the body on another emulated device, then restores device 0 (an sm90)."""
        self._lib.lp_emulation_set_device(index, *capability, int(has_kernels))
        try:
            yield self.lp
        finally:
            self._lib.lp_emulation_set_device(0, 9, 0, 1)

    def traffic(self) -> tuple[int, int] | None:
        """(bytes read, bytes written) in global memory since the last reset; None where the
        build does not count them (every flavor but traffic)."""
        if not self.counts_traffic:
            return None
        read, written = ctypes.c_uint64(), ctypes.c_uint64()
        self._lib.lp_emulation_traffic(ctypes.byref(read), ctypes.byref(written))
        return read.value, written.value

    def vector_read_bytes(self) -> int:
        """The part of traffic()'s bytes read that 16-byte loads read (the traffic build only)."""
        read = ctypes.c_uint64()
        self._lib.lp_emulation_vector_traffic(ctypes.byref(read))
        return read.value

    def reset_traffic(self) -> None:
        if self.counts_traffic:
            self._lib.lp_emulation_reset_traffic()
