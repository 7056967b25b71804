// Safetensors container parsing (8-byte LE header length, JSON header, raw LE data) and writing.
#include "core/safetensors.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "core/common.h"

namespace lily {

namespace fs = std::filesystem;
using nlohmann::json;

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kF32: return "F32";
    case DType::kU32: return "U32";
    default: return "unsupported";
  }
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kBF16:
    case DType::kF16: return 2;
    case DType::kF32:
    case DType::kU32: return 4;
    default: return 0;
  }
}

static DType parse_dtype(const std::string& s) {
  if (s == "BF16") return DType::kBF16;
  if (s == "F16") return DType::kF16;
  if (s == "F32") return DType::kF32;
  if (s == "U32") return DType::kU32;
  return DType::kOther;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorInfo::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Parses one header entry; `where` prefixes every message ("FILE: tensor NAME").
static TensorInfo parse_entry(const std::string& name, const json& e, const MappedFile& f,
                              size_t data_start) {
  const std::string where = f.path() + ": tensor " + name;
  if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
    throw Error(where + ": header entry needs dtype, shape and data_offsets");
  TensorInfo t;
  t.name = name;
  t.file = &f;
  if (!e["dtype"].is_string()) throw Error(where + ": dtype is not a string");
  t.dtype_str = e["dtype"].get<std::string>();
  t.dtype = parse_dtype(t.dtype_str);
  const json& shape = e["shape"];
  if (!shape.is_array()) throw Error(where + ": shape is not an array");
  uint64_t numel = 1;
  for (const json& d : shape) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0) throw Error(where + ": bad shape entry");
    const uint64_t n = d.get<uint64_t>();
    // The product is compared with the file size below; refuse values that would overflow it.
    if (n > (uint64_t(1) << 40) || (n && numel > (uint64_t(1) << 62) / n)) throw Error(where + ": shape too large");
    numel *= n;
    t.shape.push_back(int64_t(n));
  }
  const json& off = e["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
    throw Error(where + ": data_offsets must be two non-negative integers");
  const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
  const uint64_t avail = f.size() - data_start;
  if (begin > end) throw Error(where + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + ") are reversed");
  if (end > avail)
    throw Error(where + ": data_offsets end " + std::to_string(end) + " is past the end of the data (" +
                std::to_string(avail) + " bytes): file truncated?");
  if (t.dtype != DType::kOther && uint64_t(t.numel()) * dtype_size(t.dtype) != end - begin)
    throw Error(where + ": " + std::to_string(end - begin) + " bytes of data for " + t.dtype_str + " " +
                t.shape_str() + " (expected " + std::to_string(uint64_t(t.numel()) * dtype_size(t.dtype)) + ")");
  t.offset = data_start + begin;
  t.nbytes = end - begin;
  t.data = f.data() + t.offset;
  return t;
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile sf;
  sf.file_ = MappedFile::open(path);
  const MappedFile& f = *sf.file_;
  if (f.size() < 8) throw Error(path + ": too small for a safetensors file (" + std::to_string(f.size()) + " bytes)");
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | f.data()[i];
  if (hlen > f.size() - 8)
    throw Error(path + ": header length " + std::to_string(hlen) + " exceeds the file size " +
                std::to_string(f.size()) + ": truncated or not a safetensors file");
  json header;
  try {
    header = json::parse(f.data() + 8, f.data() + 8 + hlen);
  } catch (const json::exception& e) {
    throw Error(path + ": corrupt safetensors header JSON: " + e.what());
  }
  if (!header.is_object()) throw Error(path + ": corrupt safetensors header: not a JSON object");
  const size_t data_start = size_t(8 + hlen);
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (it.value().is_object())
        for (auto m = it.value().begin(); m != it.value().end(); ++m)
          if (m.value().is_string()) sf.metadata_[m.key()] = m.value().get<std::string>();
      continue;
    }
    sf.tensors_.emplace(it.key(), parse_entry(it.key(), it.value(), f, data_start));
  }
  return sf;
}

// ---- directory / sharded checkpoints ---------------------------------------------------------

static void add_file(std::vector<std::shared_ptr<MappedFile>>& files,
                     std::map<std::string, TensorInfo>& all, const std::string& path) {
  SafetensorsFile sf = SafetensorsFile::open(path);
  files.push_back(sf.file());
  for (const auto& [name, info] : sf.tensors()) {
    auto [it, fresh] = all.emplace(name, info);
    if (!fresh)
      throw Error("tensor " + name + " appears in both " + it->second.path() + " and " + path);
  }
}

