// mmap-backed MappedFile (POSIX).
#include "core/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/common.h"

namespace lily {

std::shared_ptr<MappedFile> MappedFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw Error(path + ": cannot stat: " + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(path + ": not a regular file");
  }
  const size_t size = size_t(st.st_size);
  const uint8_t* data = nullptr;
  // mmap of length 0 is invalid; an empty file is represented by a null pointer and size 0.
  if (size > 0) {
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      throw Error(path + ": cannot mmap: " + std::strerror(e));
    }
    data = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping keeps the file alive
  return std::shared_ptr<MappedFile>(new MappedFile(path, data, size));
}

MappedFile::MappedFile(std::string path, const uint8_t* data, size_t size)
    : path_(std::move(path)), data_(data), size_(size) {}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

uint64_t MappedFile::touch(size_t offset, size_t len) const {
  if (!data_ || offset >= size_) return 0;
  if (len > size_ - offset) len = size_ - offset;
  const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  // Ask the kernel to start reading ahead, then fault each page in order.
  const size_t start = offset / page * page;
  ::madvise(const_cast<uint8_t*>(data_) + start, offset + len - start, MADV_WILLNEED);
  uint64_t sum = 0;
  for (size_t i = offset; i < offset + len; i += page) sum += data_[i];
  if (len) sum += data_[offset + len - 1];
  return sum;
}

}  // namespace lily
