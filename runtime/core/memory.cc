#include "runtime/core/memory.h"

#include <malloc.h>

namespace fp8rt {

void KeepFreedMemory() {
  // Blocks up to 1 GiB from the heap, and never trim the heap back to the kernel.
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, -1);
}

}  // namespace fp8rt
