#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/json.h"
#include "common/numeric.h"
#include "common/status_macros.h"

namespace karat {
namespace {

// Tensors are stored little-endian and read and written with plain copies.
static_assert(std::endian::native == std::endian::little);

// Other dtypes of the safetensors format: recognised so that the error can
// say "unsupported" rather than "unknown".
constexpr const char* kOtherDtypes[] = {
    "F64", "F16", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16",
    "I8",  "U64", "U32",     "U16",     "U8",  "BOOL"};

// 2^62 bytes: far beyond any file, small enough that sums cannot overflow.
constexpr uint64_t kMaxBytes = uint64_t{1} << 62;

// The status for a failed system call: errno's code and text after `what`.
absl::Status ErrnoError(int err, const std::string& what) {
  return absl::Status(absl::ErrnoToStatusCode(err),
                      absl::StrCat(what, ": ", std::strerror(err)));
}

absl::Status Corrupt(const std::string& path, const std::string& msg) {
  return absl::DataLossError(absl::StrCat(path, ": ", msg));
}

absl::Status TensorCorrupt(const std::string& path, const std::string& name,
                           const std::string& msg) {
  return absl::DataLossError(
      absl::StrCat(path, ": tensor '", name, "': ", msg));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status TooShort(const std::string& path, uint64_t size) {
  return Corrupt(path, absl::StrCat("file of ", size,
                                    " bytes is too short for the 8-byte "
                                    "header length"));
}

struct Entry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

absl::Status ParseEntry(const std::string& path, const std::string& name,
                        const JsonValue& v, uint64_t data_size, Entry* e) {
  e->name = name;
  if (!v.is_object())
    return TensorCorrupt(path, name, "entry is not an object");
  const JsonValue* dtype = v.Find("dtype");
  if (dtype == nullptr || dtype->kind != JsonValue::Kind::kString) {
    return TensorCorrupt(path, name, "missing or non-string 'dtype'");
  }
  if (dtype->text == "F32") {
    e->dtype = DType::kF32;
  } else if (dtype->text == "BF16") {
    e->dtype = DType::kBF16;
  } else {
    for (const char* other : kOtherDtypes) {
      if (dtype->text == other) {
        return TensorCorrupt(path, name,
                             absl::StrCat("unsupported dtype ", dtype->text,
                                          " (F32 and BF16 are supported)"));
      }
    }
    return TensorCorrupt(
        path, name, absl::StrCat("unknown dtype ", JsonQuote(dtype->text)));
  }
  const JsonValue* shape = v.Find("shape");
  if (shape == nullptr || shape->kind != JsonValue::Kind::kArray) {
    return TensorCorrupt(path, name, "missing or non-array 'shape'");
  }
  uint64_t elements = 1;
  for (const JsonValue& d : shape->array) {
    int64_t dim;
    if (!d.AsInt64(&dim) || dim < 0) {
      return TensorCorrupt(path, name,
                           "shape entries must be non-negative integers");
    }
    e->shape.push_back(dim);
    if (dim != 0 && elements > kMaxBytes / static_cast<uint64_t>(dim)) {
      return TensorCorrupt(path, name, "shape too large");
    }
    elements *= static_cast<uint64_t>(dim);
  }
  // The bytes, not only the elements, stay within kMaxBytes: 2^62 F32
  // elements would wrap to 0 bytes.
  if (elements > kMaxBytes / DTypeSize(e->dtype)) {
    return TensorCorrupt(path, name, "shape too large");
  }
  const JsonValue* offsets = v.Find("data_offsets");
  if (offsets == nullptr || offsets->kind != JsonValue::Kind::kArray ||
      offsets->array.size() != 2) {
    return TensorCorrupt(path, name, "'data_offsets' must be [begin, end]");
  }
  int64_t begin, end;
  if (!offsets->array[0].AsInt64(&begin) || !offsets->array[1].AsInt64(&end) ||
      begin < 0 || end < 0) {
    return TensorCorrupt(path, name,
                         "data_offsets must be non-negative integers");
  }
  if (begin > end) {
    return TensorCorrupt(path, name,
                         absl::StrCat("data_offsets out of order: begin ",
                                      begin, " > end ", end));
  }
  e->begin = static_cast<uint64_t>(begin);
  e->end = static_cast<uint64_t>(end);
  if (e->end > data_size) {
    return TensorCorrupt(path, name,
                         absl::StrCat("data_offsets [", begin, ", ", end,
                                      ") beyond the data area of ", data_size,
                                      " bytes (file truncated?)"));
  }
  const uint64_t expected = elements * DTypeSize(e->dtype);
  if (e->end - e->begin != expected) {
    return TensorCorrupt(
        path, name,
        absl::StrCat("holds ", e->end - e->begin, " bytes but shape ",
                     ShapeString(e->shape), " x ", dtype->text, " needs ",
                     expected));
  }
  return absl::OkStatus();
}

}  // namespace

const char* DTypeName(DType d) {
  switch (d) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
  }
  return "unknown";
}

size_t DTypeSize(DType d) {
  switch (d) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
      return 2;
  }
  return 0;
}

