# The GQA attention forms of MODEL.md behind the kernel interface of
# common/sparse_attention.h: the driver and registry, then one file per
# method.
target_sources(karat_common PRIVATE
  common/sparse_attention.cc
  common/attn_gqa_dense.cc
  common/attn_gqa_block.cc
  common/attn_quest.cc
  common/attn_magicpig.cc
  common/attn_clusterkv.cc)
