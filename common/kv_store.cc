#include "common/kv_store.h"

#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

// GCC 12 reports its own AVX-512 intrinsic headers (_mm512_undefined_*)
// as (maybe-)uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace karat {
namespace {

size_t AlignUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

// The key in each slot of a block's pair rows (IndexKeySlot inverted).
struct SlotKeys {
  uint8_t key[kIndexKeyBlock];
  constexpr SlotKeys() : key() {
    for (int j = 0; j < kIndexKeyBlock; ++j) key[IndexKeySlot(j)] = uint8_t(j);
  }
};
constexpr SlotKeys kSlotKeys;

// Writes the 32 keys at `codes` (token-major, `dim` codes each, dim a
// multiple of 16) into a whole block's pair rows. Per 16 codes (8 pairs) of
// every key: the keys' 16-byte pieces go into the 128-bit lanes of 8
// registers (register i, lane L: the key of slot 8 L + i), and an 8 x 8
// transpose of 16-bit pairs within each lane leaves register w holding
// pair w of the keys in slot order: one row.
void PutIndexKeyBlock(const uint8_t* codes, int dim, uint8_t* rows) {
  for (int off = 0; off < dim; off += 16) {
    __m512i r[8];
    for (int i = 0; i < 8; ++i) {
      auto piece = [&](int lane) {
        return _mm_loadu_si128(reinterpret_cast<const __m128i*>(
            codes + size_t(kSlotKeys.key[8 * lane + i]) * dim + off));
      };
      __m512i v = _mm512_castsi128_si512(piece(0));
      v = _mm512_inserti32x4(v, piece(1), 1);
      v = _mm512_inserti32x4(v, piece(2), 2);
      r[i] = _mm512_inserti32x4(v, piece(3), 3);
    }
    __m512i a[4], b[4], c[4], d[4];
    for (int k = 0; k < 4; ++k) {
      a[k] = _mm512_unpacklo_epi16(r[2 * k], r[2 * k + 1]);
      b[k] = _mm512_unpackhi_epi16(r[2 * k], r[2 * k + 1]);
    }
    c[0] = _mm512_unpacklo_epi32(a[0], a[1]);
    c[1] = _mm512_unpackhi_epi32(a[0], a[1]);
    c[2] = _mm512_unpacklo_epi32(a[2], a[3]);
    c[3] = _mm512_unpackhi_epi32(a[2], a[3]);
    d[0] = _mm512_unpacklo_epi32(b[0], b[1]);
    d[1] = _mm512_unpackhi_epi32(b[0], b[1]);
    d[2] = _mm512_unpacklo_epi32(b[2], b[3]);
    d[3] = _mm512_unpackhi_epi32(b[2], b[3]);
    const __m512i o[8] = {
        _mm512_unpacklo_epi64(c[0], c[2]), _mm512_unpackhi_epi64(c[0], c[2]),
        _mm512_unpacklo_epi64(c[1], c[3]), _mm512_unpackhi_epi64(c[1], c[3]),
        _mm512_unpacklo_epi64(d[0], d[2]), _mm512_unpackhi_epi64(d[0], d[2]),
        _mm512_unpacklo_epi64(d[1], d[3]), _mm512_unpackhi_epi64(d[1], d[3])};
    uint8_t* row = rows + size_t(off / 2) * 64;
    for (int w = 0; w < 8; ++w) {
      _mm512_storeu_si512(row + size_t(w) * 64, o[w]);
    }
  }
}

// Writes the codes of `n` keys (token-major; null: zero codes) into slots
// [slot, slot + n) of one index page.
void PutIndexKeys(const KvLayout& l, uint8_t* page, int slot, int n,
                  const uint8_t* codes) {
  const int dim = l.index_dim, pairs = l.IndexPairs();
  uint8_t* ikey = page + l.ikey_offset;
  for (int i = 0; i < n;) {
    const int o = slot + i;
    uint8_t* rows = ikey + size_t(o / kIndexKeyBlock) * l.IndexBlockBytes();
    const int j = o % kIndexKeyBlock;
    if (codes != nullptr && j == 0 && n - i >= kIndexKeyBlock &&
        dim % 16 == 0) {
      PutIndexKeyBlock(codes + size_t(i) * dim, dim, rows);
      i += kIndexKeyBlock;
      continue;
    }
    uint8_t* at = rows + 2 * IndexKeySlot(j);
    const uint8_t* key = codes == nullptr ? nullptr : codes + size_t(i) * dim;
    for (int p = 0; p < pairs; ++p) {
      at[size_t(p) * 64] = key == nullptr ? 0 : key[2 * p];
      at[size_t(p) * 64 + 1] =
          key == nullptr || 2 * p + 1 >= dim ? 0 : key[2 * p + 1];
    }
    ++i;
  }
}

// Writes one token's kv_dim values (entry order) into the page's slot,
// each part into its section.
void PutEntry(const KvLayout& l, uint8_t* page, int slot, const uint16_t* kv) {
  for (int p = 0; p < l.kv_parts; ++p) {
    std::memcpy(page + l.PartOffset(p, slot), kv + l.PartStart(p),
                size_t(l.PartDim(p)) * 2);
  }
}

}  // namespace