TensorSet TensorSet::open_dir(const std::string& dir) {
  TensorSet set;
  set.dir_ = dir;
  if (!fs::is_directory(dir)) throw Error(dir + ": not a directory");
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::vector<std::string> shards;
  std::map<std::string, std::string> weight_map;
  if (fs::exists(index)) {
    std::ifstream in(index);
    json j;
    try {
      j = json::parse(in);
    } catch (const json::exception& e) {
      throw Error(index.string() + ": corrupt JSON: " + e.what());
    }
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      throw Error(index.string() + ": missing object 'weight_map'");
    std::set<std::string> seen;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string()) throw Error(index.string() + ": weight_map['" + it.key() + "'] is not a file name");
      const std::string shard = it.value().get<std::string>();
      weight_map[it.key()] = shard;
      if (seen.insert(shard).second) shards.push_back(shard);
    }
    std::sort(shards.begin(), shards.end());
    for (const std::string& s : shards) {
      const fs::path p = fs::path(dir) / s;
      if (!fs::exists(p)) throw Error(index.string() + ": shard " + s + " (listed in weight_map) does not exist");
    }
  } else if (fs::exists(fs::path(dir) / "model.safetensors")) {
    shards.push_back("model.safetensors");
  } else {
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".safetensors") shards.push_back(e.path().filename().string());
    std::sort(shards.begin(), shards.end());
    if (shards.empty()) throw Error(dir + ": no model.safetensors, index or *.safetensors files");
  }
  for (const std::string& s : shards) add_file(set.files_, set.tensors_, (fs::path(dir) / s).string());
  for (const auto& [name, shard] : weight_map) {
    auto it = set.tensors_.find(name);
    const std::string want = (fs::path(dir) / shard).string();
    if (it == set.tensors_.end() || it->second.path() != want)
      throw Error(index.string() + ": weight_map puts tensor " + name + " in " + shard + " but it is not there");
  }
  return set;
}

const TensorInfo* TensorSet::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

std::string TensorSet::describe() const {
  if (files_.size() == 1) return files_[0]->path();
  std::string s = dir_ + " (" + std::to_string(files_.size()) + " shards";
  for (size_t i = 0; i < files_.size() && i < 3; ++i)
    s += std::string(i ? ", " : ": ") + fs::path(files_[i]->path()).filename().string();
  if (files_.size() > 3) s += ", ...";
  return s + ")";
}

// ---- writer -----------------------------------------------------------------------------------

void write_safetensors(const std::string& path, const std::vector<TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const TensorView& t : tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    LILY_CHECK(uint64_t(n) * dtype_size(t.dtype) == t.nbytes, "tensor " + t.name + ": payload size");
    header[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {off, off + t.nbytes}}};
    off += t.nbytes;
  }
  std::string h = header.dump();
  while (h.size() % 8) h += ' ';  // keeps the data section 8-byte aligned, as the format recommends
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw Error(path + ": cannot create");
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(h.size()) >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(h.data(), std::streamsize(h.size()));
  for (const TensorView& t : tensors) out.write(static_cast<const char*>(t.data), std::streamsize(t.nbytes));
  if (!out) throw Error(path + ": write failed (disk full?)");
}

void write_safetensors(const std::string& path, const std::vector<TensorOut>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<TensorView> views;
  views.reserve(tensors.size());
  for (const TensorOut& t : tensors) views.push_back({t.name, t.dtype, t.shape, t.data.data(), t.data.size()});
  write_safetensors(path, views, metadata);
}

TensorOut tensor_f32(std::string name, std::vector<int64_t> shape, const std::vector<float>& v) {
  TensorOut t{std::move(name), DType::kF32, std::move(shape), {}};
  t.data.resize(v.size() * 4);
  std::memcpy(t.data.data(), v.data(), t.data.size());
  return t;
}

TensorOut tensor_bf16(std::string name, std::vector<int64_t> shape, const std::vector<float>& v) {
  TensorOut t{std::move(name), DType::kBF16, std::move(shape), {}};
  t.data.resize(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t b = f32_to_bf16(v[i]);
    std::memcpy(t.data.data() + 2 * i, &b, 2);
  }
  return t;
}

TensorOut tensor_u32(std::string name, std::vector<int64_t> shape, const std::vector<uint32_t>& v) {
  TensorOut t{std::move(name), DType::kU32, std::move(shape), {}};
  t.data.resize(v.size() * 4);
  std::memcpy(t.data.data(), v.data(), t.data.size());
  return t;
}

}  // namespace lily
