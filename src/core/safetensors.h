// Safetensors reader (single file, sharded index, or every *.safetensors in a directory) and a
// small writer used by the demo model and the tests.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/mapped_file.h"

namespace lily {

enum class DType : uint8_t { kBF16, kF16, kF32, kU32, kOther };

const char* dtype_name(DType t);
size_t dtype_size(DType t);            // 0 for kOther

struct TensorInfo {
  std::string name;
  DType dtype = DType::kOther;
  std::string dtype_str;               // as written in the header (kept for kOther messages)
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;       // into the mapped file
  size_t nbytes = 0;
  size_t offset = 0;                   // byte offset of `data` in the file
  const MappedFile* file = nullptr;

  int64_t numel() const;
  const std::string& path() const { return file->path(); }
  std::string shape_str() const;       // "[2, 3]"
};

// One parsed .safetensors file. Every entry's data_offsets are validated against the file size;
// dtypes outside BF16/F16/F32/U32 are kept as kOther so the caller can reject the ones it uses.
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);
  const std::shared_ptr<MappedFile>& file() const { return file_; }
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::shared_ptr<MappedFile> file_;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint directory: DIR/model.safetensors.index.json (weight_map) if present,
// else DIR/model.safetensors, else every *.safetensors in DIR (sorted). Names must be unique.
class TensorSet {
 public:
  static TensorSet open_dir(const std::string& dir);
  const TensorInfo* find(const std::string& name) const;   // nullptr if absent
  const std::map<std::string, TensorInfo>& all() const { return tensors_; }
  const std::vector<std::shared_ptr<MappedFile>>& files() const { return files_; }
  // "DIR/model.safetensors" or "DIR (3 shards: a, b, c)": for messages about absent tensors.
  std::string describe() const;

 private:
  std::string dir_;
  std::vector<std::shared_ptr<MappedFile>> files_;
  std::map<std::string, TensorInfo> tensors_;
};

// A tensor to write: `data` must hold numel * dtype_size bytes.
struct TensorOut {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};

// Writes a .safetensors file (entries in the given order, header padded to 8 bytes).
void write_safetensors(const std::string& path, const std::vector<TensorOut>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// A tensor to write from memory owned elsewhere (no copy): `data` holds numel * dtype_size bytes.
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t nbytes = 0;
};
// Same format as write_safetensors, streamed straight from the views.
void write_safetensors(const std::string& path, const std::vector<TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Helpers to build TensorOut payloads.
TensorOut tensor_f32(std::string name, std::vector<int64_t> shape, const std::vector<float>& v);
TensorOut tensor_bf16(std::string name, std::vector<int64_t> shape, const std::vector<float>& v);
TensorOut tensor_u32(std::string name, std::vector<int64_t> shape, const std::vector<uint32_t>& v);

}  // namespace lily