void LayerView::ReadKv(int pos, uint16_t* out) const {
  for (int p = 0; p < layout->kv_parts; ++p) {
    std::memcpy(out + layout->PartStart(p), Part(pos, p),
                size_t(layout->PartDim(p)) * 2);
  }
}

void LayerView::PartRows(const int32_t* positions, int n, int part,
                         const uint16_t** out) const {
  const int tpp = layout->tokens_per_page;
  if (tpp <= 0 || (tpp & (tpp - 1)) != 0) {
    for (int j = 0; j < n; ++j) out[j] = Part(positions[j], part);
    return;
  }
  const int shift = __builtin_ctz(unsigned(tpp));
  const uint32_t mask = uint32_t(tpp - 1);
  const size_t row = size_t(layout->PartDim(part)) * 2;
  const size_t kv_offset = layout->PartOffset(part, 0);
  for (int j = 0; j < n; ++j) {
    const uint32_t pos = uint32_t(positions[j]);
    out[j] = reinterpret_cast<const uint16_t*>(pages[pos >> shift] + kv_offset +
                                               size_t(pos & mask) * row);
  }
}

void LayerView::IndexKeyCodes(int pos, uint8_t* codes) const {
  const int itpp = layout->index_tokens_per_page;
  const int o = pos % itpp;
  const uint8_t* at = IndexKeyBlock(pos / itpp, o / kIndexKeyBlock) +
                      2 * IndexKeySlot(o % kIndexKeyBlock);
  for (int d = 0; d < layout->index_dim; ++d) {
    codes[d] = at[size_t(d / 2) * 64 + d % 2];
  }
}

size_t KvLayout::TokenBytes() const {
  return size_t(kv_dim) * 2 + size_t(index_dim) + (index_dim > 0 ? 4 : 0);
}

KvLayout MakeKvLayout(const ModelConfig& config, int tokens_per_page) {
  KvLayout l;
  l.tokens_per_page = tokens_per_page;
  l.num_layers = config.num_hidden_layers;
  switch (config.attention.type) {
    case AttentionType::kMlaDsa:
      l.kv_dim = config.kv_lora_rank + config.qk_rope_head_dim;
      l.index_dim = config.index_head_dim;
      break;
    case AttentionType::kGqaBlock:
      // k and v per KV head, plus the block indexer's keys (bf16, parts
      // after the k and v ones).
      l.kv_dim = 2 * config.num_key_value_heads * config.head_dim +
                 config.num_key_value_heads * config.index_head_dim;
      l.index_dim = 0;
      l.kv_parts = 3 * config.num_key_value_heads;
      l.wide_parts = 2 * config.num_key_value_heads;
      l.part_dim = config.head_dim;
      l.tail_dim = config.index_head_dim;
      break;
    case AttentionType::kGqaDense:
      l.kv_dim = 2 * config.num_key_value_heads * config.head_dim;
      l.index_dim = 0;
      l.kv_parts = l.wide_parts = 2 * config.num_key_value_heads;
      l.part_dim = config.head_dim;
      break;
  }
  l.kv_offset = 0;
  l.page_bytes = AlignUp(size_t(tokens_per_page) * l.kv_dim * 2, 64);
  if (l.index_dim > 0) {
    // As many blocks (rows, then 32 scales each) as the KV page's size
    // holds; at least one, the page growing to fit it.
    const size_t block = l.IndexBlockBytes() + kIndexKeyBlock * 4;
    l.page_bytes = std::max(l.page_bytes, AlignUp(block, 64));
    l.index_tokens_per_page = int(l.page_bytes / block) * kIndexKeyBlock;
    l.ikey_offset = 0;
    l.iscale_offset =
        size_t(l.IndexBlocksPerPage()) * l.IndexBlockBytes();  // 64-aligned
  }
  return l;
}

