// Paged storage of a session's per-layer cache entries (DESIGN.md §3): a
// capacity-bounded arena cut into fixed-size pages, and per-session page
// tables. Used by the KARAT-node devices and, with a large arena, by the
// reference engine, so both read entries through the same code. A session's
// pages may come from several arenas (the devices of one node, when its home
// device is full); kernels see them through LayerView either way.
//
// A layer's pages are of two kinds, both of the arena's one page size:
//   KV pages, `tokens_per_page` tokens each:
//     [kv:    tpp x kv_dim   bf16 ]   mla_dsa: c (kv_lora) | k_pe (rope)
//   index pages (DSA index keys only), index_tokens_per_page tokens each:
//     [ikey:   blocks x pairs x 64 ]   fp8 codes, pair-major
//     [iscale: blocks x 32 f32     ]   their scales
// each section padded to 64 bytes. The indexer's scan reads every index key
// of a layer and nothing else, so the keys of many KV pages' tokens sit
// together in one index page (dsa-tiny: 512 tokens in 18 KiB, beside KV
// pages of 64): kept in every KV page, they came in 2.3 KiB runs 20 KiB
// apart, which both cores read from DRAM at about two thirds of the rate of
// the same bytes in one run (34 against 53 GB/s, one measurement). Index keys
// are kept in blocks of kIndexKeyBlock (32) consecutive slots, as many blocks
// as fit a page (at least one: a page is then made large enough). Within a
// block, code pair p (dims 2p, 2p + 1; an odd dimension is padded with a zero
// code) of all 32 keys is one 64-byte row, key j's two codes at bytes 2
// IndexKeySlot(j) and 2 IndexKeySlot(j) + 1 of it. That is the layout the
// indexer's scan multiplies (32 keys in the lanes of two vectors, one pair at a
// time), so a scan only widens the codes and never transposes them; the slot
// order is the one in which the widening's in-lane byte interleave leaves the
// keys in natural order (see WidenPairRows in attention_internal.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_config.h"

namespace karat {

// Index keys per stored block (see the page layout above).
constexpr int kIndexKeyBlock = 32;

// The slot of key j (0 <= j < 32) in a block's pair rows: 8 L + r holds key
// 4 L + r for r < 4 and key 16 + 4 L + r - 4 for r >= 4.
constexpr int IndexKeySlot(int j) {
  return 8 * ((j & 15) >> 2) + (j & 3) + (j >= 16 ? 4 : 0);
}

struct KvLayout {
  int tokens_per_page = 64;  // of a KV page
  int kv_dim = 0;            // bf16 values per token
  // A token's kv_dim values are kv_parts parts, in order: the first
  // wide_parts of part_dim values, the others of tail_dim. A KV page holds
  // each part's rows together, part after part (a section of
  // tokens_per_page rows each): MLA has one part (the whole entry, [c |
  // k_pe]); GQA one per KV head's k, then v, then block index keys, so
  // that a head's rows of consecutive positions are contiguous.
  int kv_parts = 1;
  int wide_parts = 1;
  int part_dim = 0;
  int tail_dim = 0;
  int index_dim = 0;  // fp8 codes per token (0: no index keys)
  // Index keys per index page, whole blocks of kIndexKeyBlock (0 without
  // index keys).
  int index_tokens_per_page = 0;
  size_t kv_offset = 0;                       // in a KV page
  size_t ikey_offset = 0, iscale_offset = 0;  // in an index page
  size_t page_bytes = 0;
  int num_layers = 0;
  // Bytes of one token's entries in one layer (without padding).
  size_t TokenBytes() const;
  // Code pairs a key holds: ceil(index_dim / 2).
  int IndexPairs() const { return (index_dim + 1) / 2; }
  // Bytes of one block of index keys: a 64-byte row per pair.
  size_t IndexBlockBytes() const { return size_t(IndexPairs()) * 64; }
  // Blocks of index keys in an index page.
  int IndexBlocksPerPage() const {
    return index_tokens_per_page / kIndexKeyBlock;
  }
  // Pages (KV and index) one layer needs for `tokens` positions.
  int KvPagesFor(int tokens) const {
    return (tokens + tokens_per_page - 1) / tokens_per_page;
  }
  int IndexPagesFor(int tokens) const {
    return index_tokens_per_page > 0
               ? (tokens + index_tokens_per_page - 1) / index_tokens_per_page
               : 0;
  }
  int PagesFor(int tokens) const {
    return KvPagesFor(tokens) + IndexPagesFor(tokens);
  }
  // Part p's values: how many, and where they start in a token's entry.
  int PartDim(int p) const {
    return kv_parts == 1 ? kv_dim : p < wide_parts ? part_dim : tail_dim;
  }
  int PartStart(int p) const {
    return p <= wide_parts
               ? p * part_dim
               : wide_parts * part_dim + (p - wide_parts) * tail_dim;
  }
  // Byte offset of part p's row for the page's `slot`-th token.
  size_t PartOffset(int p, int slot) const {
    return kv_offset + size_t(tokens_per_page) * PartStart(p) * 2 +
           size_t(slot) * PartDim(p) * 2;
  }
};
KvLayout MakeKvLayout(const ModelConfig& config, int tokens_per_page);

// A fixed-capacity arena of pages. Thread-safe.
class PageArena {
 public:
  // capacity_bytes is rounded down to whole pages. Memory is reserved with
  // mmap (MADV_HUGEPAGE) and touched only when used.
  static absl::StatusOr<std::unique_ptr<PageArena>> Create(
      size_t capacity_bytes, size_t page_bytes);
  ~PageArena();
  // Allocates `n` pages or none: RESOURCE_EXHAUSTED when fewer are free.
  absl::Status Allocate(int n, std::vector<int32_t>* pages);
  void Free(const std::vector<int32_t>& pages);
  uint8_t* Page(int32_t id) const { return base_ + size_t(id) * page_bytes_; }
  size_t page_bytes() const { return page_bytes_; }
  int total_pages() const { return total_pages_; }
  int free_pages() const;
  size_t used_bytes() const;