int64_t TensorView::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<float> TensorView::ToFloat() const {
  const size_t n = static_cast<size_t>(NumElements());
  std::vector<float> out(n);
  if (dtype == DType::kF32) {
    // memcpy's pointers must not be null even for 0 bytes, and an empty
    // vector's data() may be.
    if (n != 0) std::memcpy(out.data(), data, n * sizeof(float));
  } else {
    // The data area need not be 2-byte aligned, hence memcpy per value.
    for (size_t i = 0; i < n; ++i) {
      uint16_t b;
      std::memcpy(&b, data + 2 * i, sizeof b);
      out[i] = Bf16ToFloat(b);
    }
  }
  return out;
}

absl::StatusOr<SafetensorsContents> ParseSafetensors(std::string_view bytes,
                                                     const std::string& path) {
  const uint64_t size = bytes.size();
  if (size < 8) return TooShort(path, size);
  const uint8_t* base = reinterpret_cast<const uint8_t*>(bytes.data());
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | base[i];
  if (header_len > size - 8) {
    return Corrupt(
        path, absl::StrCat("header length ", header_len, " exceeds the file (",
                           size, " bytes; truncated?)"));
  }
  const std::string_view header(reinterpret_cast<const char*>(base + 8),
                                header_len);
  absl::StatusOr<JsonValue> doc = ParseJson(header);
  if (!doc.ok()) {
    return Corrupt(path, absl::StrCat("header is not valid JSON: ",
                                      doc.status().message()));
  }
  if (!doc->is_object()) return Corrupt(path, "header is not a JSON object");

  SafetensorsContents contents;
  const uint64_t data_start = 8 + header_len;
  const uint64_t data_size = size - data_start;
  std::vector<Entry> entries;
  for (const auto& [name, value] : doc->object) {
    if (name == "__metadata__") {
      if (!value.is_object()) {
        return Corrupt(path, "'__metadata__' is not an object");
      }
      for (const auto& [k, v] : value.object) {
        if (v.kind != JsonValue::Kind::kString) {
          return Corrupt(path, absl::StrCat("'__metadata__' value '", k,
                                            "' is not a string"));
        }
        contents.metadata[k] = v.text;
      }
      continue;
    }
    Entry e;
    RETURN_IF_ERROR(ParseEntry(path, name, value, data_size, &e));
    entries.push_back(std::move(e));
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < entries.size(); ++i) {
    if (entries[i].begin < entries[i - 1].end) {
      return TensorCorrupt(
          path, entries[i].name,
          absl::StrCat("data_offsets [", entries[i].begin, ", ", entries[i].end,
                       ") overlap tensor '", entries[i - 1].name, "' [",
                       entries[i - 1].begin, ", ", entries[i - 1].end, ")"));
    }
  }
  for (Entry& e : entries) {
    TensorView view;
    view.name = e.name;
    view.dtype = e.dtype;
    view.shape = std::move(e.shape);
    view.data = base + data_start + e.begin;
    view.nbytes = static_cast<size_t>(e.end - e.begin);
    contents.tensors.emplace(e.name, std::move(view));
  }
  return contents;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(
    const std::string& path) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return ErrnoError(errno, path);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::InternalError(
        absl::StrCat(path, ": fstat: ", std::strerror(err)));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return TooShort(path, size);
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);
  if (map == MAP_FAILED) {
    return absl::InternalError(
        absl::StrCat(path, ": mmap: ", std::strerror(map_err)));
  }
  // Owned by `file` from here on, so every error path unmaps it.
  file->map_ = map;
  file->map_size_ = size;
  ASSIGN_OR_RETURN(
      SafetensorsContents contents,
      ParseSafetensors(std::string_view(static_cast<const char*>(map), size),
                       path));
  file->tensors_ = std::move(contents.tensors);
  file->metadata_ = std::move(contents.metadata);
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
}