absl::StatusOr<std::unique_ptr<PageArena>> PageArena::Create(
    size_t capacity_bytes, size_t page_bytes) {
  if (page_bytes == 0) return absl::InvalidArgumentError("page size is 0");
  const size_t pages = capacity_bytes / page_bytes;
  if (pages == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device capacity ", capacity_bytes,
                     " bytes is smaller than one page (", page_bytes, ")"));
  }
  if (pages > size_t(INT32_MAX)) {
    return absl::InvalidArgumentError("device capacity too large");
  }
  std::unique_ptr<PageArena> a(new PageArena());
  a->page_bytes_ = page_bytes;
  a->total_pages_ = static_cast<int>(pages);
  a->map_bytes_ = AlignUp(pages * page_bytes, 2 << 20);
  void* p = mmap(nullptr, a->map_bytes_, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", a->map_bytes_, " bytes for a device"));
  }
  madvise(p, a->map_bytes_, MADV_HUGEPAGE);
  a->base_ = static_cast<uint8_t*>(p);
  a->free_list_.reserve(pages);
  // Lowest ids are handed out first.
  for (int i = a->total_pages_ - 1; i >= 0; --i) a->free_list_.push_back(i);
  return a;
}

PageArena::~PageArena() {
  if (base_ != nullptr) munmap(base_, map_bytes_);
}

absl::Status PageArena::Allocate(int n, std::vector<int32_t>* pages) {
  std::lock_guard<std::mutex> lock(mu_);
  if (n < 0 || size_t(n) > free_list_.size()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("need ", n, " pages of ", page_bytes_, " bytes, ",
                     free_list_.size(), " free of ", total_pages_));
  }
  for (int i = 0; i < n; ++i) {
    pages->push_back(free_list_.back());
    free_list_.pop_back();
  }
  return absl::OkStatus();
}

void PageArena::Free(const std::vector<int32_t>& pages) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int32_t p : pages) free_list_.push_back(p);
}

int PageArena::free_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(free_list_.size());
}

size_t PageArena::used_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return size_t(total_pages_ - int(free_list_.size())) * page_bytes_;
}

namespace {

// The order in which a session draws on its arenas: the home (index 0)
// first, then the others by decreasing free pages, ties in index order.
std::vector<int> SpillOrder(const std::vector<int>& free_pages) {
  std::vector<int> order;
  for (size_t i = 0; i < free_pages.size(); ++i) order.push_back(int(i));
  if (order.size() > 1) {
    std::stable_sort(order.begin() + 1, order.end(), [&](int a, int b) {
      return free_pages[a] > free_pages[b];
    });
  }
  return order;
}

}  // namespace

