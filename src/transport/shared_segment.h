// Memory that every rank of one host maps (POSIX shared memory): the slots of the agreement's shared form
// (shared_agreement.cc). One rank creates the object under a random name, the others open it by that name, and the
// creator unlinks the name once every rank has mapped it (or failed to), so nothing is left in /dev/shm. Each rank
// unmaps its own view when its transport goes: no collective at teardown, so a rank that failed or left never
// holds the others up.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "common/status.h"

namespace ddlfast {

class SharedSegment {
 public:
  // A new object of `bytes` bytes under `name` (which must not exist), its memory reserved now, so that a full
  // /dev/shm fails here instead of with SIGBUS at the first touch of a page.
  static Status create(const std::string& name, std::size_t bytes, std::unique_ptr<SharedSegment>* out);
  // Maps the object another rank created under `name`, which must be `bytes` bytes long.
  static Status open(const std::string& name, std::size_t bytes, std::unique_ptr<SharedSegment>* out);
  // Removes the name (the mappings stay valid).
  static void unlink(const std::string& name);
  // A name no other object has (the process id and 64 random bits).
  static std::string unique_name();

  struct Key {  // only the factories above construct one
   private:
    friend class SharedSegment;
    Key() = default;
  };
  SharedSegment(Key, char* data, std::size_t bytes) : data_(data), bytes_(bytes) {}
  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  char* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  static Status map(const std::string& name, int descriptor, std::size_t bytes, std::unique_ptr<SharedSegment>* out);

  char* data_;
  std::size_t bytes_;
};

}  // namespace ddlfast
