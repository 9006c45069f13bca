#include "common/safetensors.h"

#include <stdlib.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/numeric.h"

namespace karat {
namespace {

// A fresh directory under the system temp dir, removed at scope exit.
class TempDir {
 public:
  TempDir() {
    std::string tmpl =
        (std::filesystem::temp_directory_path() / "karat_st_XXXXXX").string();
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A file with the given header text (length prefix added) and data area.
std::string RawFile(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + header + data;
}

// Opens `bytes` written to a file and expects a clean error whose message
// names the file and contains each of `needles`.
void ExpectCorrupt(const TempDir& dir, const std::string& bytes,
                   std::vector<std::string> needles = {}) {
  const std::string path = dir.File("bad.safetensors");
  WriteBytes(path, bytes);
  auto f = SafetensorsFile::Open(path);
  REQUIRE_FALSE(f.ok());
  INFO(f.status().ToString());
  CHECK(absl::StrContains(f.status().message(), path));
  for (const std::string& n : needles) {
    CHECK(absl::StrContains(f.status().message(), n));
  }
}

std::vector<float> Ramp(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = scale * std::sin(static_cast<float>(i) * 0.37f + 0.1f);
  }
  return v;
}

TEST_CASE("F32 round trip keeps values, shapes and metadata", "[safetensors]") {
  TempDir dir;
  const std::vector<float> a = Ramp(6, 3.0f), b = Ramp(5, 1e-3f);
  const float scalar = -7.25f;
  std::vector<TensorToWrite> ts = {
      {"z.weight", {2, 3}, a.data()},
      {"a.bias", {5}, b.data()},
      {"m.scalar", {}, &scalar},
      {"e.empty", {0, 4}, nullptr},
  };
  const std::string path = dir.File("m.safetensors");
  REQUIRE(WriteSafetensors(path, ts, DType::kF32,
                           {{"format", "pt"}, {"note", "a \"quoted\" value"}})
              .ok());
  CHECK_FALSE(std::filesystem::exists(path + ".tmp"));
  // Header length + header is a multiple of 8; the data area is aligned.
  const std::string bytes = ReadBytes(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(bytes[i]);
  CHECK(n % 8 == 0);

  auto f = SafetensorsFile::Open(path);
  REQUIRE(f.ok());
  const auto& file = **f;
  CHECK(file.metadata().at("format") == "pt");
  CHECK(file.metadata().at("note") == "a \"quoted\" value");
  REQUIRE(file.tensors().size() == 4);
  CHECK(file.tensors().begin()->first == "a.bias");  // name order
  const TensorView* z = file.Find("z.weight");
  REQUIRE(z != nullptr);
  CHECK(z->dtype == DType::kF32);
  CHECK(z->shape == std::vector<int64_t>{2, 3});
  CHECK(z->nbytes == 24);
  CHECK(z->ToFloat() == a);
  CHECK(file.Find("a.bias")->ToFloat() == b);
  const TensorView* s = file.Find("m.scalar");
  CHECK(s->shape.empty());
  CHECK(s->NumElements() == 1);
  CHECK(s->ToFloat() == std::vector<float>{scalar});
  CHECK(file.Find("e.empty")->NumElements() == 0);
  CHECK(file.Find("e.empty")->ToFloat().empty());
  CHECK(file.Find("missing") == nullptr);
}

TEST_CASE("BF16 round trip rounds to nearest even", "[safetensors]") {
  TempDir dir;
  std::vector<float> a = Ramp(64, 100.0f);
  a[0] = 1.00390625f;  // 1 + 2^-8: a tie, rounds to 1.0
  const std::string path = dir.File("m.safetensors");
  REQUIRE(WriteSafetensors(path, {{"w", {8, 8}, a.data()}}, DType::kBF16).ok());
  auto f = SafetensorsFile::Open(path);
  REQUIRE(f.ok());
  const TensorView* w = (*f)->Find("w");
  REQUIRE(w != nullptr);
  CHECK(w->dtype == DType::kBF16);
  CHECK(w->nbytes == 128);
  std::vector<float> expect = a;
  RoundThroughBf16(expect.data(), expect.size());
  CHECK(w->ToFloat() == expect);
  CHECK(w->ToFloat()[0] == 1.0f);
}

TEST_CASE("writer refuses bad input", "[safetensors]") {
  TempDir dir;
  const float v[2] = {1, 2};
  const std::string path = dir.File("m.safetensors");
  CHECK_FALSE(
      WriteSafetensors(path, {{"a", {2}, v}, {"a", {2}, v}}, DType::kF32).ok());
  CHECK_FALSE(WriteSafetensors(path, {{"a", {-2}, v}}, DType::kF32).ok());
  CHECK_FALSE(WriteSafetensors(path, {{"a", {2}, nullptr}}, DType::kF32).ok());
  CHECK_FALSE(
      WriteSafetensors(path, {{"__metadata__", {2}, v}}, DType::kF32).ok());
  CHECK_FALSE(
      WriteSafetensors(dir.File("no/such/dir/x"), {{"a", {2}, v}}, DType::kF32)
          .ok());
  CHECK_FALSE(std::filesystem::exists(path));
}

TEST_CASE("reader accepts files written elsewhere", "[safetensors]") {
  TempDir dir;
  // Unsorted keys, metadata last, unpadded header, trailing spaces.
  const float x[2] = {1.5f, -2.0f};
  std::string data(reinterpret_cast<const char*>(x), 8);
  const std::string header =
      R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
      R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
      R"("__metadata__":{"k":"v"}}   )";
  const std::string path = dir.File("ok.safetensors");
  WriteBytes(path, RawFile(header, data));
  auto f = SafetensorsFile::Open(path);
  REQUIRE(f.ok());
  CHECK((*f)->Find("a")->ToFloat() == std::vector<float>{1.5f});
  CHECK((*f)->Find("b")->ToFloat() == std::vector<float>{-2.0f});
  CHECK((*f)->metadata().at("k") == "v");
}

TEST_CASE("reader refuses corrupt files cleanly", "[safetensors]") {
  TempDir dir;
  const std::string data(16, '\0');
  auto one = [](const std::string& dtype, const std::string& shape,
                const std::string& offsets) {
    return absl::StrCat(R"({"t":{"dtype":")", dtype, R"(","shape":)", shape,
                        R"(,"data_offsets":)", offsets, "}}");
  };
  SECTION("missing file") {
    auto f = SafetensorsFile::Open(dir.File("absent.safetensors"));
    REQUIRE_FALSE(f.ok());
    CHECK(f.status().code() == absl::StatusCode::kNotFound);
  }
  SECTION("shorter than the length prefix") {
    ExpectCorrupt(dir, "");
    ExpectCorrupt(dir, std::string(5, '\0'), {"too short"});
  }
  SECTION("header length beyond the file") {
    std::string bytes = RawFile("{}", "");
    bytes[0] = 100;
    ExpectCorrupt(dir, bytes, {"header length"});
    std::string huge(8, '\xff');
    ExpectCorrupt(dir, huge + "{}", {"header length"});
  }
  SECTION("header not JSON or not an object") {
    ExpectCorrupt(dir, RawFile("{\"t\": {", data), {"JSON"});
    ExpectCorrupt(dir, RawFile("[1, 2]", data), {"object"});
    ExpectCorrupt(dir, RawFile(std::string(8, '\0'), data), {"JSON"});
    ExpectCorrupt(dir, RawFile(R"({"t": 1})", data), {"'t'"});
    // Hostile nesting is refused without exhausting the stack.
    ExpectCorrupt(
        dir, RawFile(std::string(100000, '[') + std::string(100000, ']'), data),
        {"nesting"});
    ExpectCorrupt(dir, RawFile(R"({"t": "\ud800"})", data), {"surrogate"});
  }
  SECTION("bad metadata") {
    ExpectCorrupt(dir, RawFile(R"({"__metadata__": {"k": 1}})", data),
                  {"__metadata__"});
    ExpectCorrupt(dir, RawFile(R"({"__metadata__": 3})", data),
                  {"__metadata__"});
  }
  SECTION("unknown or unsupported dtype") {
    ExpectCorrupt(dir, RawFile(one("Q7", "[4]", "[0,16]"), data),
                  {"'t'", "unknown dtype"});
    ExpectCorrupt(dir, RawFile(one("F16", "[8]", "[0,16]"), data),
                  {"'t'", "unsupported dtype F16"});
  }
  SECTION("bad shapes and offsets") {
    ExpectCorrupt(dir, RawFile(one("F32", "[-4]", "[0,16]"), data), {"'t'"});
    ExpectCorrupt(dir, RawFile(one("F32", "[4.5]", "[0,16]"), data), {"'t'"});
    ExpectCorrupt(dir, RawFile(one("F32", "4", "[0,16]"), data), {"'t'"});
    ExpectCorrupt(dir, RawFile(one("F32", "[4]", "[0]"), data), {"'t'"});
    ExpectCorrupt(dir, RawFile(one("F32", "[4]", "[-4,12]"), data), {"'t'"});
    ExpectCorrupt(dir, RawFile(one("F32", "[4]", "[0,32]"), data),
                  {"'t'", "beyond"});
    ExpectCorrupt(dir, RawFile(one("F32", "[0]", "[16,0]"), data),
                  {"'t'", "order"});
    ExpectCorrupt(dir, RawFile(one("F32", "[3]", "[0,16]"), data),
                  {"'t'", "needs 12"});
    ExpectCorrupt(dir, RawFile(one("BF16", "[4]", "[0,16]"), data),
                  {"'t'", "needs 8"});
    ExpectCorrupt(
        dir,
        RawFile(
            one("F32", "[4611686018427387904, 4611686018427387904]", "[0,16]"),
            data),
        {"'t'"});
    // 2^62 F32 elements are 2^64 bytes, which wrapped to 0 and let
    // [0, 0] through (the safetensors fuzz target's
    // regression_bytes_wrap).
    ExpectCorrupt(dir,
                  RawFile(one("F32", "[4611686018427387904]", "[0,0]"), data),
                  {"'t'", "shape too large"});
    ExpectCorrupt(dir,
                  RawFile(one("BF16", "[2305843009213693953]", "[0,2]"), data),
                  {"'t'", "shape too large"});
  }
  SECTION("overlapping tensors") {
    const std::string header =
        R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},)"
        R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
    ExpectCorrupt(dir, RawFile(header, data), {"'b'", "overlap", "'a'"});
  }
}

TEST_CASE("ParseSafetensors reads bytes in memory as Open reads the file",
          "[safetensors]") {
  TempDir dir;
  const std::vector<float> a = Ramp(6, 1.0f);
  const std::string path = dir.File("m.safetensors");
  REQUIRE(WriteSafetensors(path, {{"a", {2, 3}, a.data()}, {"z", {0}, nullptr}},
                           DType::kF32, {{"format", "pt"}})
              .ok());
  const std::string bytes = ReadBytes(path);
  absl::StatusOr<SafetensorsContents> parsed =
      ParseSafetensors(bytes, "in-memory");
  REQUIRE(parsed.ok());
  auto file = SafetensorsFile::Open(path);
  REQUIRE(file.ok());
  CHECK(parsed->metadata == (*file)->metadata());
  REQUIRE(parsed->tensors.size() == (*file)->tensors().size());
  for (const auto& [name, view] : parsed->tensors) {
    const TensorView* mapped = (*file)->Find(name);
    REQUIRE(mapped != nullptr);
    CHECK(view.shape == mapped->shape);
    CHECK(view.nbytes == mapped->nbytes);
    CHECK(view.ToFloat() == mapped->ToFloat());
    // The view points into the bytes given.
    CHECK(view.data >= reinterpret_cast<const uint8_t*>(bytes.data()));
    CHECK(view.data + view.nbytes <=
          reinterpret_cast<const uint8_t*>(bytes.data() + bytes.size()));
  }
  // Errors name what the caller called the bytes.
  absl::StatusOr<SafetensorsContents> bad =
      ParseSafetensors(bytes.substr(0, bytes.size() - 1), "in-memory");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == absl::StatusCode::kDataLoss);
  CHECK(absl::StartsWith(bad.status().message(), "in-memory: "));
  CHECK(absl::StrContains(
      ParseSafetensors("1234567", "in-memory").status().message(),
      "too short"));
}

TEST_CASE("a file truncated anywhere is refused", "[safetensors]") {
  TempDir dir;
  const std::vector<float> a = Ramp(300, 1.0f), b = Ramp(77, 2.0f);
  const std::string good = dir.File("good.safetensors");
  REQUIRE(WriteSafetensors(good,
                           {{"a", {300}, a.data()}, {"b", {7, 11}, b.data()}},
                           DType::kBF16, {{"format", "pt"}})
              .ok());
  const std::string bytes = ReadBytes(good);
  REQUIRE(SafetensorsFile::Open(good).ok());
  for (int k = 0; k < 16; ++k) {
    const size_t len = bytes.size() * k / 16;
    INFO("truncated to " << len << " of " << bytes.size());
    ExpectCorrupt(dir, bytes.substr(0, len));
  }
  // One byte short names the last tensor.
  ExpectCorrupt(dir, bytes.substr(0, bytes.size() - 1), {"'b'", "truncated"});
}

}  // namespace
}  // namespace karat