absl::StatusOr<std::vector<int>> PlanPageSpill(
    const std::vector<int>& free_pages, int need) {
  std::vector<int> take(free_pages.size(), 0);
  if (need < 0) {
    return absl::InvalidArgumentError(absl::StrCat("need ", need, " pages"));
  }
  if (need == 0) return take;
  int64_t total = 0;
  for (int f : free_pages) total += std::max(f, 0);
  if (free_pages.empty() || total < need) {
    return absl::ResourceExhaustedError(
        absl::StrCat("need ", need, " pages, ", total, " free on ",
                     free_pages.size(), " arena(s)"));
  }
  int left = need;
  for (int i : SpillOrder(free_pages)) {
    if (left == 0) break;
    take[i] = std::min(std::max(free_pages[i], 0), left);
    left -= take[i];
  }
  return take;
}

SessionCache::SessionCache(const KvLayout* layout, PageArena* arena)
    : SessionCache(layout, std::vector<PageArena*>{arena}) {}

SessionCache::SessionCache(const KvLayout* layout,
                           std::vector<PageArena*> arenas)
    : layout_(layout),
      arenas_(std::move(arenas)),
      pages_(layout->num_layers),
      index_pages_(layout->num_layers),
      page_data_(layout->num_layers),
      index_page_data_(layout->num_layers),
      lengths_(layout->num_layers, 0),
      pages_per_arena_(arenas_.size(), 0) {}

SessionCache::~SessionCache() {
  for (const auto& p : pages_) ReturnPages(p.data(), p.size());
  for (const auto& p : index_pages_) ReturnPages(p.data(), p.size());
  ReturnPages(metadata_pages_.data(), metadata_pages_.size());
}

absl::Status SessionCache::TakePages(int n, std::vector<PageRef>* out) {
  if (n <= 0) return absl::OkStatus();
  // The free counts are a snapshot: another owner may take pages of a
  // shared arena between the plan and the allocation, so a failed
  // allocation returns what was taken and plans again.
  absl::Status last;
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::vector<int> free_pages;
    free_pages.reserve(arenas_.size());
    for (PageArena* a : arenas_) free_pages.push_back(a->free_pages());
    absl::StatusOr<std::vector<int>> plan = PlanPageSpill(free_pages, n);
    if (!plan.ok()) return plan.status();
    // Home pages first, then each spill arena in the plan's order.
    const size_t first = out->size();
    last = absl::OkStatus();
    for (int i : SpillOrder(free_pages)) {
      if ((*plan)[i] == 0) continue;
      std::vector<int32_t> ids;
      last = arenas_[i]->Allocate((*plan)[i], &ids);
      if (!last.ok()) break;
      for (int32_t id : ids) out->push_back(PageRef{i, id});
      pages_per_arena_[i] += int(ids.size());
    }
    if (last.ok()) return last;
    ReturnPages(out->data() + first, out->size() - first);
    out->resize(first);
  }
  return last;
}

void SessionCache::ReturnPages(const PageRef* pages, size_t n) {
  std::vector<int32_t> ids;
  for (size_t a = 0; a < arenas_.size(); ++a) {
    ids.clear();
    for (size_t i = 0; i < n; ++i) {
      if (pages[i].arena == int32_t(a)) ids.push_back(pages[i].id);
    }
    if (!ids.empty()) arenas_[a]->Free(ids);
    pages_per_arena_[a] -= int(ids.size());
  }
}

int SessionCache::Capacity() const {
  if (pages_.empty()) return 0;
  int cap = int(pages_[0].size()) * layout_->tokens_per_page;
  if (layout_->index_tokens_per_page > 0) {
    cap = std::min(
        cap, int(index_pages_[0].size()) * layout_->index_tokens_per_page);
  }
  return cap;
}

