// ReceivedBytes' pool of copy buffers (transport.h).
#include "common/transport.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace karat {
namespace {

struct CopyBufferPool {
  absl::Mutex mu;
  std::vector<std::unique_ptr<std::string>> free ABSL_GUARDED_BY(mu);
  size_t free_bytes ABSL_GUARDED_BY(mu) = 0;  // their capacities
};

CopyBufferPool& Pool() {
  // Never destroyed: a ReceivedBytes may be released during static
  // destruction.
  static CopyBufferPool* pool = new CopyBufferPool;
  return *pool;
}

}  // namespace

void ReceivedBytes::ReturnCopyBuffer::operator()(std::string* buffer) const {
  std::unique_ptr<std::string> owned(buffer);
  const size_t bytes = owned->capacity();
  CopyBufferPool& pool = Pool();
  absl::MutexLock lock(&pool.mu);
  if (pool.free.size() < kPooledCopyBuffers &&
      pool.free_bytes + bytes <= kPooledCopyBytes) {
    pool.free_bytes += bytes;
    pool.free.push_back(std::move(owned));
  }
}

size_t ReceivedBytes::FreeCopyBuffers() {
  CopyBufferPool& pool = Pool();
  absl::MutexLock lock(&pool.mu);
  return pool.free.size();
}

ReceivedBytes::CopyBuffer ReceivedBytes::TakeCopyBuffer() {
  CopyBufferPool& pool = Pool();
  {
    absl::MutexLock lock(&pool.mu);
    if (!pool.free.empty()) {
      CopyBuffer buffer(pool.free.back().release());
      pool.free.pop_back();
      pool.free_bytes -= buffer->capacity();
      return buffer;
    }
  }
  return CopyBuffer(new std::string);
}

}  // namespace karat