 private:
  PageArena() = default;
  uint8_t* base_ = nullptr;
  size_t map_bytes_ = 0;
  size_t page_bytes_ = 0;
  int total_pages_ = 0;
  mutable std::mutex mu_;
  std::vector<int32_t> free_list_;
};

// How `need` new pages are spread over the arenas of one node (DESIGN.md §3
// "Placement"): `free_pages[0]` is the home arena's free page count, the
// others those of the node's other arenas. The home takes as many as it has
// room for; only the rest spill, to the other arenas in decreasing order of
// free pages (ties: lower index), each filled before the next. Returns the
// count taken from each arena, or RESOURCE_EXHAUSTED when all of them
// together have fewer than `need` free pages. Pure.
absl::StatusOr<std::vector<int>> PlanPageSpill(
    const std::vector<int>& free_pages, int need);

// One layer of one session, as the kernels read it. Valid until the cache
// it came from next grows (SessionCache::Reserve) or shrinks.
struct LayerView {
  const KvLayout* layout = nullptr;
  // The base address of each KV page and of each index page of the layer,
  // in position order. Pages may come from more than one arena (a session
  // spilled across the devices of a node); kernels read them in place.
  const uint8_t* const* pages = nullptr;
  const uint8_t* const* index_pages = nullptr;
  int length = 0;  // tokens stored

  // The bytes of the layer's `index`-th KV page (positions from index x
  // tokens_per_page) and index page (from index x index_tokens_per_page).
  // Kernels reach pages only through these and the accessors below.
  const uint8_t* PageData(int index) const { return pages[index]; }
  const uint8_t* IndexPageData(int index) const { return index_pages[index]; }
  // Part `part`'s row of position pos (KvLayout: the whole entry where
  // the layout has one part, as MLA's).
  const uint16_t* Part(int pos, int part) const {
    const int tpp = layout->tokens_per_page;
    return reinterpret_cast<const uint16_t*>(
        pages[pos / tpp] + layout->PartOffset(part, pos % tpp));
  }
  // The whole entry of position pos, where the layout has one part (MLA).
  const uint16_t* Kv(int pos) const { return Part(pos, 0); }
  // Copies position pos's kv_dim values, part after part, to out.
  void ReadKv(int pos, uint16_t* out) const;
  // Part(positions[j], part) for j in [0, n), into out[0, n): a shift and
  // a mask in place of the division where the page's token count is a
  // power of two (2048 addresses: 4.6 us with the division, 1.7 us
  // without, on one core here).
  void PartRows(const int32_t* positions, int n, int part,
                const uint16_t** out) const;
  void KvEntries(const int32_t* positions, int n, const uint16_t** out) const {
    PartRows(positions, n, 0, out);
  }
  // The pair rows of block `block` of index page `index` (the layout
  // above).
  const uint8_t* IndexKeyBlock(int index, int block) const {
    return index_pages[index] + layout->ikey_offset +
           size_t(block) * layout->IndexBlockBytes();
  }
  // The scales of index page `index`, by slot.
  const float* IndexScales(int index) const {
    return reinterpret_cast<const float*>(index_pages[index] +
                                          layout->iscale_offset);
  }
  // The 32 scales of block `block` of index page `index`.
  const float* IndexBlockScales(int index, int block) const {
    return IndexScales(index) + size_t(block) * kIndexKeyBlock;
  }
  // Key `pos`'s index_dim codes, in dimension order, into codes[].
  void IndexKeyCodes(int pos, uint8_t* codes) const;
  float IndexScale(int pos) const {
    const int itpp = layout->index_tokens_per_page;
    return IndexScales(pos / itpp)[pos % itpp];
  }
};

// A session's cache: per layer a page table and a length, plus the pages
// held to account for the attention method's metadata. Pages come from the
// home arena and, when it is full, spill to the other arenas it was given
// (PlanPageSpill); every page goes back to its own arena. All arenas must
// have the layout's page size and outlive the cache.
// Not thread-safe; its owner serialises access.
class SessionCache {
 public:
  // Every page on `arena`.
  SessionCache(const KvLayout* layout, PageArena* arena);
  // `arenas[0]` is the home arena; the others take what it cannot hold.
  SessionCache(const KvLayout* layout, std::vector<PageArena*> arenas);
  ~SessionCache();  // frees its pages
  SessionCache(const SessionCache&) = delete;
  SessionCache& operator=(const SessionCache&) = delete;

