// Read-only memory map of a whole file; checkpoint tensors are views into it, never copies.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace lily {

class MappedFile {
 public:
  // Maps `path` read-only. Throws lily::Error naming the file if it cannot be opened or mapped.
  static std::shared_ptr<MappedFile> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Reads one byte per page of [offset, offset+len) so later accesses do not fault; returns
  // a value derived from the bytes so the compiler cannot drop the reads.
  uint64_t touch(size_t offset, size_t len) const;

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size);
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace lily
