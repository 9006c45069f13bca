// The layer driver: the attention shapes of a model (MakeAttnShapes), and
// one layer's indexer (RunIndexer) and attention (RunAttention) for a
// segment. The kernels they call live in attention_indexer*.cc (Score),
// attention_topk.cc (Select) and attention_mla*.cc (Gather + Attend).

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <new>
#include <numeric>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/numeric.h"
#include "common/simd_reduce.h"
#include "common/attention_internal.h"
#include "common/status_macros.h"

// GCC 12 reports its own AVX-512 intrinsic headers (_mm512_undefined_*)
// as (maybe-)uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace karat {

AttnShapes MakeAttnShapes(const ModelConfig& c) {
  AttnShapes s;
  s.heads = c.num_attention_heads;
  if (c.attention.type == AttentionType::kMlaDsa) {
    s.kv_lora = c.kv_lora_rank;
    s.rope = c.qk_rope_head_dim;
    s.kv_dim = s.kv_lora + s.rope;
    s.q_dim = s.kv_dim;
    s.out_dim = s.kv_lora;
    s.index_heads = c.index_n_heads;
    s.index_dim = c.index_head_dim;
    s.index_topk = c.index_topk;
    s.softmax_scale =
        1.0f / std::sqrt(float(c.qk_nope_head_dim + c.qk_rope_head_dim));
  } else {
    s.kv_heads = c.num_key_value_heads;
    s.head_dim = c.head_dim;
    if (c.attention.type == AttentionType::kGqaBlock) {
      s.block_index_dim = c.index_head_dim;
    }
    s.kv_dim = (2 * c.head_dim + s.block_index_dim) * s.kv_heads;
    s.q_dim = c.head_dim + s.block_index_dim;
    s.out_dim = c.head_dim;
    s.softmax_scale = 1.0f / std::sqrt(float(c.head_dim));
  }
  return s;
}
absl::Status RunIndexer(const AttnShapes& shapes, int layer, int pos_start,
                        int n, const IndexInputs& in, SessionCache* cache,
                        SelectionState* sel, CorePool* pool, KernelCost* cost) {
  if (shapes.index_dim == 0) {
    return absl::FailedPreconditionError("the model has no DSA indexer");
  }
  if (pos_start < 0 || n <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad segment: pos_start ", pos_start, ", n ", n));
  }
  if (pos_start > cache->length(layer)) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " holds ", cache->length(layer),
                     " positions; a segment cannot start at ", pos_start));
  }
  const int hi = shapes.index_heads, di = shapes.index_dim;
  RETURN_IF_ERROR(
      cache->WriteIndexKeyRun(layer, pos_start, n, in.k_codes, in.k_scales));
  // Index keys of this layer are valid up to pos_start + n; the KV entries
  // follow in RunAttention, which sets the layer's length.
  const LayerView view = cache->View(layer);
  sel->pos_start = pos_start;
  sel->per_token.resize(n);
  // The segment's queries scan together: each key block is decoded once
  // for every query whose causal prefix holds it, and each (query, key)
  // score is computed exactly as a lone query would (see IndexerScore).
  // Queries go in chunks so the score buffer stays bounded.
  constexpr int kQueryChunk = 64;
  std::vector<int> limit;
  std::vector<float*> outs;
  thread_local std::vector<float> scores;  // reused: see MlaAttend
  double bytes = 0, flops = 0;
  for (int c0 = 0; c0 < n; c0 += kQueryChunk) {
    const int nq = std::min(kQueryChunk, n - c0);
    const int ctx_max = pos_start + c0 + nq;
    limit.resize(nq);
    outs.resize(nq);
    scores.resize(size_t(nq) * ctx_max);
    for (int i = 0; i < nq; ++i) {
      limit[i] = pos_start + c0 + i + 1;
      outs[i] = &scores[size_t(i) * ctx_max];
      flops += 2.0 * limit[i] * hi * di;
    }
    IndexerScoreQueries(view, nq, in.q_codes + size_t(c0) * hi * di,
                        in.q_scales + size_t(c0) * hi,
                        in.weights + size_t(c0) * hi, hi, di, limit.data(),
                        outs.data(), pool);
    if (nq == 1) {  // a decode step: its Select takes the cores
      SelectTopK(outs[0], limit[0], shapes.index_topk, &sel->per_token[c0],
                 pool);
    } else {
      ParallelFor(pool, nq, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          SelectTopK(outs[i], limit[i], shapes.index_topk,
                     &sel->per_token[c0 + i]);
        }
      });
    }
    bytes += double(ctx_max) * (di + 4) + double(nq) * hi * (di + 8);
  }
  if (cost != nullptr) {
    cost->bytes += bytes;
    cost->flops += flops;
  }
  return absl::OkStatus();
}

absl::Status RunAttention(const AttnShapes& shapes, int layer, int pos_start,
                          int n, const AttnInputs& in, SessionCache* cache,
                          const SelectionState* sel, float* out, CorePool* pool,
                          KernelCost* cost) {
  if (shapes.kv_dim == 0) {
    return absl::UnimplementedError(
        "only the mla_dsa attention form is served by this build");
  }
  if (shapes.kv_heads > 0) {
    return absl::FailedPreconditionError(
        "GQA attention forms run through RunAttentionLayer "
        "(common/sparse_attention.h)");
  }
  if (pos_start < 0 || n <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad segment: pos_start ", pos_start, ", n ", n));
  }
  if (pos_start > cache->length(layer)) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " holds ", cache->length(layer),
                     " positions; a segment cannot start at ", pos_start));
  }
  if (sel != nullptr &&
      (sel->pos_start != pos_start || int(sel->per_token.size()) != n)) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, ": no index selection for positions ",
                     pos_start, "..", pos_start + n - 1));
  }
  RETURN_IF_ERROR(cache->WriteKvRun(layer, pos_start, n, in.kv));
  cache->SetLength(layer, pos_start + n);
  const LayerView view = cache->View(layer);
  auto attend_token = [&](int i, CorePool* p, std::vector<int32_t>* dense) {
    const int32_t* positions;
    int count;
    if (sel != nullptr) {
      positions = sel->per_token[i].data();
      count = static_cast<int>(sel->per_token[i].size());
    } else {
      dense->resize(pos_start + i + 1);
      std::iota(dense->begin(), dense->end(), 0);
      positions = dense->data();
      count = static_cast<int>(dense->size());
    }
    MlaAttend(view, positions, count,
              in.q + size_t(i) * shapes.heads * shapes.q_dim, shapes,
              out + size_t(i) * shapes.heads * shapes.out_dim, p);
  };
  // One token splits its heads over the cores; a segment splits its tokens.
  // Either way each output element gets the same arithmetic.
  if (n == 1) {
    std::vector<int32_t> dense;
    attend_token(0, pool, &dense);
  } else {
    ParallelFor(pool, n, 1, [&](int64_t b, int64_t e) {
      std::vector<int32_t> dense;
      for (int64_t i = b; i < e; ++i) attend_token(int(i), nullptr, &dense);
    });
  }
  if (cost != nullptr) {
    double entries = 0;
    for (int i = 0; i < n; ++i) {
      entries += sel != nullptr ? double(sel->per_token[i].size())
                                : double(pos_start + i + 1);
    }
    cost->bytes +=
        entries * shapes.kv_dim * 2 +
        double(n) * shapes.heads * (shapes.q_dim + shapes.out_dim) * 4;
    cost->flops += entries * shapes.heads *
                   (2.0 * shapes.kv_dim + 2.0 * shapes.kv_lora + 4.0);
  }
  return absl::OkStatus();
}

}  // namespace karat