  // Makes room for `tokens` positions in every layer (all or nothing:
  // RESOURCE_EXHAUSTED and no page taken when the arenas cannot supply them).
  absl::Status Reserve(int tokens);
  int reserved_tokens() const { return reserved_tokens_; }
  // Holds ceil(bytes / page_bytes) pages for the metadata kept beside the
  // cache (growing or shrinking what is held), so that it counts against
  // the arenas' capacity. All or nothing: RESOURCE_EXHAUSTED and nothing
  // changed when the arenas cannot supply the growth.
  absl::Status ChargeMetadata(size_t bytes);
  int metadata_pages() const { return int(metadata_pages_.size()); }
  // Drops positions >= length in `layer` (a resent position overwrites).
  void Truncate(int layer, int length);
  int length(int layer) const { return lengths_[layer]; }
  // Appends one token's entries at position length(layer); the caller has
  // reserved room. `index_key` may be null when the layout has none.
  absl::Status Append(int layer, const uint16_t* kv, const uint8_t* index_key,
                      float index_scale);
  // Writes one entry at `pos` (< reserved_tokens(), else RESOURCE_EXHAUSTED)
  // without changing length(layer): the index key arrives before the KV entry
  // of the same token (DESIGN.md §2), so the two are written separately.
  // `kv` is the token's kv_dim values in entry order; each part goes to its
  // own section of the page (KvLayout).
  absl::Status WriteKv(int layer, int pos, const uint16_t* kv);
  absl::Status WriteIndexKey(int layer, int pos, const uint8_t* codes,
                             float scale);
  // The same for `n` consecutive positions from `pos` (token-major input:
  // kv n x kv_dim, codes n x index_dim, scales n), one copy per page run
  // (per part and token where the layout has several parts); nothing is
  // written unless every position is reserved.
  absl::Status WriteKvRun(int layer, int pos, int n, const uint16_t* kv);
  absl::Status WriteIndexKeyRun(int layer, int pos, int n, const uint8_t* codes,
                                const float* scales);
  // Sets the number of valid positions of `layer` (<= reserved_tokens()).
  void SetLength(int layer, int length);
  LayerView View(int layer) const;
  size_t bytes() const;  // pages held (KV, index, metadata) x page bytes
  // Pages held on each arena (KV, index and metadata), indexed like the
  // arenas.
  const std::vector<int>& PagesPerArena() const { return pages_per_arena_; }
  // Stored positions (< length(layer)) with a page (KV or index keys) that
  // is not on the home arena.
  int SpilledPositions(int layer) const;
  // Frees pages beyond what `tokens` positions need.
  void Shrink(int tokens);

 private:
  // A page: the arena it came from (index into arenas_) and its id there.
  struct PageRef {
    int32_t arena;
    int32_t id;
  };
  // Positions the pages held for every layer have room for.
  int Capacity() const;
  // Takes `n` pages (home first, then spilled) or none.
  absl::Status TakePages(int n, std::vector<PageRef>* out);
  void ReturnPages(const PageRef* pages, size_t n);
  uint8_t* PageAddress(PageRef p) const { return arenas_[p.arena]->Page(p.id); }

  const KvLayout* layout_;
  std::vector<PageArena*> arenas_;  // [0]: home
  int reserved_tokens_ = 0;
  // Per layer: the KV pages and, in the same order, their base addresses;
  // the same for the index pages (none without index keys).
  std::vector<std::vector<PageRef>> pages_, index_pages_;
  std::vector<std::vector<uint8_t*>> page_data_, index_page_data_;
  std::vector<PageRef> metadata_pages_;
  std::vector<int> lengths_;
  std::vector<int> pages_per_arena_;
};

}  // namespace karat
