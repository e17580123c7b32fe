#include "transport/shared_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace ddlfast {
namespace {

Status failed(const char* call, const std::string& name, int error) {
  return Status(StatusCode::kInternal, std::string(call) + "(" + name + ") failed: " + std::strerror(error));
}

}  // namespace

std::string SharedSegment::unique_name() {
  // The clock's nanoseconds and a stack address (randomized per process) beside the process id: no source that can
  // throw (std::random_device may), and O_EXCL refuses a name that exists all the same.
  const char marker = 0;
  const auto now = static_cast<unsigned long long>(std::chrono::steady_clock::now().time_since_epoch().count());
  const unsigned long long bits =
      now ^ (static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(&marker)) << 20);
  char name[64];
  std::snprintf(name, sizeof name, "/ddlfast-%ld-%016llx", static_cast<long>(getpid()), bits);
  return name;
}

Status SharedSegment::map(const std::string& name, int descriptor, std::size_t bytes,
                          std::unique_ptr<SharedSegment>* out) {
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, descriptor, 0);
  const int error = errno;
  close(descriptor);  // the mapping keeps the object
  if (data == MAP_FAILED) return failed("mmap", name, error);
  *out = std::make_unique<SharedSegment>(Key(), static_cast<char*>(data), bytes);
  return Status::ok();
}

Status SharedSegment::create(const std::string& name, std::size_t bytes, std::unique_ptr<SharedSegment>* out) {
  const int descriptor = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, S_IRUSR | S_IWUSR);
  if (descriptor < 0) return failed("shm_open", name, errno);
  // Zero-filled, as a new object always is: every slot's sequence starts at 0, before any collective's.
  if (ftruncate(descriptor, static_cast<off_t>(bytes)) != 0) {
    const int error = errno;
    close(descriptor);
    shm_unlink(name.c_str());
    return failed("ftruncate", name, error);
  }
  if (const int error = posix_fallocate(descriptor, 0, static_cast<off_t>(bytes)); error != 0) {
    close(descriptor);
    shm_unlink(name.c_str());
    return failed("posix_fallocate", name, error);
  }
  const Status status = map(name, descriptor, bytes, out);
  if (!status.is_ok()) shm_unlink(name.c_str());
  return status;
}

Status SharedSegment::open(const std::string& name, std::size_t bytes, std::unique_ptr<SharedSegment>* out) {
  const int descriptor = shm_open(name.c_str(), O_RDWR, 0);
  if (descriptor < 0) return failed("shm_open", name, errno);
  struct stat info;
  if (fstat(descriptor, &info) != 0 || static_cast<std::size_t>(info.st_size) != bytes) {
    close(descriptor);
    return Status(StatusCode::kInternal, "shared memory object " + name + " is not " + std::to_string(bytes) +
                                             " bytes long (another host's /dev/shm?)");
  }
  return map(name, descriptor, bytes, out);
}

void SharedSegment::unlink(const std::string& name) { shm_unlink(name.c_str()); }

SharedSegment::~SharedSegment() { munmap(data_, bytes_); }

}  // namespace ddlfast