absl::Status SessionCache::Reserve(int tokens) {
  if (tokens <= reserved_tokens_) return absl::OkStatus();
  if (pages_.empty()) {  // no layers: nothing to hold
    reserved_tokens_ = tokens;
    return absl::OkStatus();
  }
  const int more_kv =
      std::max(layout_->KvPagesFor(tokens) - int(pages_[0].size()), 0);
  const int more_index =
      std::max(layout_->IndexPagesFor(tokens) - int(index_pages_[0].size()), 0);
  std::vector<PageRef> fresh;
  absl::Status st =
      TakePages((more_kv + more_index) * layout_->num_layers, &fresh);
  if (!st.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot reserve ", tokens, " tokens: ", st.message()));
  }
  // Layer by layer, so that the home's pages go to the first layers, and a
  // layer's new index pages follow one another.
  size_t k = 0;
  for (size_t l = 0; l < pages_.size(); ++l) {
    for (int i = 0; i < more_kv; ++i, ++k) {
      pages_[l].push_back(fresh[k]);
      page_data_[l].push_back(PageAddress(fresh[k]));
    }
    for (int i = 0; i < more_index; ++i, ++k) {
      index_pages_[l].push_back(fresh[k]);
      index_page_data_[l].push_back(PageAddress(fresh[k]));
    }
  }
  reserved_tokens_ = Capacity();
  return absl::OkStatus();
}

absl::Status SessionCache::ChargeMetadata(size_t bytes) {
  const size_t pb = layout_->page_bytes;
  const size_t want = (bytes + pb - 1) / pb;
  const size_t have = metadata_pages_.size();
  if (want > have) {
    if (want - have > size_t(INT32_MAX)) {
      return absl::ResourceExhaustedError(
          absl::StrCat(bytes, " bytes of metadata"));
    }
    absl::Status st = TakePages(int(want - have), &metadata_pages_);
    if (!st.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot hold ", bytes, " bytes of metadata (",
                       want - have, " more pages): ", st.message()));
    }
  } else if (want < have) {
    // The last taken (spilled ones, if any) go back first.
    ReturnPages(metadata_pages_.data() + want, have - want);
    metadata_pages_.resize(want);
  }
  return absl::OkStatus();
}

void SessionCache::Truncate(int layer, int length) {
  if (length < lengths_[layer]) lengths_[layer] = std::max(length, 0);
}

absl::Status SessionCache::Append(int layer, const uint16_t* kv,
                                  const uint8_t* index_key, float index_scale) {
  const int pos = lengths_[layer];
  RETURN_IF_ERROR(WriteKv(layer, pos, kv));
  if (layout_->index_dim > 0) {
    RETURN_IF_ERROR(WriteIndexKey(layer, pos, index_key,
                                  index_key == nullptr ? 0.0f : index_scale));
  }
  lengths_[layer] = pos + 1;
  return absl::OkStatus();
}

absl::Status SessionCache::WriteKv(int layer, int pos, const uint16_t* kv) {
  if (pos < 0 || pos >= reserved_tokens_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("position ", pos, " is beyond the ", reserved_tokens_,
                     " reserved tokens"));
  }
  const int tpp = layout_->tokens_per_page;
  PutEntry(*layout_, page_data_[layer][pos / tpp], pos % tpp, kv);
  return absl::OkStatus();
}

absl::Status SessionCache::WriteIndexKey(int layer, int pos,
                                         const uint8_t* codes, float scale) {
  if (pos < 0 || pos >= reserved_tokens_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("position ", pos, " is beyond the ", reserved_tokens_,
                     " reserved tokens"));
  }
  if (layout_->index_dim == 0) {
    return absl::FailedPreconditionError("this layout has no index keys");
  }
  const int itpp = layout_->index_tokens_per_page;
  uint8_t* page = index_page_data_[layer][pos / itpp];
  PutIndexKeys(*layout_, page, pos % itpp, 1, codes);
  reinterpret_cast<float*>(page + layout_->iscale_offset)[pos % itpp] = scale;
  return absl::OkStatus();
}

absl::Status SessionCache::WriteKvRun(int layer, int pos, int n,
                                      const uint16_t* kv) {
  if (pos < 0 || n < 0 || pos + n > reserved_tokens_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("positions [", pos, ", ", pos + n, ") are beyond the ",
                     reserved_tokens_, " reserved tokens"));
  }
  const int tpp = layout_->tokens_per_page;
  const size_t row = size_t(layout_->kv_dim) * 2;
  const auto* src = reinterpret_cast<const uint8_t*>(kv);
  for (int i = 0; i < n;) {
    const int p = pos + i;
    const int run = std::min(n - i, tpp - p % tpp);
    uint8_t* page = page_data_[layer][p / tpp];
    if (layout_->kv_parts == 1) {
      std::memcpy(page + layout_->PartOffset(0, p % tpp), src + size_t(i) * row,
                  size_t(run) * row);
    } else {
      for (int t = 0; t < run; ++t) {
        PutEntry(*layout_, page, p % tpp + t,
                 kv + size_t(i + t) * layout_->kv_dim);
      }
    }
    i += run;
  }
  return absl::OkStatus();
}

