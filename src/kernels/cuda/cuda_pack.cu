// Fused pack/unpack: many (dst, src, bytes) copies in one launch. The table
// is the kernel's parameter (at most kCopyBatch copies, under the 4 KiB
// parameter limit), so nothing is uploaded first. Copies are cut into tiles;
// each block takes tiles grid-stride, finds its copy by binary search over
// the tiles' prefix sums, and moves the tile with the widest vector that the
// two addresses' relative alignment allows (16 bytes when both agree mod 16).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda/cuda_check.h"
#include "common/cuda/cuda_device.h"
#include "kernels/cuda/cuda_kernels.h"

namespace ddlfast {
namespace {

constexpr int kThreads = 256;
constexpr std::size_t kTileBytes = 32 * 1024;

struct CopyTable {
  const char* src[kCopyBatch];
  char* dst[kCopyBatch];
  unsigned long long bytes[kCopyBatch];
  unsigned tile_start[kCopyBatch + 1];  // prefix sums of each copy's tiles
  int count;
};
static_assert(sizeof(CopyTable) <= 4000, "the copy table must fit the kernel parameter space");

template <typename V>
__device__ __forceinline__ void copy_tile(char* dst, const char* src, std::size_t n) {
  // Bytes until dst (and so src) reaches V's alignment, then whole vectors, then the rest.
  std::size_t head = (sizeof(V) - reinterpret_cast<std::uintptr_t>(dst) % sizeof(V)) % sizeof(V);
  if (head > n) head = n;
  for (std::size_t i = threadIdx.x; i < head; i += blockDim.x) dst[i] = src[i];
  const std::size_t vectors = (n - head) / sizeof(V);
  auto* dst_v = reinterpret_cast<V*>(dst + head);
  const auto* src_v = reinterpret_cast<const V*>(src + head);
  for (std::size_t i = threadIdx.x; i < vectors; i += blockDim.x) dst_v[i] = src_v[i];
  for (std::size_t i = head + vectors * sizeof(V) + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

__global__ void __launch_bounds__(kThreads) copy_table_kernel(const __grid_constant__ CopyTable table) {
  const unsigned tiles = table.tile_start[table.count];
  for (unsigned t = blockIdx.x; t < tiles; t += gridDim.x) {
    int low = 0, high = table.count - 1;  // last copy whose first tile is <= t
    while (low < high) {
      const int mid = (low + high + 1) / 2;
      if (table.tile_start[mid] <= t) {
        low = mid;
      } else {
        high = mid - 1;
      }
    }
    const std::size_t offset = static_cast<std::size_t>(t - table.tile_start[low]) * kTileBytes;
    const std::size_t left = table.bytes[low] - offset;
    const std::size_t n = left < kTileBytes ? left : kTileBytes;
    char* dst = table.dst[low] + offset;
    const char* src = table.src[low] + offset;
    const auto skew = reinterpret_cast<std::uintptr_t>(dst) ^ reinterpret_cast<std::uintptr_t>(src);
    if (skew % 16 == 0) {
      copy_tile<uint4>(dst, src, n);
    } else if (skew % 8 == 0) {
      copy_tile<uint2>(dst, src, n);
    } else if (skew % 4 == 0) {
      copy_tile<unsigned>(dst, src, n);
    } else if (skew % 2 == 0) {
      copy_tile<unsigned short>(dst, src, n);
    } else {
      copy_tile<unsigned char>(dst, src, n);
    }
  }
}

}  // namespace

Status cuda_copy_batch(const CopySpec* specs, std::size_t count, cudaStream_t stream) {
  LaunchShape shape;
  bool have_shape = false;
  for (std::size_t first = 0; first < count; first += kCopyBatch) {
    CopyTable table;
    table.count = 0;
    table.tile_start[0] = 0;
    const std::size_t last = std::min(count, first + kCopyBatch);
    for (std::size_t i = first; i < last; ++i) {
      const std::size_t tiles = (specs[i].bytes + kTileBytes - 1) / kTileBytes;
      if (tiles > (1u << 30) - table.tile_start[table.count]) {
        return Status::invalid("fused copy of more than 32 TiB in one batch");
      }
      table.src[table.count] = static_cast<const char*>(specs[i].src);
      table.dst[table.count] = static_cast<char*>(specs[i].dst);
      table.bytes[table.count] = specs[i].bytes;
      table.tile_start[table.count + 1] = table.tile_start[table.count] + static_cast<unsigned>(tiles);
      ++table.count;
    }
    const unsigned tiles = table.tile_start[table.count];
    if (tiles == 0) continue;
    if (!have_shape) {
      DDLFAST_RETURN_IF_ERROR(current_launch_shape(&shape));
      have_shape = true;
    }
    // One block per tile, at most what fills the device.
    const unsigned blocks = grid_blocks(shape, static_cast<std::size_t>(tiles) * kThreads, kThreads);
    copy_table_kernel<<<blocks, kThreads, 0, stream>>>(table);
    DDLFAST_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "launching the fused pack/unpack kernel"));
  }
  return Status::ok();
}

}  // namespace ddlfast