const TensorView* SafetensorsFile::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::Status WriteSafetensors(
    const std::string& path, const std::vector<TensorToWrite>& tensors,
    DType dtype, const std::map<std::string, std::string>& metadata) {
  std::vector<const TensorToWrite*> sorted;
  for (const TensorToWrite& t : tensors) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(),
            [](const TensorToWrite* a, const TensorToWrite* b) {
              return a->name < b->name;
            });
  std::vector<uint64_t> counts;
  for (size_t i = 0; i < sorted.size(); ++i) {
    const TensorToWrite& t = *sorted[i];
    if (t.name == "__metadata__") {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": '__metadata__' is not a tensor name"));
    }
    if (i > 0 && sorted[i - 1]->name == t.name) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", t.name, "' given twice"));
    }
    uint64_t n = 1;
    for (int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": tensor '", t.name, "': negative shape ",
                         ShapeString(t.shape)));
      }
      n *= static_cast<uint64_t>(d);
    }
    if (n > 0 && t.values == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", t.name, "': no values"));
    }
    counts.push_back(n);
  }

  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      if (!first) header += ",";
      first = false;
      absl::StrAppend(&header, JsonQuote(k), ":", JsonQuote(v));
    }
    header += "}";
  }
  const size_t esize = DTypeSize(dtype);
  uint64_t offset = 0;
  for (size_t i = 0; i < sorted.size(); ++i) {
    const uint64_t bytes = counts[i] * esize;
    if (header.size() > 1) header += ",";
    absl::StrAppend(&header, JsonQuote(sorted[i]->name), ":{\"dtype\":\"",
                    DTypeName(dtype),
                    "\",\"shape\":", ShapeString(sorted[i]->shape),
                    ",\"data_offsets\":[", offset, ",", offset + bytes, "]}");
    offset += bytes;
  }
  header += "}";
  // Padding keeps the data area 8-byte aligned in the file.
  header.append((8 - header.size() % 8) % 8, ' ');

  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    return ErrnoError(errno, tmp);
  }
  bool ok = true;
  uint8_t len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<uint8_t>(header.size() >> (8 * i));
  ok = ok && std::fwrite(len, 1, 8, f) == 8;
  ok = ok && std::fwrite(header.data(), 1, header.size(), f) == header.size();
  std::vector<uint16_t> buf;
  for (size_t i = 0; i < sorted.size() && ok; ++i) {
    const size_t n = static_cast<size_t>(counts[i]);
    if (n == 0) continue;
    if (dtype == DType::kF32) {
      ok = std::fwrite(sorted[i]->values, sizeof(float), n, f) == n;
    } else {
      buf.resize(n);
      FloatToBf16(sorted[i]->values, n, buf.data());
      ok = std::fwrite(buf.data(), sizeof(uint16_t), n, f) == n;
    }
  }
  ok = (std::fflush(f) == 0) && ok;
  const int err = errno;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    return ErrnoError(err, absl::StrCat(tmp, ": write failed"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int rerr = errno;
    std::remove(tmp.c_str());
    return ErrnoError(rerr, absl::StrCat("rename ", tmp, " -> ", path));
  }
  return absl::OkStatus();
}

}  // namespace karat