absl::Status SessionCache::WriteIndexKeyRun(int layer, int pos, int n,
                                            const uint8_t* codes,
                                            const float* scales) {
  if (pos < 0 || n < 0 || pos + n > reserved_tokens_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("positions [", pos, ", ", pos + n, ") are beyond the ",
                     reserved_tokens_, " reserved tokens"));
  }
  if (layout_->index_dim == 0) {
    return absl::FailedPreconditionError("this layout has no index keys");
  }
  const int itpp = layout_->index_tokens_per_page;
  const size_t row = size_t(layout_->index_dim);
  for (int i = 0; i < n;) {
    const int p = pos + i;
    const int run = std::min(n - i, itpp - p % itpp);
    uint8_t* page = index_page_data_[layer][p / itpp];
    PutIndexKeys(*layout_, page, p % itpp, run, codes + size_t(i) * row);
    std::memcpy(
        reinterpret_cast<float*>(page + layout_->iscale_offset) + p % itpp,
        scales + i, size_t(run) * sizeof(float));
    i += run;
  }
  return absl::OkStatus();
}

void SessionCache::SetLength(int layer, int length) {
  lengths_[layer] = std::clamp(length, 0, reserved_tokens_);
}

LayerView SessionCache::View(int layer) const {
  LayerView v;
  v.layout = layout_;
  v.pages = page_data_[layer].data();
  v.index_pages = index_page_data_[layer].data();
  v.length = lengths_[layer];
  return v;
}

size_t SessionCache::bytes() const {
  size_t n = metadata_pages_.size();
  for (const auto& p : pages_) n += p.size();
  for (const auto& p : index_pages_) n += p.size();
  return n * layout_->page_bytes;
}

int SessionCache::SpilledPositions(int layer) const {
  bool spilled = false;
  for (size_t a = 1; a < pages_per_arena_.size(); ++a) {
    spilled = spilled || pages_per_arena_[a] > 0;
  }
  if (!spilled) return 0;
  const int len = lengths_[layer];
  // Walks the positions in runs over which neither kind of page changes.
  const int tpp = layout_->tokens_per_page;
  const int itpp = layout_->index_tokens_per_page;
  const auto& kv = pages_[layer];
  const auto& ix = index_pages_[layer];
  int n = 0;
  for (int pos = 0; pos < len;) {
    int end = std::min(len, (pos / tpp + 1) * tpp);
    bool away = kv[pos / tpp].arena != 0;
    if (itpp > 0) {
      end = std::min(end, (pos / itpp + 1) * itpp);
      away = away || ix[pos / itpp].arena != 0;
    }
    if (away) n += end - pos;
    pos = end;
  }
  return n;
}

void SessionCache::Shrink(int tokens) {
  tokens = std::max(tokens, 0);
  auto drop = [&](std::vector<PageRef>* pages, std::vector<uint8_t*>* data,
                  int keep) {
    if (int(pages->size()) > keep) {
      ReturnPages(pages->data() + keep, pages->size() - keep);
      pages->resize(keep);
      data->resize(keep);
    }
  };
  for (size_t l = 0; l < pages_.size(); ++l) {
    drop(&pages_[l], &page_data_[l], layout_->KvPagesFor(tokens));
    drop(&index_pages_[l], &index_page_data_[l],
         layout_->IndexPagesFor(tokens));
  }
  reserved_tokens_ = std::min(reserved_tokens_, Capacity());
  for (int& length : lengths_) length = std::min(length, reserved_tokens_);
}

}  // namespace karat
